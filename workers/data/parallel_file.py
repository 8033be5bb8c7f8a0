"""Parallel text in one file: TSV (a pair a line, the source, a tab, then the target; no header line) or JSONL (a
JSON object a line with a source and a target field, named by ``source_field`` / ``target_field``: Multi30k-style
files key them by language code, ``{"en": ..., "de": ...}``).

The file is read as every text file of headsweep is (:mod:`.text_files`: plain or ``.gz``, decoded strictly with
the section's ``encoding``), and every line is checked before the first pair is used, whatever ``max_examples``
keeps: a line that is not a pair is refused in one line naming the file and the line, never skipped. Blank lines
are skipped in both formats (as the JSONL readers skip them); an example's id is its position among the pairs.

A TSV file has no header line because its first line cannot be told from a pair: a header would be evaluated as
one. TSV has no quoting either: a sentence holding a tab cannot be written in it (use JSONL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.data.file_formats import file_format
from headsweep.workers.data.json_records import fields_text, json_object, text_field
from headsweep.workers.data.text_files import check_file, data_file, decode, json_lines, read_bytes, split_lines

PAIR_FORMATS = ("tsv", "jsonl")
EMPTY = "every pair needs a source sentence and a reference"


@dataclass
class ParallelRows:
    """The pairs of a file in file order, with the line (from 1) each is on."""

    sources: list[str]
    targets: list[str]
    lines: list[int]


def pair_format(cfg: Any, key: str = "data") -> str:
    """``<key>.format``, or the format the suffix of ``<key>.path`` names (``.tsv``, ``.jsonl``, ``.json``, each
    possibly followed by ``.gz``); one line refusing any other."""
    return file_format(cfg.path, cfg.format, PAIR_FORMATS, key, through_gz=True)


def read_parallel_file(cfg: Any, key: str = "data") -> ParallelRows:
    """The pairs of the file ``cfg.path`` (a data section with ``path``, ``format``, ``encoding``,
    ``source_field``, ``target_field`` and ``max_examples``; config key ``key``), cut to ``max_examples``; or one
    line naming the file and the line of the first that is not a pair with a non-empty source and target."""
    path = check_file(cfg.path, data_file(key), f"{key}.path")
    fmt = pair_format(cfg, key)
    data, where = read_bytes(path)
    what = f"data file {path}"
    text = decode(data, cfg.encoding, what, f"{key}.encoding", where)
    if fmt == "tsv":
        rows = _tsv_rows(text, what)
        shape = "a line each, the source, a tab, then the target"
    else:
        rows = _jsonl_rows(text, what, cfg.source_field, cfg.target_field, key)
        shape = f"a JSON object a line, with the fields {fields_text((cfg.source_field, cfg.target_field))}"
    if not rows.sources:
        raise HeadsweepError(f"{what} holds no pairs ({shape})")
    n = len(rows.sources) if cfg.max_examples is None else min(len(rows.sources), cfg.max_examples)
    return ParallelRows(rows.sources[:n], rows.targets[:n], rows.lines[:n])


def _tsv_rows(text: str, what: str) -> ParallelRows:
    rows = ParallelRows([], [], [])
    for number, line in enumerate(split_lines(text), 1):
        if not line.strip():
            continue
        columns = line.split("\t")
        if len(columns) != 2:
            raise HeadsweepError(
                f"{what}: line {number} has {len(columns)} tab-separated column(s), not 2 (the source, then the "
                "target; no header line, no quoting: a sentence holding a tab needs JSONL)")
        for column, side in zip(columns, ("source (column 1)", "target (column 2)"), strict=True):
            if not column.strip():
                raise HeadsweepError(f"{what}: line {number}: the {side} is empty ({EMPTY})")
        _add(rows, columns[0], columns[1], number)
    return rows


def _jsonl_rows(text: str, what: str, source_field: str, target_field: str, key: str) -> ParallelRows:
    fields = (source_field, target_field)
    settable = f"set {key}.source_field / {key}.target_field to the fields the file uses"
    rows = ParallelRows([], [], [])
    for number, value in json_lines(text, what):
        where = f"{what}: line {number}"
        record = json_object(value, where, fields)
        pair = [text_field(record, name, where, f"a pair has {fields_text(fields)}: {settable}") for name in fields]
        for name, sentence in zip(fields, pair, strict=True):
            if not sentence.strip():
                raise HeadsweepError(f"{where}: field {name!r} is empty ({EMPTY})")
        _add(rows, pair[0], pair[1], number)
    return rows


def _add(rows: ParallelRows, source: str, target: str, line: int) -> None:
    rows.sources.append(source)
    rows.targets.append(target)
    rows.lines.append(line)
