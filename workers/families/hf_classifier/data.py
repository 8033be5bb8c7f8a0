"""Reading labelled classification data from TSV, CSV, JSONL or Parquet files.

Text is read as text: the file's bytes are decoded with ``data.encoding`` (UTF-8 unless set)
before pyarrow parses them, and the configured columns are read as strings (an id ``007`` stays
``007``). What looks wrong but is not an error (empty texts, repeated inputs) is found here and
counted (:func:`findings`), never changed.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.workers.data_report import Finding
from headsweep.workers.families.hf_classifier.config import ClassifierData
from headsweep.workers.text_files import check_encoding, decode, read_bytes

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class ClassificationExamples:
    ids: list[str]
    texts: list[str]
    text_pairs: list[str] | None
    labels: list[str]


def _utf8_source(path: Path, encoding: str) -> pa.BufferReader:
    """The file as UTF-8 bytes for pyarrow, after a strict decode with ``encoding``."""
    data, where = read_bytes(path)
    text = decode(data, encoding, f"data file {path}", where=where)
    if check_encoding(encoding) != "utf-8" or data.startswith(codecs.BOM_UTF8):
        data = text.encode("utf-8")  # transcoded, or the byte order mark dropped
    return pa.BufferReader(data)


def _read_table(path: Path, fmt: str, cfg: ClassifierData, columns: list[str]) -> pa.Table:
    as_text = pacsv.ConvertOptions(column_types={c: pa.string() for c in columns}, strings_can_be_null=False)
    try:
        if fmt == "parquet":
            return _decoded_binary(pq.read_table(path), columns, cfg.encoding, path)
        source = _utf8_source(path, cfg.encoding)
        if fmt == "tsv":
            # Quoting off: sentences hold quotes that are text, not CSV quoting (as in GLUE files).
            return pacsv.read_csv(source, parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                                  convert_options=as_text)
        if fmt == "csv":
            return pacsv.read_csv(source, convert_options=as_text)
        return pajson.read_json(source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise HeadsweepError(f"cannot read data file {path} as {fmt}: {str(exc).splitlines()[0]}") from None


def _decoded_binary(table: pa.Table, columns: list[str], encoding: str, path: Path) -> pa.Table:
    """Parquet ``binary`` columns among ``columns`` decoded strictly (a str of bytes would read ``b'...'``)."""
    codec = check_encoding(encoding)
    for name in columns:
        if name not in table.column_names:
            continue
        column = table.column(name)
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            continue
        values = column.to_pylist()
        for row, value in enumerate(values):
            try:
                values[row] = None if value is None else value.decode(codec)
            except UnicodeDecodeError as exc:
                raise HeadsweepError(
                    f"data file {path}: column {name!r} row {row} is not valid {encoding} text (byte "
                    f"0x{value[exc.start]:02x} at byte offset {exc.start} of the value): set data.encoding to "
                    "the text's encoding (e.g. latin-1 or cp1252), or fix the file"
                ) from None
        table = table.set_column(table.column_names.index(name), name, pa.array(values, pa.string()))
    return table


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
    wanted = [c for c in (cfg.text_column, cfg.text_pair_column, cfg.label_column, cfg.id_column) if c]
    table = _read_table(path, fmt, cfg, wanted)
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

    def column(name: str, text: bool = False) -> list[str]:
        values = table.column(name).to_pylist()
        if any(v is None for v in values):
            row = values.index(None)
            raise HeadsweepError(f"data file {path}: column {name!r} is empty in row {row}")
        if text:
            odd = next((i for i, v in enumerate(values) if isinstance(v, (list, dict, bytes))), None)
            if odd is not None:
                raise HeadsweepError(f"data file {path}: column {name!r} holds a {type(values[odd]).__name__}, "
                                     f"not text, in row {odd}")
        return [str(v) for v in values]

    ids = column(cfg.id_column) if cfg.id_column else [str(i) for i in range(table.num_rows)]
    _check_unique(ids, cfg.id_column, path)
    return ClassificationExamples(
        ids=ids,
        texts=column(cfg.text_column, text=True),
        text_pairs=column(cfg.text_pair_column, text=True) if cfg.text_pair_column else None,
        labels=column(cfg.label_column),
    )


def _check_unique(ids: list[str], id_column: str | None, path: Path) -> None:
    """Example ids key the stored per-example rows (and resuming a run): a repeated id is refused."""
    first: dict[str, int] = {}
    repeated = []
    for row, example_id in enumerate(ids):
        if example_id in first:
            repeated.append((example_id, first[example_id], row))
        else:
            first[example_id] = row
    if repeated:
        example_id, a, b = repeated[0]
        raise HeadsweepError(
            f"data file {path}: column {id_column!r} has {len(repeated)} duplicate ids (first: {example_id!r} "
            f"in rows {a} and {b}): example ids must be unique, they key the stored per-example results"
        )


def findings(ex: ClassificationExamples) -> list[Finding]:
    """Examples that look wrong but are evaluated as they are: empty (or blank) texts, and inputs
    that repeat an earlier example (with the same or another label)."""
    pairs = ex.text_pairs or [None] * len(ex.texts)
    empty = Finding("empty_texts", "empty texts")
    repeated = Finding("duplicate_texts", "repeated inputs")
    relabelled = Finding("duplicate_texts_other_label", "repeated inputs with another label")
    seen: dict[tuple[str, str | None], int] = {}
    for i, (text, pair) in enumerate(zip(ex.texts, pairs, strict=True)):
        if not text.strip() or (pair is not None and not pair.strip()):
            empty.ids.append(ex.ids[i])
        key = (text, pair)
        if key in seen:
            repeated.ids.append(ex.ids[i])
            if ex.labels[seen[key]] != ex.labels[i]:
                relabelled.ids.append(ex.ids[i])
        else:
            seen[key] = i
    return [empty, repeated, relabelled]
