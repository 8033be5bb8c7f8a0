"""The demo's decoder-only LM: a small Llama-style model with grouped-query attention, trained here,
offline, on generated English-like text.

The text needs attention to predict: a verb agrees in number with its subject, which a relative
clause ("the cat that the dogs see ...") may separate from it, and a sentence's closing word repeats
the name it opened with. A model that attends gets both right; one that only sees the previous
word cannot, so the heads that do it show up in the sweep.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from headsweep.sweep.demo.training import train_shuffled

NOUNS = {"cat": "cats", "dog": "dogs", "bird": "birds", "child": "children", "teacher": "teachers",
         "farmer": "farmers", "baker": "bakers", "fox": "foxes"}
VERBS = {"runs": "run", "sleeps": "sleep", "sings": "sing", "waits": "wait", "laughs": "laugh", "jumps": "jump"}
TRANSITIVE = {"sees": "see", "likes": "like", "helps": "help", "follows": "follow"}
ADJECTIVES = ["big", "small", "old", "young", "happy", "tired", "red", "green"]
ADVERBS = ["today", "quickly", "slowly", "again", "here", "outside"]
NAMES = ["anna", "ben", "carla", "dan", "ella", "finn", "gina", "hugo", "iris", "jon"]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    singular = rng.random() < 0.5
    noun = rng.choice(list(NOUNS))
    words = ["the"]
    if rng.random() < 0.4:
        words.append(rng.choice(ADJECTIVES))
    words.append(noun if singular else NOUNS[noun])
    return " ".join(words), singular


def sentence(rng: random.Random) -> str:
    """One sentence: ``NAME : the [adj] noun [that the [adj] noun verb] verb adverb , NAME .``"""
    name = rng.choice(NAMES)
    subject, singular = _noun_phrase(rng)
    words = [name, ":", subject]
    if rng.random() < 0.5:
        inner, inner_singular = _noun_phrase(rng)
        verb = rng.choice(list(TRANSITIVE))
        words += ["that", inner, verb if inner_singular else TRANSITIVE[verb]]
    verb = rng.choice(list(VERBS))
    words += [verb if singular else VERBS[verb], rng.choice(ADVERBS), ",", name, "."]
    return " ".join(words)


def generate(n_sentences: int, seed: int) -> str:
    """``n_sentences`` sentences, one a line."""
    rng = random.Random(seed)
    return "\n".join(sentence(rng) for _ in range(n_sentences)) + "\n"


def vocabulary() -> list[str]:
    words = {"the", "that", ":", ",", "."}
    for group in (NOUNS, NOUNS.values(), VERBS, VERBS.values(), TRANSITIVE, TRANSITIVE.values(), ADJECTIVES,
                  ADVERBS, NAMES):
        words.update(group)
    return SPECIALS + sorted(words)


def build_tokenizer():
    """A word-level tokenizer (punctuation split off) with BOS ``<s>`` and EOS ``</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def train_language_model(out_dir: Path, layers: int = 3, heads: int = 8, kv_heads: int = 2, hidden: int = 64,
                         window: int = 64, n_sentences: int = 6000, epochs: int = 6, seed: int = 0,
                         log=print) -> Path:
    """Train the demo LM on generated text and save it (and its tokenizer) with ``save_pretrained``."""
    torch.manual_seed(seed)
    # One thread, as for the demo classifier: the model is too small to gain from two busy cores.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(out_dir, layers, heads, kv_heads, hidden, window, n_sentences, epochs, seed, log)
    finally:
        torch.set_num_threads(threads_before)


def _train(out_dir: Path, layers: int, heads: int, kv_heads: int, hidden: int, window: int, n_sentences: int,
           epochs: int, seed: int, log) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=2 * window,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    ids = tokenizer(generate(n_sentences, seed=seed + 1), add_special_tokens=False)["input_ids"]
    rows = torch.tensor(ids[: len(ids) // window * window]).view(-1, window)
    train_shuffled(model, len(rows), 32, 3e-3, epochs, seed,
                   lambda idx: model(input_ids=rows[idx], labels=rows[idx], use_cache=False).loss,
                   "language model", log)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
