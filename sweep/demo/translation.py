"""A synthetic "translation" task: small, learnable in seconds, and not word-for-word.

The source language is a tiny English-like grammar; the target renames every word and
reorders like French and Japanese together: adjectives follow their noun, the verb moves
to the end of its clause (subject-object-verb), and the determiner agrees in gender with
its noun, which it precedes (so choosing it needs a look at a later source word). A
Transformer must attend across the sentence to translate it, so heads have work to do and
ablating them changes BLEU.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from headsweep.workers.families.fairseq_translation.train import (
    TrainResult,
    TrainSettings,
    train_translation,
    write_data_bin,
)

DETERMINERS = {"the": ("le", "la"), "a": ("un", "une"), "this": ("ce", "cette"), "every": ("chaque", "chaque")}
ADJECTIVES = ["red", "small", "old", "happy", "green", "tall", "quiet", "young", "dark", "bright", "cold", "wild"]
NOUNS = ["dog", "cat", "man", "woman", "child", "bird", "house", "tree", "river", "car", "horse", "boat",
         "city", "garden", "street", "ball", "girl", "boy", "table", "window"]
VERBS = ["sees", "likes", "follows", "finds", "watches", "paints", "carries", "calls", "meets", "helps",
         "pushes", "holds"]
PREPOSITIONS = ["near", "under", "behind", "with", "inside"]


def _rename(word: str) -> str:
    # Target words are spelt differently from source words so nothing can be copied.
    return "".join(reversed(word)) + "o"


def _gender(noun: str) -> int:
    return sum(map(ord, noun)) % 2


class _Grammar:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def noun_phrase(self) -> tuple[list[str], list[str]]:
        det = self.rng.choice(list(DETERMINERS))
        noun = self.rng.choice(NOUNS)
        adjs = [self.rng.choice(ADJECTIVES) for _ in range(self.rng.choice((0, 0, 1, 1, 2)))]
        src = [det, *adjs, noun]
        tgt = [DETERMINERS[det][_gender(noun)], _rename(noun), *[_rename(a) for a in adjs]]
        return src, tgt

    def sentence(self) -> tuple[list[str], list[str]]:
        subj_s, subj_t = self.noun_phrase()
        verb = self.rng.choice(VERBS)
        obj_s, obj_t = self.noun_phrase()
        src = subj_s + [verb] + obj_s
        tgt = subj_t + obj_t + [_rename(verb)]
        if self.rng.random() < 0.4:
            prep = self.rng.choice(PREPOSITIONS)
            pp_s, pp_t = self.noun_phrase()
            src += [prep, *pp_s]
            tgt += [_rename(prep), *pp_t]
        return src + ["."], tgt + ["."]


def synthetic_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` parallel sentences (source lines, target lines), space-tokenised, deterministic in ``seed``."""
    grammar = _Grammar(random.Random(seed))
    src_lines, tgt_lines = [], []
    for _ in range(n):
        src, tgt = grammar.sentence()
        src_lines.append(" ".join(src))
        tgt_lines.append(" ".join(tgt))
    return src_lines, tgt_lines


# -- the task as fairseq data, and a tiny model trained on it -----------------------------------
@dataclass
class SyntheticData:
    """A data-bin for the synthetic task plus its test split as raw text files."""

    data_bin: Path
    test_source: Path
    test_target: Path
    source_lang: str = "src"
    target_lang: str = "tgt"


def prepare_synthetic(dest: str | Path, n_train: int = 3000, n_valid: int = 200, n_test: int = 200,
                      seed: int = 0) -> SyntheticData:
    """Generate the synthetic task into ``dest``: a data-bin
    with train/valid/test splits and ``test.src`` / ``test.tgt`` text files."""
    dest = Path(dest)
    splits = {
        "train": synthetic_pairs(n_train, seed=seed),
        "valid": synthetic_pairs(n_valid, seed=seed + 1),
        "test": synthetic_pairs(n_test, seed=seed + 2),
    }
    data_bin = write_data_bin(dest / "data-bin", splits, "src", "tgt")
    test_source, test_target = dest / "test.src", dest / "test.tgt"
    test_source.write_text("\n".join(splits["test"][0]) + "\n")
    test_target.write_text("\n".join(splits["test"][1]) + "\n")
    return SyntheticData(data_bin, test_source, test_target)


def train_synthetic(dest: str | Path, settings: TrainSettings | None = None,
                    log: Callable[[str], None] | None = None) -> tuple[SyntheticData, TrainResult]:
    """Generate the synthetic task in ``dest`` and train a tiny model on it (``dest/checkpoints``).

    With the default settings this takes about 20 s on 2 CPU cores and reaches a test BLEU
    around 90 (the time budget ``max_seconds`` stops it earlier on a busy machine).
    """
    data = prepare_synthetic(dest)
    s = settings or TrainSettings(max_seconds=45.0)
    result = train_translation(data.data_bin, Path(dest) / "checkpoints", data.source_lang, data.target_lang, s, log)
    return data, result
