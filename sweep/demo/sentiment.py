"""The demo's classifier: a small BERT trained here, offline, on generated sentiment data.

The language is small but needs attention to solve: the label is the polarity of the clause
after "but" (if any), flipped by a "not" before its adjective, so the classifier must relate
words across positions rather than count positive words.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from headsweep.sweep.demo.training import train_shuffled

SUBJECTS = ["the film", "the movie", "this story", "the acting", "the plot", "the ending", "the music", "the cast"]
VERBS = ["was", "is", "seemed", "felt", "looked"]
POSITIVE = ["good", "great", "superb", "moving", "charming", "clever", "fresh", "delightful", "gripping", "warm"]
NEGATIVE = ["bad", "dull", "awful", "boring", "clumsy", "tedious", "flat", "weak", "messy", "bland"]
INTENSIFIERS = ["very", "really", "quite", "rather", "truly"]
FILLERS = ["honestly", "overall", "i think", "in the end", "frankly"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _clause(rng: random.Random) -> tuple[str, int]:
    positive = rng.random() < 0.5
    words = [rng.choice(SUBJECTS), rng.choice(VERBS)]
    negated = rng.random() < 0.35
    if negated:
        words.append("not")
    if rng.random() < 0.4:
        words.append(rng.choice(INTENSIFIERS))
    words.append(rng.choice(POSITIVE if positive else NEGATIVE))
    return " ".join(words), int(positive != negated)


def generate(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (sentence, label) pairs; label 1 = positive."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, label = _clause(rng)
        if rng.random() < 0.4:
            second, label = _clause(rng)
            text = f"{text} but {second}"
        if rng.random() < 0.3:
            text = f"{rng.choice(FILLERS)} {text}"
        rows.append((text, label))
    return rows


def vocabulary() -> list[str]:
    words = set()
    for group in (SUBJECTS, VERBS, POSITIVE, NEGATIVE, INTENSIFIERS, FILLERS, ["not", "but"]):
        for phrase in group:
            words.update(phrase.split())
    return SPECIALS + sorted(words)


def write_tsv(rows: list[tuple[str, int]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("sentence\tlabel\n")
        for text, label in rows:
            f.write(f"{text}\t{label}\n")
    return path


def build_tokenizer():
    """A word-level tokenizer with BERT's special tokens, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def train_classifier(
    out_dir: Path,
    layers: int = 4,
    heads: int = 4,
    hidden: int = 64,
    n_train: int = 4000,
    epochs: int = 6,
    seed: int = 0,
    log=print,
) -> Path:
    """Train the demo BERT and save it with ``save_pretrained``; returns ``out_dir``."""

    torch.manual_seed(seed)
    # One thread: the model is too small to gain from more, and two threads on two cores that
    # another process also uses slow training down many times over.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(out_dir, layers, heads, hidden, n_train, epochs, seed, log)
    finally:
        torch.set_num_threads(threads_before)


def _train(out_dir: Path, layers: int, heads: int, hidden: int, n_train: int, epochs: int, seed: int, log) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = build_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 4,
        max_position_embeddings=64,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    rows = generate(n_train, seed=seed + 1)
    enc = tokenizer([t for t, _ in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in rows])
    train_shuffled(model, len(rows), 64, 2e-3, epochs, seed,
                   lambda idx: model(input_ids=enc["input_ids"][idx], attention_mask=enc["attention_mask"][idx],
                                     labels=labels[idx]).loss,
                   "classifier", log)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
