"""Reading labelled classification data from TSV, CSV, JSONL or Parquet files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_classifier.config import ClassifierData

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class ClassificationExamples:
    ids: list[str]
    texts: list[str]
    text_pairs: list[str] | None
    labels: list[str]


def _read_table(path: Path, fmt: str) -> pa.Table:
    try:
        if fmt == "tsv":
            # Quoting off: sentences hold quotes that are text, not CSV quoting (as in GLUE files).
            return pacsv.read_csv(
                path,
                parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                convert_options=pacsv.ConvertOptions(strings_can_be_null=False),
            )
        if fmt == "csv":
            return pacsv.read_csv(path)
        if fmt == "jsonl":
            return pajson.read_json(path)
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise HeadsweepError(f"cannot read data file {path} as {fmt}: {str(exc).splitlines()[0]}") from None


def read_examples(cfg: ClassifierData) -> ClassificationExamples:
    """Read the configured file, check its columns, and return texts and raw labels."""
    if not cfg.path:
        raise HeadsweepError("config key 'data.path' is required")
    path = Path(cfg.path)
    if not path.is_file():
        raise HeadsweepError(f"data file not found: {path}")
    fmt = cfg.format or FORMATS.get(path.suffix.lower())
    if fmt not in set(FORMATS.values()):
        raise HeadsweepError(
            f"cannot tell the format of data file {path}: set data.format to one of tsv, csv, jsonl, parquet"
        )
    table = _read_table(path, fmt)
    wanted = [c for c in (cfg.text_column, cfg.text_pair_column, cfg.label_column, cfg.id_column) if c]
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise HeadsweepError(
            f"data file {path} has no column {missing[0]!r} (columns: {', '.join(table.column_names)}); "
            f"set data.text_column / data.label_column"
        )
    if cfg.max_examples is not None:
        table = table.slice(0, cfg.max_examples)
    if table.num_rows == 0:
        raise HeadsweepError(f"data file {path} has no examples")

    def column(name: str) -> list[str]:
        values = table.column(name).to_pylist()
        if any(v is None for v in values):
            row = values.index(None)
            raise HeadsweepError(f"data file {path}: column {name!r} is empty in row {row}")
        return [str(v) for v in values]

    ids = column(cfg.id_column) if cfg.id_column else [str(i) for i in range(table.num_rows)]
    if len(set(ids)) != len(ids):
        raise HeadsweepError(f"data file {path}: column {cfg.id_column!r} has duplicate ids")
    return ClassificationExamples(
        ids=ids,
        texts=column(cfg.text_column),
        text_pairs=column(cfg.text_pair_column) if cfg.text_pair_column else None,
        labels=column(cfg.label_column),
    )
