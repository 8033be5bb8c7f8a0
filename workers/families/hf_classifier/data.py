"""Reading labelled classification data from TSV, CSV, JSONL or Parquet files.

Text is read as text: the file's bytes are decoded with ``data.encoding`` (UTF-8 unless set)
before they are parsed (TSV and CSV by pyarrow, JSONL line by line), and the configured columns are
read as strings (an id ``007`` stays ``007``). What looks wrong but is not an error (empty texts,
repeated inputs) is found here and counted (:func:`findings`), never changed.

Messages name an example by its row of data, counted from 1, and in a text file by the line it is on
as an editor counts lines: ``row 3 (line 4)`` in a TSV or CSV file (its first line is the header),
``row 3 (line 3)`` in JSONL without blank lines, ``row 3`` in Parquet.
"""

from __future__ import annotations

import codecs
import csv
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.workers.data.data_report import Finding
from headsweep.workers.data.file_formats import file_format
from headsweep.workers.data.paired_data import read_pairs
from headsweep.workers.data.text_files import (
    check_encoding,
    check_file,
    check_max_examples,
    data_file,
    decode,
    json_lines,
    read_bytes,
)
from headsweep.workers.families.hf_classifier.config import ClassifierData

FORMAT_NAMES = ("tsv", "csv", "jsonl", "parquet")
# How many rows a message names before it says how many more there are.
SHOWN_ROWS = 5
# Each delimited format's separator, as a message names it.
SEPARATORS = {"tsv": ("\t", "tab"), "csv": (",", "comma")}


@dataclass
class ClassificationExamples:
    """The examples in file order. Paired data (``data.task: paired``) also hold each pair's corrupted input and
    wrong answer; ``texts`` and ``labels`` are then the clean inputs and the answers. ``rows``: each example's row
    of data in the file (from 1; None: the examples are rows 1, 2, ...); ``lines``: the line of the file it is on
    (None: a Parquet file). Both are per-example lists, so a subset (``example_subset.at_positions``) keeps them."""

    ids: list[str]
    texts: list[str]
    text_pairs: list[str] | None
    labels: list[str]
    corrupted: list[str] | None = None
    wrong_labels: list[str] | None = None
    lines: list[int] | None = None
    rows: list[int] | None = None

    def row(self, i: int) -> str:
        """Example ``i``'s row as messages name it (:func:`place`)."""
        return place(i + 1 if self.rows is None else self.rows[i], None if self.lines is None else self.lines[i])


def place(row: int, line: int | None) -> str:
    """A row of data (from 1) as messages name it: ``3 (line 4)``, or ``3`` in a file without lines (Parquet)."""
    return str(row) if line is None else f"{row} (line {line})"


@dataclass
class _Read:
    """A data file as read: its column names, its number of rows, the wanted columns' values in row order, and
    the line each row is on (None: Parquet, a file without lines)."""

    names: list[str]
    n_rows: int
    values: dict[str, list]
    lines: list[int] | None


def _utf8_source(data: bytes, text: str, encoding: str) -> pa.BufferReader:
    """A file's bytes ``data`` as UTF-8 for pyarrow (``text``: ``data`` decoded with ``encoding``)."""
    if check_encoding(encoding) != "utf-8" or data.startswith(codecs.BOM_UTF8):
        data = text.encode("utf-8")  # transcoded, or the byte order mark dropped
    return pa.BufferReader(data)


def _read(path: Path, fmt: str, cfg: ClassifierData, columns: list[str], key: str) -> _Read:
    """The file ``path`` read as ``fmt``; ``columns``: the configured columns (read as text)."""
    if fmt == "parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise HeadsweepError(f"cannot read data file {path} as parquet: {str(exc).splitlines()[0]}") from None
        _check_column_names(path, table.column_names, columns)
        table = _decoded_binary(table, columns, cfg.encoding, path)
        return _Read(table.column_names, table.num_rows, _columns(table, columns), None)
    data, where = read_bytes(path)
    text = decode(data, cfg.encoding, f"data file {path}", where=where)
    if fmt == "jsonl":
        return _read_jsonl(path, text, columns)
    as_text = pacsv.ConvertOptions(column_types={c: pa.string() for c in columns}, strings_can_be_null=False)
    # TSV: quoting off, sentences hold quotes that are text, not CSV quoting (as in GLUE files).
    options = (pacsv.ParseOptions(delimiter="\t", quote_char=False) if fmt == "tsv" else pacsv.ParseOptions())
    try:
        table = pacsv.read_csv(_utf8_source(data, text, cfg.encoding), parse_options=options,
                               convert_options=as_text)
    except (pa.ArrowInvalid, OSError) as exc:
        _check_separator(path, fmt, text, cfg, key)
        bad = _invalid_row(_utf8_source(data, text, cfg.encoding), options, as_text)
        if bad is not None:
            raise HeadsweepError(_invalid_row_message(path, fmt, text, bad)) from None
        raise HeadsweepError(f"cannot read data file {path} as {fmt}: {str(exc).splitlines()[0]}") from None
    _check_column_names(path, table.column_names, columns)
    if any(c not in table.column_names for c in columns):
        _check_separator(path, fmt, text, cfg, key)
    return _Read(table.column_names, table.num_rows, _columns(table, columns), _row_lines(text, fmt))


def _invalid_row(source: pa.BufferReader, options: pacsv.ParseOptions,
                 convert: pacsv.ConvertOptions) -> pacsv.InvalidRow | None:
    """The first row pyarrow refuses for its number of fields, with its number (None: the error was another).

    Read again on one thread: pyarrow numbers a refused row only then (a failed read's price, not every read's).
    Its number counts records as it parses them: the header is 1, blank lines are skipped and a quoted value over
    several lines is one record, as :func:`_row_lines` counts them.
    """
    found: list[pacsv.InvalidRow] = []

    def keep(row: pacsv.InvalidRow) -> str:
        found.append(row)
        return "error"

    parse = pacsv.ParseOptions(delimiter=options.delimiter, quote_char=options.quote_char, invalid_row_handler=keep)
    try:
        pacsv.read_csv(source, parse_options=parse, convert_options=convert,
                       read_options=pacsv.ReadOptions(use_threads=False))
    except (pa.ArrowInvalid, OSError):
        pass
    return found[0] if found and found[0].number is not None else None


def _invalid_row_message(path: Path, fmt: str, text: str, bad: pacsv.InvalidRow) -> str:
    """One line naming the refused row (from 1, with its line), its fields against the header's, and the cause a
    user can fix."""
    row = bad.number - 1  # pyarrow counts the header as record 1
    lines = _row_lines(text, fmt)
    where = place(row, lines[row - 1] if 0 < row <= len(lines) else None)
    shown = bad.text.split("\n", 1)[0][:80]
    if fmt == "csv" and bad.text.count('"') % 2:
        why = "a quote opened in it is never closed (a literal quote inside a quoted value is written twice: \"\")"
    elif bad.actual_columns < bad.expected_columns:
        why = f"each row needs one value per column of the header, separated by a {SEPARATORS[fmt][1]}"
    elif fmt == "csv":
        why = "a value holding a comma must be in double quotes"
    else:
        why = "tsv has no quoting: a value cannot hold a tab (or use data.format=csv with quoted values)"
    return (f"cannot read data file {path} as {fmt}: row {where} has {bad.actual_columns} field(s) where the header "
            f"has {bad.expected_columns} ({shown!r}); {why}")


def _check_column_names(path: Path, names: list[str], columns: list[str]) -> None:
    """A column the config reads named twice in the file: which of the two holds the labels (or texts) is a guess."""
    twice = next((c for c in columns if names.count(c) > 1), None)
    if twice is not None:
        raise HeadsweepError(f"data file {path} names column {twice!r} {names.count(twice)} times (columns: "
                             f"{', '.join(names)}): give each column its own name")


def _columns(table: pa.Table, columns: list[str]) -> dict[str, list]:
    return {c: table.column(c).to_pylist() for c in columns if c in table.column_names}


def _read_jsonl(path: Path, text: str, columns: list[str]) -> _Read:
    """One JSON object per line (blank lines skipped): the column names are the fields the objects have, in the
    order they first appear; a field an object lacks is empty (None) in its row."""
    records = json_lines(text, f"data file {path}")
    for number, record in records:
        if not isinstance(record, dict):
            raise HeadsweepError(f"data file {path}: line {number} is a JSON {type(record).__name__}, not an object "
                                 f"with the columns ({', '.join(map(repr, columns))})")
    names = list(dict.fromkeys(name for _, record in records for name in record))  # type: ignore[union-attr]
    values = {c: [record.get(c) for _, record in records] for c in columns if c in names}  # type: ignore[union-attr]
    return _Read(names, len(records), values, [number for number, _ in records])


def _check_separator(path: Path, fmt: str, text: str, cfg: ClassifierData, key: str) -> None:
    """A header line without the format's separator but with the other format's: the file is the other format
    (a comma-separated file read as tsv yields one column named after the whole header line)."""
    header = next((line for line in re.split(r"\r\n|\r|\n", text) if line), "")
    other = "csv" if fmt == "tsv" else "tsv"
    (own, own_name), (other_sep, other_name) = SEPARATORS[fmt], SEPARATORS[other]
    if own not in header and other_sep in header:
        told = f"{key}.format" if cfg.format else f"its {Path(cfg.path).suffix} suffix"
        raise HeadsweepError(f"data file {path} is read as {fmt} ({told}) but its header line has no {own_name} and "
                             f"looks {other_name}-separated: set {key}.format={other}")


def _row_lines(text: str, fmt: str) -> list[int]:
    """The line (from 1) each data row of a TSV or CSV file starts on, as pyarrow's reader takes rows: the first
    non-empty line is the header, empty lines are skipped, lines end at ``\\n``, ``\\r\\n`` or ``\\r``, and in CSV
    a quoted value may hold line breaks."""
    if fmt == "csv" and '"' in text:
        reader = csv.reader(io.StringIO(text, newline=""))
        starts, end = [], 0
        try:
            for record in reader:
                if record:
                    starts.append(end + 1)
                end = reader.line_num
            return starts[1:]
        except csv.Error:
            pass  # a value Python's reader refuses (over its field size limit): count lines as TSV does
    return [n for n, line in enumerate(re.split(r"\r\n|\r|\n", text), 1) if line][1:]


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
                    f"data file {path}: column {name!r} row {row + 1} is not valid {encoding} text (byte "
                    f"0x{value[exc.start]:02x} at byte offset {exc.start} of the value): set data.encoding to "
                    "the text's encoding (e.g. latin-1 or cp1252), or fix the file"
                ) from None
        table = table.set_column(table.column_names.index(name), name, pa.array(values, pa.string()))
    return table


def data_format(cfg: ClassifierData, key: str = "data") -> str:
    """``<key>.format``, or the one the file's suffix names; a one-line error for any other."""
    return file_format(cfg.path, cfg.format, FORMAT_NAMES, key)


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


def row_number(i: int) -> str:
    """Example ``i`` (from 0) as messages name its row where nothing more is known: ``i + 1``."""
    return place(i + 1, None)


def rows_text(rows: Sequence[int], name: Callable[[int], str] = row_number) -> str:
    """``row 3 (line 4)`` or ``rows 3 (line 4), 7 (line 8) and 9 (line 10)``, the first few named: ``rows`` are
    example positions (from 0), ``name`` says each as the file's row (``ClassificationExamples.row``)."""
    if len(rows) == 1:
        return f"row {name(rows[0])}"
    shown = [name(r) for r in rows[:SHOWN_ROWS]]
    if len(rows) > SHOWN_ROWS:
        return f"rows {', '.join(shown)} and {len(rows) - SHOWN_ROWS} more"
    return f"rows {', '.join(shown[:-1])} and {shown[-1]}"


def read_examples(cfg: ClassifierData, key: str = "data") -> ClassificationExamples:
    """Read the configured file (config key ``key``), check its columns, and return texts and raw labels."""
    path = check_data(cfg, key)
    if cfg.paired:
        pairs = read_pairs(cfg, key)[: cfg.max_examples]
        return ClassificationExamples(ids=[f"p{i}" for i in range(len(pairs))], texts=[p.clean for p in pairs],
                                      text_pairs=None, labels=[p.answer for p in pairs],
                                      corrupted=[p.corrupted for p in pairs],
                                      wrong_labels=[p.wrong_answer for p in pairs], lines=[p.line for p in pairs],
                                      rows=list(range(1, len(pairs) + 1)))
    fmt = data_format(cfg, key)
    keys = {"text_column": cfg.text_column, "text_pair_column": cfg.text_pair_column,
            "label_column": cfg.label_column, "id_column": cfg.id_column}
    wanted = [c for c in keys.values() if c]
    read = _read(path, fmt, cfg, wanted, key)
    if not read.names:  # a JSONL file of blank lines
        raise HeadsweepError(f"data file {path} has no examples")
    missing = [(name, c) for name, c in keys.items() if c and c not in read.names]
    if missing:
        name, c = missing[0]
        raise HeadsweepError(
            f"data file {path} has no column {c!r} (columns: {', '.join(read.names)}); "
            f"set {key}.{name} to one of them"
        )
    n = read.n_rows if cfg.max_examples is None else min(read.n_rows, cfg.max_examples)
    if n == 0:
        raise HeadsweepError(f"data file {path} has no examples")
    lines = None if read.lines is None else read.lines[:n]

    def row(i: int) -> str:
        return place(i + 1, None if lines is None else lines[i])

    def column(name: str, text: bool = False) -> list[str]:
        values = read.values[name][:n]
        if name == cfg.label_column:
            empty = [i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip())]
            if empty:
                raise HeadsweepError(f"data file {path}: empty label in {rows_text(empty, row)} (column {name!r}): "
                                     "every example needs its label")
        if any(v is None for v in values):
            raise HeadsweepError(f"data file {path}: column {name!r} is empty in row {row(values.index(None))}")
        if text:
            odd = next((i for i, v in enumerate(values) if isinstance(v, (list, dict, bytes))), None)
            if odd is not None:
                raise HeadsweepError(f"data file {path}: column {name!r} holds a {type(values[odd]).__name__}, "
                                     f"not text, in row {row(odd)}")
        return [str(v) for v in values]

    ids = column(cfg.id_column) if cfg.id_column else [str(i) for i in range(n)]
    _check_unique(ids, cfg.id_column, path, row)
    return ClassificationExamples(
        ids=ids,
        texts=column(cfg.text_column, text=True),
        text_pairs=column(cfg.text_pair_column, text=True) if cfg.text_pair_column else None,
        labels=column(cfg.label_column),
        lines=lines,
        rows=list(range(1, n + 1)),
    )


def _check_unique(ids: list[str], id_column: str | None, path: Path, row_of: Callable[[int], str]) -> None:
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
            f"in {rows_text([a, b], row_of)}): example ids must be unique, they key the stored per-example results"
        )


def label_ids(raw: list[str], id2label: dict[int, str], path: str,
              row_of: Callable[[int], str] = row_number) -> list[int]:
    """Map the file's labels (``raw``, in row order) onto the model's label ids: every label a label name, or
    every label an id in range; else one line naming the labels (quoted) that are neither, with their rows
    (``row_of``: how a message names example ``i``'s row, ``ClassificationExamples.row``), or the two ways of
    writing a label the file mixes.

    A label that is both a name and an id means two labels where ``id2label`` names its labels with other ids'
    numbers (``{0: "1", 1: "0"}``): which one the file means cannot be told, so it is refused
    (:func:`_check_numeric_names`). Numeric names that are their own ids (``{0: "0", 1: "1"}``) read the same
    either way."""
    names = {str(name): int(i) for i, name in id2label.items()}
    n = len(id2label)
    ids = [_as_id(r, n) for r in raw]
    if all(r in names for r in raw):
        if all(i is not None for i in ids):
            _check_numeric_names(raw, names, id2label, path, row_of)
        return [names[r] for r in raw]
    if all(i is not None for i in ids):
        return ids
    known = ", ".join(f"{i}={name}" for i, name in sorted(id2label.items()))
    outside: dict[str, list[int]] = {}
    for row, (label, i) in enumerate(zip(raw, ids, strict=True)):
        if i is None and label not in names:
            outside.setdefault(label, []).append(row)
    if outside:
        shown = ", ".join(f"{label!r} in {rows_text(rows, row_of)}"
                          for label, rows in list(outside.items())[:SHOWN_ROWS])
        more = f" and {len(outside) - SHOWN_ROWS} more" if len(outside) > SHOWN_ROWS else ""
        raise HeadsweepError(f"data file {path}: labels outside the model's label set: {shown}{more} "
                             f"(model labels: {known})")
    # Every label is a name or an id, but not all the same way: which way a digit means is ambiguous.
    name_row = next(row for row, i in enumerate(ids) if i is None)
    id_row = next(row for row, r in enumerate(raw) if r not in names)
    raise HeadsweepError(
        f"data file {path}: labels mix label names and label ids: {raw[name_row]!r} in row {row_of(name_row)} is a "
        f"name, {raw[id_row]!r} in row {row_of(id_row)} an id; write every label one way (model labels: {known})"
    )


def _check_numeric_names(raw: list[str], names: dict[str, int], id2label: dict[int, str], path: str,
                         row_of: Callable[[int], str]) -> None:
    """One line naming the first label of ``raw`` that, as a label name, is another id than the number it writes
    (every label of ``raw`` is both a name and an id)."""
    crossed = [r for r in dict.fromkeys(raw) if names[r] != int(r)]
    if not crossed:
        return
    label = crossed[0]
    rows = [row for row, r in enumerate(raw) if r == label]
    known = ", ".join(f"{i}={name!r}" for i, name in sorted(id2label.items()))
    raise HeadsweepError(
        f"data file {path}: label {label!r} in {rows_text(rows, row_of)} is ambiguous: as a label id it is "
        f"{int(label)}, as a label name id {names[label]} (the model's id2label: {known}); rename the labels in the "
        "model's config.json (id2label and label2id) to names that are not numbers, then write the file's labels as "
        "those names or as ids"
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
