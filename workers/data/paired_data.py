"""Paired prompts: clean / corrupted inputs for activation patching (``sweep.ablation: patch``), read from JSONL.

The format (every family that takes paired data reads it here): one pair per line (blank lines skipped)::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupted": "When Mary and John went to the store, Anna gave a drink to",
     "answer": " Mary", "wrong_answer": " John", "template": "ioi-1"}

``clean`` and ``corrupted`` are the two inputs; ``answer`` is what the clean input should give and ``wrong_answer``
what it competes with (a causal LM's next token, a classifier's label); ``template`` an optional id (text or
integer) of the template the pair was made from. Each family encodes the pairs with its tokenizer and refuses
what it cannot patch (prompts of two lengths, answers it cannot score), naming the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.data.json_records import fields_text, json_object, text_field
from headsweep.workers.data.text_files import check_file, data_file, decode, json_lines, read_bytes

FIELDS = ("clean", "corrupted", "answer", "wrong_answer")


@dataclass(frozen=True)
class Pair:
    """One line of the file: the two prompts, the two answers, the template id ("" when none) and the line (from
    1)."""

    clean: str
    corrupted: str
    answer: str
    wrong_answer: str
    template: str
    line: int


def read_pairs(cfg: Any, key: str = "data") -> list[Pair]:
    """Every pair of the JSONL file ``cfg.path`` (a data section with ``path`` and ``encoding``, config key
    ``key``), or one line naming the file and line of the first that is not one: not JSON, not an object, a field
    missing or not text, an empty prompt."""
    path = check_file(cfg.path, data_file(key), f"{key}.path")
    data, where = read_bytes(path)
    text = decode(data, cfg.encoding, f"data file {path}", where=where)
    pairs = [_pair(row, number, f"data file {path}: line {number}")
             for number, row in json_lines(text, f"data file {path}")]
    if not pairs:
        raise HeadsweepError(f"data file {path} holds no pairs (one JSON object per line, with "
                             f"{', '.join(map(repr, FIELDS))})")
    return pairs


def _pair(row: object, number: int, where: str) -> Pair:
    row = json_object(row, where, FIELDS)
    for name in FIELDS:
        text_field(row, name, where, f"a pair has {fields_text(FIELDS)}")
    for name in ("clean", "corrupted"):
        if not row[name].strip():
            raise HeadsweepError(f"{where}: field {name!r} is empty (a prompt needs at least one token)")
    template = row.get("template", "")
    if template is None or isinstance(template, bool) or not isinstance(template, str | int):
        raise HeadsweepError(f"{where}: field 'template' is {type(template).__name__}, not text or an integer")
    return Pair(row["clean"], row["corrupted"], row["answer"], row["wrong_answer"], str(template), number)
