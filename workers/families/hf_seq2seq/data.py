"""The ``hf_seq2seq`` evaluation set from either way a data section gives it: raw parallel text (``source`` /
``target``, read as ``fairseq_translation`` reads it) or one TSV or JSONL file of pairs (``path``,
:mod:`headsweep.workers.data.parallel_file`). Both give the same sentences to the model: which way the data came
is seen only in the dataset's default name and in where messages point."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.workers.data.parallel_file import read_parallel_file
from headsweep.workers.data.text_files import parallel_set_name
from headsweep.workers.families.fairseq_translation.data import read_parallel_text
from headsweep.workers.families.hf_seq2seq.config import Seq2SeqData


@dataclass
class ParallelText:
    """Source sentences and references in file order (cut to ``max_examples``), where each pair's source is as
    messages name it (``data.source line 3``, ``data file x.tsv: the source on line 3``), and the data set's name
    (``data.name``, else the file's name without its language suffix and extension)."""

    sources: list[str]
    targets: list[str]
    source_places: list[str]
    name: str


def read_seq2seq_data(data_cfg: Seq2SeqData, key: str = "data") -> ParallelText:
    """The pairs of the data section ``data_cfg`` (config key ``key``), or one line saying what is wrong with them
    (checked by :meth:`Seq2SeqData.check` first: one way of giving the data)."""
    if data_cfg.path:
        rows = read_parallel_file(data_cfg, key)
        places = [f"data file {data_cfg.path}: the source on line {line}" for line in rows.lines]
        return ParallelText(rows.sources, rows.targets, places, data_cfg.name or parallel_set_name(data_cfg.path))
    sources, targets = read_parallel_text(data_cfg, key)
    if not sources:
        raise HeadsweepError(f"{key}.source {data_cfg.source} has no sentences")
    places = [f"{key}.source line {i + 1}" for i in range(len(sources))]
    return ParallelText(sources, targets, places, data_cfg.name or parallel_set_name(Path(data_cfg.source or "data")))
