"""Fields of JSONL records (one JSON object a line), checked as every JSONL reader of headsweep words its refusals:
the record is an object, the field is there, the field holds text."""

from __future__ import annotations

from collections.abc import Sequence

from headsweep.errors import HeadsweepError


def fields_text(fields: Sequence[str]) -> str:
    """Field names as messages list them: ``'clean', 'corrupted'``."""
    return ", ".join(map(repr, fields))


def json_object(row: object, where: str, fields: Sequence[str]) -> dict:
    """``row`` when it is a JSON object; else one line naming it (``where``: ``data file PATH: line 3``) and the
    ``fields`` an object of the file needs."""
    if not isinstance(row, dict):
        raise HeadsweepError(f"{where} is a JSON {type(row).__name__}, not an object with the fields "
                             f"{fields_text(fields)}")
    return row


def text_field(row: dict, name: str, where: str, needed: str) -> str:
    """Field ``name`` of the record ``row`` when it is there and holds text; else one line naming the record
    (``where``), what a record has (``needed``: ``a pair has 'clean', ...``) and the fields this one has."""
    if name not in row:
        raise HeadsweepError(f"{where} has no field {name!r} ({needed}; fields here: "
                             f"{fields_text(row) or 'none'})")
    value = row[name]
    if not isinstance(value, str):
        raise HeadsweepError(f"{where}: field {name!r} is {type(value).__name__}, not text")
    return value
