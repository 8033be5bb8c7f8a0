"""The prompt pairs of ``data.task: paired`` (activation patching) encoded for a causal LM.

The format is :mod:`headsweep.workers.data.paired_data`'s. Here ``answer`` is the token the clean prompt should be
continued with and ``wrong_answer`` the one it competes with: each one token as the tokenizer encodes it alone,
without special tokens (most tokenizers want the leading space), and not the tokenizer's unknown token. Both
prompts are encoded without special tokens (``data.add_bos``: BOS before each) and must come out the same number of
tokens: activation patching puts the corrupted prompt's activations at the clean prompt's positions, one for one.
The first pair that breaks a rule is named with its file and line (:func:`encode_pairs`, when the model and its
tokenizer load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.data.paired_data import Pair


@dataclass(frozen=True)
class EncodedPair:
    """A pair as token ids: both prompts (the same length) and the two answers' single tokens."""

    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int
    wrong_answer: int


def encode_pairs(tokenizer, pairs: Sequence[Pair], bos: int | None, path: str) -> list[EncodedPair]:
    """The pairs as token ids (``bos``: put before both prompts), or one line naming the first pair whose prompts
    differ in length or whose answers are not one known token each (or are the same token)."""
    encoded = []
    unknown = getattr(tokenizer, "unk_token_id", None)
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
            if unknown is not None and ids[0] == unknown:
                # Every word the tokenizer does not know is this one token: its logit scores none of them.
                raise HeadsweepError(f"{where}: {name} {getattr(pair, name)!r} is the tokenizer's unknown token "
                                     f"{tokenizer.unk_token!r}, not a word the model can predict: use an answer the "
                                     "tokenizer knows (most tokenizers want the leading space, e.g. ' Mary')")
            answers.append(ids[0])
        if answers[0] == answers[1]:
            raise HeadsweepError(f"{where}: answer and wrong_answer are the same token ({answers[0]}): their logit "
                                 "difference is always 0")
        encoded.append(EncodedPair(clean, corrupted, answers[0], answers[1]))
    return encoded


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

