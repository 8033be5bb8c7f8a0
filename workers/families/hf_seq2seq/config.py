"""Config sections of the ``hf_seq2seq`` model family (kept free of torch imports).

The data section reads the ``fairseq_translation`` family's raw-text keys (``data.source`` / ``data.target``,
``data.max_examples``, ``data.name``, ``data.encoding``), so a translation config moves between the two families by
its ``model`` section alone; the transformers tokenizer does what fairseq's BPE keys do there. It also reads one
TSV or JSONL file of pairs instead (``data.path``), which ``fairseq_translation`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.setting_ranges import MAX_EXAMPLES, ranged
from headsweep.workers.core.translation_scores import check_translation_metric
from headsweep.workers.data.parallel_file import pair_format
from headsweep.workers.data.text_files import check_encoding


@dataclass
class Seq2SeqModel:
    """A transformers encoder-decoder model (Marian, M2M100 / NLLB, mBART, BART, T5 / mT5) saved with
    ``save_pretrained``, or a hub id in the local cache, and how to decode with it.

    Decoding is ``model.generate`` with beam search: ``num_beams``, ``max_new_tokens`` and ``length_penalty`` come
    from the model's own generation config (``generation_config.json``) unless set here. ``source_lang`` /
    ``target_lang`` are the language codes a multilingual tokenizer needs (NLLB ``eng_Latn`` / ``fra_Latn``, M2M100
    ``en`` / ``fr``, mBART ``en_XX`` / ``fr_XX``): the target's code is the token generation is forced to start with.
    ``prefix`` is put before every source sentence (T5's task prefix, e.g. ``"translate English to German: "``).
    """

    kind: str = "hf_seq2seq"
    path: str = ""
    tokenizer: str | None = None
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"
    name: str | None = None
    num_beams: int | None = ranged(None, at_least=1)
    max_new_tokens: int | None = ranged(None, at_least=1)
    length_penalty: float | None = ranged(None)
    source_lang: str | None = None
    target_lang: str | None = None
    prefix: str = ""


@dataclass
class Seq2SeqData:
    """The evaluation set, given one of two ways: raw parallel text, ``source`` and ``target`` files (one sentence a
    line, plain or ``.gz``) as ``fairseq_translation`` reads them; or ``path``, one file of pairs
    (:mod:`headsweep.workers.data.parallel_file`): TSV (the source, a tab, the target; no header line) or JSONL (an
    object a line, its ``source_field`` and ``target_field`` the pair), the format from ``format`` or the file's
    suffix. The targets are the references as written. ``max_examples`` keeps the first pairs. ``metric`` scores the
    hypotheses: ``bleu`` (sacrebleu's corpus BLEU) or ``chrf`` (sacrebleu's chrF), from per-sentence statistics
    either way."""

    source: str | None = None
    target: str | None = None
    path: str | None = None
    format: str | None = None  # tsv | jsonl; None: from the suffix of path
    source_field: str = "source"
    target_field: str = "target"
    max_examples: int | None = ranged(None, within=MAX_EXAMPLES)
    name: str | None = None
    encoding: str = "utf-8"
    metric: str = "bleu"

    def check(self, key: str = "data") -> None:
        """What can be checked without the model or the files (the worker checks the rest): the encoding, the
        metric, and exactly one way of giving the data, with only the keys that way reads."""
        check_encoding(self.encoding, f"{key}.encoding")
        check_translation_metric(self.metric, f"{key}.metric")
        if self.path and (self.source or self.target):
            raise HeadsweepError(f"{key}.path and {key}.source / {key}.target are two ways of giving the data: give "
                                 f"{key}.path (one TSV or JSONL file of pairs) or {key}.source and {key}.target (raw "
                                 "text files, one sentence a line), not both")
        file_keys = [name for name in PATH_ONLY_KEYS if getattr(self, name) != getattr(Seq2SeqData, name)]
        if not self.path:
            if not self.source or not self.target:
                raise HeadsweepError(f"config needs {key}.source and {key}.target (raw parallel text files, one "
                                     f"sentence a line) or {key}.path (a TSV or JSONL file of pairs)")
            if file_keys:
                raise HeadsweepError(f"{key}.{file_keys[0]} applies to {key}.path (a TSV or JSONL file of pairs), "
                                     f"not to raw text files ({key}.source / {key}.target): remove it")
            return
        fmt = pair_format(self, key)
        fields = [name for name in file_keys if name != "format"]
        if fmt == "tsv" and fields:
            raise HeadsweepError(f"{key}.{fields[0]} names a JSONL field, but {key}.path is read as tsv, whose "
                                 "columns are the source, then the target (no header line): remove it")
        if not self.source_field or not self.target_field or self.source_field == self.target_field:
            raise HeadsweepError(f"{key}.source_field and {key}.target_field must name two fields of the JSONL "
                                 f"objects, got {self.source_field!r} and {self.target_field!r}")


# The keys only data.path reads (raw text files have neither format nor fields).
PATH_ONLY_KEYS = ("format", "source_field", "target_field")


@dataclass
class Seq2SeqRuntime(RuntimeOptions):
    """How the hf_seq2seq adapter runs: :class:`RuntimeOptions` and ``sweep.loss``, as ``fairseq_translation`` reads
    it: the teacher-forced pass per mask that fills ``examples.loss`` (else null; it costs a pass of its own)."""

    loss: bool = False
