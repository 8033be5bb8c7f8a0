"""The prompt pairs of ``data.task: paired`` (activation patching), read and encoded.

The format: a JSONL file, one pair per line (blank lines skipped)::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupted": "When Mary and John went to the store, Anna gave a drink to",
     "answer": " Mary", "wrong_answer": " John", "template": "ioi-1"}

``clean`` and ``corrupted`` are the two prompts, ``answer`` the token the clean prompt should be continued with and
``wrong_answer`` the one it competes with (each one token as the tokenizer encodes it alone, without special
tokens: most tokenizers want the leading space), ``template`` an optional id (text or integer) of the template the
pair was made from. Both prompts are encoded without special tokens (``data.add_bos``: BOS before each) and must
come out the same number of tokens: activation patching puts the corrupted prompt's activations at the clean
prompt's positions, one for one. Every rule is checked with the file and line of the first pair that breaks it;
the rules that need the tokenizer are checked when the model loads (:func:`encode_pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_causal_lm.config import CausalLMData
from headsweep.workers.families.hf_causal_lm.questions import json_line
from headsweep.workers.text_files import check_file, data_file, decode, read_bytes, split_lines

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


@dataclass(frozen=True)
class EncodedPair:
    """A pair as token ids: both prompts (the same length) and the two answers' single tokens."""

    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int
    wrong_answer: int


def read_pairs(cfg: CausalLMData, key: str = "data") -> list[Pair]:
    """Every pair of the JSONL file ``cfg.path``, or one line naming the file and line of the first that is not
    one: not JSON, not an object, a field missing or not text, an empty prompt."""
    path = check_file(cfg.path, data_file(key), f"{key}.path")
    data, where = read_bytes(path)
    pairs = []
    for number, line in enumerate(split_lines(decode(data, cfg.encoding, f"data file {path}", where=where)), 1):
        if line.strip():
            pairs.append(_pair(json_line(line, f"data file {path}: line {number}"), number,
                               f"data file {path}: line {number}"))
    if not pairs:
        raise HeadsweepError(f"data file {path} holds no pairs (one JSON object per line, with "
                             f"{', '.join(map(repr, FIELDS))})")
    return pairs


def _pair(row: object, number: int, where: str) -> Pair:
    if not isinstance(row, dict):
        raise HeadsweepError(f"{where} is a JSON {type(row).__name__}, not an object with the fields "
                             f"{', '.join(map(repr, FIELDS))}")
    for name in FIELDS:
        if name not in row:
            raise HeadsweepError(f"{where} has no field {name!r} (a pair has {', '.join(map(repr, FIELDS))}; "
                                 f"fields here: {', '.join(map(repr, row)) or 'none'})")
        if not isinstance(row[name], str):
            raise HeadsweepError(f"{where}: field {name!r} is {type(row[name]).__name__}, not text")
    for name in ("clean", "corrupted"):
        if not row[name].strip():
            raise HeadsweepError(f"{where}: field {name!r} is empty (a prompt needs at least one token)")
    template = row.get("template", "")
    if template is None or isinstance(template, bool) or not isinstance(template, str | int):
        raise HeadsweepError(f"{where}: field 'template' is {type(template).__name__}, not text or an integer")
    return Pair(row["clean"], row["corrupted"], row["answer"], row["wrong_answer"], str(template), number)


def encode_pairs(tokenizer, pairs: Sequence[Pair], bos: int | None, path: str) -> list[EncodedPair]:
    """The pairs as token ids (``bos``: put before both prompts), or one line naming the first pair whose prompts
    differ in length or whose answers are not one token each (or are the same token)."""
    encoded = []
    for pair in pairs:
        where = f"data file {path}: line {pair.line}"
        clean, corrupted = (tuple(([bos] if bos is not None else []) + _ids(tokenizer, text))
                            for text in (pair.clean, pair.corrupted))
        if len(clean) != len(corrupted):
            raise HeadsweepError(f"{where}: the clean prompt is {len(clean)} tokens and the corrupted one "
                                 f"{len(corrupted)}; patching puts one prompt's activations at the other's positions, "
                                 "so they must tokenise to the same length: reword one of them")
        answers = []
        for name in ("answer", "wrong_answer"):
            ids = _ids(tokenizer, getattr(pair, name))
            if len(ids) != 1:
                raise HeadsweepError(f"{where}: {name} {getattr(pair, name)!r} is {len(ids)} tokens, not one "
                                     "(logit_diff compares the logits of two single tokens; most tokenizers want "
                                     "the leading space, e.g. ' Mary')")
            answers.append(ids[0])
        if answers[0] == answers[1]:
            raise HeadsweepError(f"{where}: answer and wrong_answer are the same token ({answers[0]}): their logit "
                                 "difference is always 0")
        encoded.append(EncodedPair(clean, corrupted, answers[0], answers[1]))
    return encoded


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

