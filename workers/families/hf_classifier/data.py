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
from headsweep.workers.paired_data import read_pairs
from headsweep.workers.text_files import (
    check_encoding,
    check_file,
    check_max_examples,
    data_file,
    decode,
    read_bytes,
)

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
FORMAT_NAMES = ("tsv", "csv", "jsonl", "parquet")
# How many rows a message names before it says how many more there are.
SHOWN_ROWS = 5


@dataclass
class ClassificationExamples:
    """The examples in file order. Paired data (``data.task: paired``) also hold each pair's corrupted input, its
    wrong answer and its line in the file; ``texts`` and ``labels`` are then the clean inputs and the answers."""

    ids: list[str]
    texts: list[str]
    text_pairs: list[str] | None
    labels: list[str]
    corrupted: list[str] | None = None
    wrong_labels: list[str] | None = None
    lines: list[int] | None = None


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


def data_format(cfg: ClassifierData, key: str = "data") -> str:
    """``<key>.format``, or the one the file's suffix names; a one-line error for any other."""
    if cfg.format is not None:
        if cfg.format not in FORMAT_NAMES:
            raise HeadsweepError(f"{key}.format {cfg.format!r} is not a supported format (supported: "
                                 f"{', '.join(FORMAT_NAMES)})")
        return cfg.format
    fmt = FORMATS.get(Path(cfg.path).suffix.lower())
    if fmt is None:
        raise HeadsweepError(f"cannot tell the format of data file {cfg.path} from its suffix: set {key}.format to "
                             f"one of {', '.join(FORMAT_NAMES)}")
    return fmt


def check_data(cfg: ClassifierData, key: str = "data") -> Path:
    """What a classification data section (config key ``key``) says that needs no file: the path given, the
    format, ``max_examples``, the encoding, ``max_length``; and that the path names a file, which is returned."""
    if not cfg.path:
        raise HeadsweepError(f"config key '{key}.path' is required")
    cfg.check(key)
    check_max_examples(cfg.max_examples, f"{key}.max_examples")
    path = check_file(cfg.path, data_file(key), f"{key}.path")
    data_format(cfg, key)
    return path


def rows_text(rows: list[int]) -> str:
    """``row 3`` or ``rows 3, 7 and 9`` (0-based rows of data, as example positions count), the first few named."""
    if len(rows) == 1:
        return f"row {rows[0]}"
    shown = ", ".join(map(str, rows[:SHOWN_ROWS]))
    if len(rows) > SHOWN_ROWS:
        return f"rows {shown} and {len(rows) - SHOWN_ROWS} more"
    return f"rows {shown.rsplit(', ', 1)[0]} and {rows[-1]}"


def read_examples(cfg: ClassifierData, key: str = "data") -> ClassificationExamples:
    """Read the configured file (config key ``key``), check its columns, and return texts and raw labels."""
    path = check_data(cfg, key)
    if cfg.paired:
        pairs = read_pairs(cfg, key)[: cfg.max_examples]
        return ClassificationExamples(ids=[f"p{i}" for i in range(len(pairs))], texts=[p.clean for p in pairs],
                                      text_pairs=None, labels=[p.answer for p in pairs],
                                      corrupted=[p.corrupted for p in pairs],
                                      wrong_labels=[p.wrong_answer for p in pairs], lines=[p.line for p in pairs])
    fmt = data_format(cfg, key)
    keys = {"text_column": cfg.text_column, "text_pair_column": cfg.text_pair_column,
            "label_column": cfg.label_column, "id_column": cfg.id_column}
    wanted = [c for c in keys.values() if c]
    table = _read_table(path, fmt, cfg, wanted)
    missing = [(name, c) for name, c in keys.items() if c and c not in table.column_names]
    if missing:
        name, c = missing[0]
        raise HeadsweepError(
            f"data file {path} has no column {c!r} (columns: {', '.join(table.column_names)}); "
            f"set {key}.{name} to one of them"
        )
    if cfg.max_examples is not None:
        table = table.slice(0, cfg.max_examples)
    if table.num_rows == 0:
        raise HeadsweepError(f"data file {path} has no examples")

    def column(name: str, text: bool = False) -> list[str]:
        values = table.column(name).to_pylist()
        if name == cfg.label_column:
            empty = [i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip())]
            if empty:
                raise HeadsweepError(f"data file {path}: empty label in {rows_text(empty)} (column {name!r}): "
                                     "every example needs its label")
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


def label_ids(raw: list[str], id2label: dict[int, str], path: str) -> list[int]:
    """Map the file's labels (``raw``, in row order) onto the model's label ids: every label a label name, or
    every label an id in range; else one line naming the labels (quoted) that are neither, with their rows, or
    the two ways of writing a label the file mixes.

    A label that is both a name and an id means two labels where ``id2label`` names its labels with other ids'
    numbers (``{0: "1", 1: "0"}``): which one the file means cannot be told, so it is refused
    (:func:`_check_numeric_names`). Numeric names that are their own ids (``{0: "0", 1: "1"}``) read the same
    either way."""
    names = {str(name): int(i) for i, name in id2label.items()}
    n = len(id2label)
    ids = [_as_id(r, n) for r in raw]
    if all(r in names for r in raw):
        if all(i is not None for i in ids):
            _check_numeric_names(raw, names, id2label, path)
        return [names[r] for r in raw]
    if all(i is not None for i in ids):
        return ids
    known = ", ".join(f"{i}={name}" for i, name in sorted(id2label.items()))
    outside: dict[str, list[int]] = {}
    for row, (label, i) in enumerate(zip(raw, ids, strict=True)):
        if i is None and label not in names:
            outside.setdefault(label, []).append(row)
    if outside:
        shown = ", ".join(f"{label!r} ({rows_text(rows)})" for label, rows in list(outside.items())[:SHOWN_ROWS])
        more = f" and {len(outside) - SHOWN_ROWS} more" if len(outside) > SHOWN_ROWS else ""
        raise HeadsweepError(f"data file {path}: labels outside the model's label set: {shown}{more} "
                             f"(model labels: {known})")
    # Every label is a name or an id, but not all the same way: which way a digit means is ambiguous.
    name_row = next(row for row, i in enumerate(ids) if i is None)
    id_row = next(row for row, r in enumerate(raw) if r not in names)
    raise HeadsweepError(
        f"data file {path}: labels mix label names and label ids: {raw[name_row]!r} (row {name_row}) is a name, "
        f"{raw[id_row]!r} (row {id_row}) an id; write every label one way (model labels: {known})"
    )


def _check_numeric_names(raw: list[str], names: dict[str, int], id2label: dict[int, str], path: str) -> None:
    """One line naming the first label of ``raw`` that, as a label name, is another id than the number it writes
    (every label of ``raw`` is both a name and an id)."""
    crossed = [r for r in dict.fromkeys(raw) if names[r] != int(r)]
    if not crossed:
        return
    label = crossed[0]
    rows = [row for row, r in enumerate(raw) if r == label]
    known = ", ".join(f"{i}={name!r}" for i, name in sorted(id2label.items()))
    raise HeadsweepError(
        f"data file {path}: label {label!r} ({rows_text(rows)}) is ambiguous: as a label id it is {int(label)}, as a "
        f"label name id {names[label]} (the model's id2label: {known}); rename the labels in the model's config.json "
        "(id2label and label2id) to names that are not numbers, then write the file's labels as those names or as ids"
    )


def _as_id(label: str, n: int) -> int | None:
    """``label`` as a label id below ``n``, or None when it is not one."""
    try:
        i = int(label)
    except ValueError:
        return None
    return i if 0 <= i < n else None


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
