"""The questions of ``data.task: multiple_choice``, read and encoded in lm-evaluation-harness's convention.

Reading (:func:`read_questions`): each question is a JSONL line with a context, a list of choices and the index of
the right one; the first line that is not a question is refused with its file and line.

Encoding (:func:`encode_requests`, :func:`plan_rows`; lm-eval's ``output_type: multiple_choice`` with a Hugging
Face causal LM, zero-shot):

1. choice c is the request ``(context, target_delimiter + c)`` (``data.target_delimiter``, default " ");
2. a request is tokenised as lm-eval's ``TemplateLM._encode_pair``: whitespace at the end of the context
   moves to the start of the continuation, ``whole = encode(context + continuation)``,
   ``context_tokens = encode(context)``, ``continuation_tokens = whole[len(context_tokens):]``, encoded
   without special tokens; an empty context is the tokenizer's BOS token alone (its EOS token if it has no
   BOS), the continuation then encoded by itself;
3. the model reads ``(context_tokens + continuation_tokens)[-(max_length + 1):][:-1]`` (longer requests lose
   context tokens from the left; ``max_length`` is the model's positions), and the last positions predict the
   continuation tokens (a :class:`Row`).

Scoring the rows is :mod:`headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.data.text_files import check_file, decode, json_lines, read_bytes
from headsweep.workers.families.hf_causal_lm.config import CausalLMData


@dataclass(frozen=True)
class Question:
    """One line of the file: the context, the choices, the gold index and the line number (from 1)."""

    context: str
    choices: tuple[str, ...]
    gold: int
    line: int


def read_questions(cfg: CausalLMData) -> list[Question]:
    """Every question of the JSONL file ``cfg.path`` (blank lines skipped), or one clear line naming the file and
    line of the first that is not a question: not JSON, not an object, a missing field, a context that is not
    text, no choices, a choice that is not text, a gold index that is not an integer or not one of the choices."""
    path = check_file(cfg.path, "data file", "data.path")
    data, where = read_bytes(path)
    text = decode(data, cfg.encoding, f"data file {path}", where=where)
    questions = [_question(row, number, cfg, f"data file {path}: line {number}")
                 for number, row in json_lines(text, f"data file {path}")]
    if not questions:
        raise HeadsweepError(f"data file {path} holds no questions (one JSON object per line, with "
                             f"{cfg.context_field!r}, {cfg.choices_field!r} and {cfg.gold_field!r})")
    return questions


def _question(row: object, number: int, cfg: CausalLMData, where: str) -> Question:
    if not isinstance(row, dict):
        raise HeadsweepError(f"{where} is a JSON {type(row).__name__}, not an object with the fields "
                             f"{cfg.context_field!r}, {cfg.choices_field!r} and {cfg.gold_field!r}")
    for key, field in (("context_field", cfg.context_field), ("choices_field", cfg.choices_field),
                       ("gold_field", cfg.gold_field)):
        if field not in row:
            raise HeadsweepError(f"{where} has no field {field!r} (fields: {', '.join(map(repr, row)) or 'none'}); "
                                 f"set data.{key}")
    context, choices, gold = row[cfg.context_field], row[cfg.choices_field], row[cfg.gold_field]
    if not isinstance(context, str):
        raise HeadsweepError(f"{where}: field {cfg.context_field!r} is {type(context).__name__}, not text")
    if not isinstance(choices, list):
        raise HeadsweepError(f"{where}: field {cfg.choices_field!r} is {type(choices).__name__}, not a list of "
                             "choices")
    if not choices:
        raise HeadsweepError(f"{where}: no choices (field {cfg.choices_field!r} is an empty list)")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise HeadsweepError(f"{where}: choice {i} is {type(choice).__name__}, not text")
    # bool is an int in Python, and 1.0 is a float in JSON: neither is an index.
    if not isinstance(gold, int) or isinstance(gold, bool):
        raise HeadsweepError(f"{where}: field {cfg.gold_field!r} is {json.dumps(gold)}, not the index of the right "
                             "choice (an integer from 0)")
    if not 0 <= gold < len(choices):
        raise HeadsweepError(f"{where}: gold index {gold} is out of range for {len(choices)} choice"
                             f"{'s' if len(choices) > 1 else ''} (0 to {len(choices) - 1})")
    return Question(context, tuple(choices), gold, number)


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens (lm-eval's ``tok_encode`` for causal LMs)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's ``_encode_pair``: whitespace at the end of the context moves to the continuation's start."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        return context[:-n_spaces], context[-n_spaces:] + continuation
    return context, continuation


def prefix_token(tokenizer) -> int:
    """The token an empty context stands for (lm-eval's ``prefix_token_id``): BOS, else EOS."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            return int(token)
    raise HeadsweepError("a question has an empty context, which lm-evaluation-harness's convention replaces by "
                         "the tokenizer's BOS (or EOS) token, and this tokenizer has neither")


Encoded = list[list[tuple[list[int], list[int]]]]  # per question, per choice: (context, continuation) tokens


def encode_requests(tokenizer, questions: Sequence[Question], delimiter: str) -> Encoded:
    """``(context tokens, continuation tokens)`` of every choice of every question, as lm-eval encodes the request
    ``(context, delimiter + choice)`` (see the module docstring). A context of whitespace alone keeps no token
    (lm-eval fails on it; :func:`plan_rows` refuses it)."""
    # None: the empty context, which lm-eval replaces by the prefix token (not the same as "" left by a context
    # of whitespace alone, which it encodes to no tokens)
    pairs = [[split_context(q.context, delimiter + c) if q.context else (None, delimiter + c) for c in q.choices]
             for q in questions]
    flat = [pair for row in pairs for pair in row]
    # The context is the same for every choice unless whitespace moved: encode each distinct one once.
    contexts = sorted({ctx for ctx, _ in flat if ctx is not None})
    context_ids = dict(zip(contexts, encode(tokenizer, contexts), strict=True))
    wholes = iter(encode(tokenizer, [(ctx or "") + cont for ctx, cont in flat]))
    prefix = prefix_token(tokenizer) if any(not q.context for q in questions) else None
    out = []
    for row in pairs:
        encoded = []
        for ctx, _ in row:
            whole = list(next(wholes))
            if ctx is None:
                encoded.append(([prefix], whole))
            else:
                ctx_ids = list(context_ids[ctx])
                encoded.append((ctx_ids, whole[len(ctx_ids):]))
        out.append(encoded)
    return out


def request_tokens(encoded: Encoded) -> list[list[int]]:
    """Each question's tokens as the model reads them: its context once, then every choice's continuation."""
    out = []
    for choices in encoded:
        context = list(choices[0][0]) if choices else []
        out.append(context + [t for _, continuation in choices for t in continuation])
    return out


@dataclass(frozen=True)
class Row:
    """One (question, choice) request as the model reads it: ``inputs`` (at most max_length tokens), of which the
    last ``len(targets)`` positions predict the continuation tokens ``targets``."""

    question: int
    choice: int
    inputs: tuple[int, ...]
    targets: tuple[int, ...]


def plan_rows(questions: Sequence[Question], encoded: Encoded, max_length: int, path: str, delimiter: str
              ) -> tuple[list[Row], list[int]]:
    """The rows of every choice, and the questions whose context was cut from the left to fit ``max_length``."""
    rows, truncated = [], []
    for qi, (q, pairs) in enumerate(zip(questions, encoded, strict=True)):
        cut = False
        for ci, (ctx, cont) in enumerate(pairs):
            where = f"data file {path}: line {q.line}"
            if not ctx:
                raise HeadsweepError(
                    f"{where}: the context {q.context!r} has no tokens once its trailing whitespace moves to the "
                    "choices (lm-evaluation-harness's convention needs at least one context token; an empty "
                    "context stands for the BOS token)")
            if not cont:
                raise HeadsweepError(f"{where}: choice {ci} ({q.choices[ci]!r}) adds no token to the context (with "
                                     f"data.target_delimiter {delimiter!r}); a choice must add at least one")
            if len(cont) > max_length:
                raise HeadsweepError(f"{where}: choice {ci} is {len(cont)} tokens, more than the model's "
                                     f"{max_length} positions")
            seq = (ctx + cont)[-(max_length + 1):]
            cut = cut or len(ctx) + len(cont) > max_length + 1
            rows.append(Row(qi, ci, tuple(seq[:-1]), tuple(cont)))
        if cut:
            truncated.append(qi)
    return rows, truncated
