"""The model families under the contract suite: one :class:`FamilyCase` each.

A new family joins the suite by adding one ``FamilyCase`` to :data:`CASES`: how to build a tiny model and its
data on disk (the config's ``model`` and ``data`` sections, and held-out data for importance), the head shapes
its parameter count follows, and the summation-order bound's shape (tests/tolerances.py). Every check in
test_family_contract.py then runs on it through the family's public contract (``ModelFamily`` and its
``EvalAdapter``), nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headsweep.workers.core.heads import Head, HeadInventory


@dataclass(frozen=True)
class HeadParams:
    """What one head owns, read from the model's config: ``head_dim`` rows of W_Q (``d_model`` inputs, plus a
    bias where ``qkv_bias``) and ``head_dim`` columns of W_O (``d_model`` outputs); and, once every query head
    of its group is gone, a key/value head's rows of W_K and W_V. ``kv_heads`` per attention module; equal to
    the query heads for plain multi-head attention (a group of one)."""

    d_model: int
    head_dim: int
    kv_heads: int
    qkv_bias: bool


@dataclass
class Built:
    """A tiny model and its data on disk, as config sections."""

    model: dict[str, Any]  # the config's ``model`` section, ``kind`` included
    data: dict[str, Any]  # the evaluation set: the config's ``data`` section
    heldout: dict[str, Any]  # training or validation data in the same form (importance.data, l0.data)
    params: HeadParams

    def in_dtype(self, dtype: str) -> Built:
        """The same model loaded in ``dtype`` (``model.dtype``); ``float32`` is the model section as built."""
        return self if dtype == "float32" else dataclasses.replace(self, model={**self.model, "dtype": dtype})


@dataclass(frozen=True)
class FamilyCase:
    """One model family (one architecture of it) under the contract suite.

    ``build(folder)`` writes the tiny model and data under ``folder``. ``bound``: the summation-order bound's
    ``depth`` and ``width`` for this model (tests/tolerances.py). ``runtime``: RuntimeOptions every adapter of
    the case gets (the checks add ``reuse`` and ``masks_per_batch``). ``exact_reuse``: the family's reuse
    replays one mask per pass with the plain path's arithmetic (same kernels, same shapes), so reuse equals
    plain bit for bit; False where reuse changes batch shapes (fairseq's cached encoder output).
    ``same_path(model)``: put an ungated model on the code path the gated model takes, with the library's
    own switches (fairseq: off the fused attention kernel), so that gates and weight surgery run the same
    arithmetic. ``exported(model_section, folder)``: the ``model`` section that loads what ``headsweep export``
    wrote to ``folder``. ``dtypes``: what the exactness checks (the checks that take ``dtype``) run in: float32,
    the model as built, and for families with ``model.dtype`` bfloat16 (tests/tolerances.py derives its bound).
    ``known_failures``: checks marked xfail for a known bug (see the field).
    """

    id: str
    build: Callable[[Path], Built]
    bound: dict[str, int]
    exported: Callable[[dict, Path], dict]
    runtime: dict[str, Any] = field(default_factory=dict)
    exact_reuse: bool = True
    same_path: Callable[[nn.Module], None] | None = None
    dtypes: tuple[str, ...] = ("float32",)
    # Checks this family fails because of a known bug: test function name -> the bug. They run as
    # xfail(strict=True), so the suite notices the day the bug is fixed.
    known_failures: dict[str, str] = field(default_factory=dict)


# -- expected parameter drop ---------------------------------------------------------------------------------

def removed_parameters(params: HeadParams, inventory: HeadInventory, mask: list[Head]) -> int:
    """The parameter drop of removing ``mask``, counted from the heads' shapes: per query head its W_Q rows
    (with biases) and W_O columns; per key/value head whose every query head is removed, its W_K and W_V rows
    (with biases). The output projection's bias is the module's, not a head's: it stays."""
    d, width = params.head_dim, params.d_model
    bias = d if params.qkv_bias else 0
    per_query = width * d + bias + d * width
    per_kv = 2 * (width * d + bias)
    total = 0
    for shape in inventory.layers:
        gone = {h.head for h in mask if (h.attention, h.layer) == (shape.attention, shape.layer)}
        group = shape.num_heads // params.kv_heads
        empty_groups = sum(all(q in gone for q in range(g * group, (g + 1) * group)) for g in range(params.kv_heads))
        total += len(gone) * per_query + empty_groups * per_kv
    return total


def _hf_params(model_dir: Path, width_key: str, heads_key: str, kv_key: str | None, qkv_bias: bool) -> HeadParams:
    cfg = json.loads((model_dir / "config.json").read_text())
    width, heads = cfg[width_key], cfg[heads_key]
    head_dim = cfg.get("head_dim") or width // heads
    kv_heads = (cfg.get(kv_key) or heads) if kv_key else heads
    return HeadParams(width, head_dim, kv_heads, qkv_bias)


# -- transformers classifiers --------------------------------------------------------------------------------

def _sentiment_data(folder: Path) -> tuple[dict, dict]:
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    dev = write_tsv(generate(40, seed=7), folder / "dev.tsv")
    train = write_tsv(generate(32, seed=5), folder / "train.tsv")
    return {"path": str(dev)}, {"path": str(train)}


def _save_distilbert(out_dir: Path) -> Path:
    """A tiny random DistilBERT classifier over the demo vocabulary (large weights, as save_tiny_classifier's)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from headsweep.sweep.demo.sentiment import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    cfg = DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=64, num_labels=2, initializer_range=1.0,
                           id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    DistilBertForSequenceClassification(cfg).eval().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_bert(folder: Path) -> Built:
    from tiny_models import save_tiny_classifier

    model_dir = save_tiny_classifier(folder / "tiny-bert")
    data, heldout = _sentiment_data(folder)
    return Built({"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "eager"}, data, heldout,
                 _hf_params(model_dir, "hidden_size", "num_attention_heads", None, qkv_bias=True))


def build_distilbert(folder: Path) -> Built:
    model_dir = _save_distilbert(folder / "tiny-distilbert")
    data, heldout = _sentiment_data(folder)
    return Built({"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "sdpa"}, data, heldout,
                 _hf_params(model_dir, "dim", "n_heads", None, qkv_bias=True))


# -- transformers causal LMs ---------------------------------------------------------------------------------

LM_WINDOW = 16


def _lm_builder(shape: str, attn: str, width_key: str, heads_key: str, kv_key: str | None, qkv_bias: bool
                ) -> Callable[[Path], Built]:
    def build(folder: Path) -> Built:
        from tiny_models import lm_text, save_tiny_causal_lm

        model_dir = save_tiny_causal_lm(folder / shape, shape)
        corpus, train = folder / "corpus.txt", folder / "train.txt"
        corpus.write_text(lm_text(160, seed=7))
        train.write_text(lm_text(120, seed=8))
        data = {"window": LM_WINDOW, "max_windows": 6}
        return Built({"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": attn},
                     {"path": str(corpus), **data},
                     {"path": str(train), **data}, _hf_params(model_dir, width_key, heads_key, kv_key, qkv_bias))

    return build


# -- fairseq translation -------------------------------------------------------------------------------------

FAIRSEQ_DECODING = {"beam": 3, "max_len_b": 24}


def build_fairseq(folder: Path) -> Built:
    from tiny_fairseq import TINY_SETTINGS, train_tiny

    tiny = train_tiny(folder)
    data_bin = str(tiny.data.data_bin)
    s = TINY_SETTINGS
    return Built({"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint), "data_bin": data_bin,
                  **FAIRSEQ_DECODING},
                 {"data_bin": data_bin, "split": "test", "max_examples": 16},
                 {"data_bin": data_bin, "split": "valid", "max_examples": 16},
                 HeadParams(s.embed_dim, s.embed_dim // s.attention_heads, s.attention_heads, qkv_bias=True))


def fairseq_unfused(model: nn.Module) -> None:
    """Every attention module off fairseq's fused kernel (fairseq's own switch, as its head pruning sets it)."""
    for module in model.modules():
        if hasattr(module, "skip_embed_dim_check"):
            module.skip_embed_dim_check = True


# -- translation through transformers -------------------------------------------------------------------------

def build_seq2seq(folder: Path) -> Built:
    """A tiny random Marian model (one encoder and one decoder layer of two heads: 6 heads over the three attention
    types, a grid of 14 masks, each a beam search) over the synthetic translation task's words."""
    from tiny_seq2seq import build_tokenizer, tiny_seq2seq, write_pairs

    model_dir = folder / "tiny-marian"
    tiny_seq2seq("marian", layers=1, heads=2, head_dim=8).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    source, target = write_pairs(folder, 4)
    heldout_source, heldout_target = write_pairs(folder, 4, seed=5, split="valid")
    return Built({"kind": "hf_seq2seq", "path": str(model_dir), "attn_implementation": "eager", "num_beams": 2,
                  "max_new_tokens": 6},
                 {"source": str(source), "target": str(target)},
                 {"source": str(heldout_source), "target": str(heldout_target)},
                 _hf_params(model_dir, "d_model", "encoder_attention_heads", None, qkv_bias=True))


def _exported_hf(model: dict, folder: Path) -> dict:
    return {**model, "path": str(folder)}


def _exported_fairseq(model: dict, folder: Path) -> dict:
    return {**model, "checkpoint": str(folder / "checkpoint.pt"), "data_bin": str(folder)}


def _fairseq_bound() -> dict[str, int]:
    from tiny_fairseq import BOUND_SHAPE

    return dict(BOUND_SHAPE)


# Each transformers family runs one architecture with eager attention and one with SDPA, and its exactness checks in
# float32 and bfloat16 (model.dtype). fairseq has no model.dtype: its checkpoints run in float32, as trained.
# The bound's shapes: layers (a decoder layer with two attentions counts twice) plus one for a classifier's
# pooler and head or an LM head; the longest inner product (feed-forward size, at least the sequence length:
# demo sentences stay under the classifiers' 64 positions, LM windows are 16 tokens).
TRANSFORMERS_DTYPES = ("float32", "bfloat16")
CASES: list[FamilyCase] = [
    FamilyCase("classifier-bert-eager", build_bert, {"depth": 2 + 1, "width": 64}, _exported_hf,
               runtime={"batch_size": 16}, dtypes=TRANSFORMERS_DTYPES),
    FamilyCase("classifier-distilbert-sdpa", build_distilbert, {"depth": 2 + 1, "width": 64}, _exported_hf,
               runtime={"batch_size": 16}, dtypes=TRANSFORMERS_DTYPES),
    FamilyCase("causal_lm-gqa-llama-sdpa", _lm_builder("llama_8q2kv", "sdpa", "hidden_size", "num_attention_heads",
                                                  "num_key_value_heads", qkv_bias=False),
               {"depth": 2 + 1, "width": 64}, _exported_hf, runtime={"batch_size": 4}, dtypes=TRANSFORMERS_DTYPES),
    FamilyCase("causal_lm-mha-gpt2-eager", _lm_builder("gpt2", "eager", "n_embd", "n_head", None, qkv_bias=True),
               {"depth": 2 + 1, "width": 32}, _exported_hf, runtime={"batch_size": 4}, dtypes=TRANSFORMERS_DTYPES),
    FamilyCase("causal_lm-mha-gpt_neox-eager", _lm_builder("gpt_neox", "eager", "hidden_size",
                                                          "num_attention_heads", None, qkv_bias=True),
               {"depth": 2 + 1, "width": 32}, _exported_hf, runtime={"batch_size": 4}, dtypes=TRANSFORMERS_DTYPES),
    FamilyCase("translation-fairseq", build_fairseq, _fairseq_bound(), _exported_fairseq,
               runtime={"batch_size": 6, "max_tokens": 0, "loss": True}, exact_reuse=False,
               same_path=fairseq_unfused),
    # Encoder reuse reads the batch's encoder output computed alone, in the shapes the plain path computes it: exact.
    # Float32 only: the exactness checks are the transformers layers' own (covered in bfloat16 by the other cases),
    # and every mask is a beam search. Depth: one encoder layer, a decoder layer's two attentions, the LM head; the
    # longest inner product the feed-forward's 32 (sentences stay under 16 tokens).
    FamilyCase("translation-hf_seq2seq-marian-eager", build_seq2seq, {"depth": 1 + 2 + 1, "width": 32},
               _exported_hf, runtime={"batch_size": 4, "loss": True}),
]
