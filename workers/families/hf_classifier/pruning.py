"""Physical head pruning of transformers encoders: BERT-family (BERT, RoBERTa, ELECTRA, MiniLM) and DistilBERT.

In the layouts of :mod:`headsweep.workers.families.hf_shared.layout`: rows of W_Q, W_K, W_V and columns of
W_O go (:mod:`headsweep.workers.core.head_slicing`), and a module that loses every head is replaced by one that
computes no attention and adds only W_O's bias. Decoder-only models are pruned by ``hf_causal_lm``. What every
transformers family's pruning shares (the checks before, ``config.pruned_heads`` after, exported folders) is
:mod:`headsweep.workers.families.hf_shared.pruning`; the family-independent part (dispatch, parameter counts,
ungated copies) is :mod:`headsweep.workers.pruning.removal`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.head_slicing import HeadSlice, keep_columns, keep_rows
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.hf_shared.layout import AttentionLayout, attention_layout
from headsweep.workers.families.hf_shared.pruning import load_pruned as load_transformers_pruned
from headsweep.workers.families.hf_shared.pruning import prune_sites


class EmptySelfAttention(nn.Module):
    """The inner self-attention of a BERT-family layer that has lost every head.

    It returns an empty context (no attention is computed), so the layer's output projection
    contributes exactly its bias, as in the gated model with every gate at 0. The (empty)
    projections stay as children so that the state dict has the same keys as before.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        for name, child in inner.named_children():
            self.add_module(name, child)
        self.num_attention_heads = 0
        self.attention_head_size = inner.attention_head_size
        self.all_head_size = 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], 0), None


class EmptyDistilBertAttention(nn.Module):
    """DistilBERT attention with every head removed: the output projection's bias, broadcast."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        for name, child in inner.named_children():
            self.add_module(name, child)
        self.config = inner.config
        self.n_heads = 0
        self.dim = inner.dim
        self.attention_head_size = inner.attention_head_size
        self.is_causal = False

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        # An empty input to out_lin gives its bias (or zeros without one) at every position.
        return self.out_lin(hidden_states.new_zeros(*hidden_states.shape[:-1], 0)), None


def prune_hf_heads(model: nn.Module, heads: Iterable[Head]) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (attention ``self``) from a transformers BERT-family or DistilBERT model, in place."""
    return prune_sites(model, heads, _prunable_layout, _apply)


def _prunable_layout(site: AttentionSite) -> AttentionLayout:
    layout = attention_layout(site.module)
    if layout is None or layout.name not in ("bert", "distilbert"):
        raise HeadsweepError(
            f"{site.module_name} ({type(site.module).__name__}): physical pruning supports BERT-family and "
            "DistilBERT attention; decoder-only models (grouped-query attention) are pruned by model.kind hf_causal_lm"
        )
    extra = _unsliced_parts(layout)
    if extra:
        raise HeadsweepError(
            f"{site.module_name} ({type(layout.core).__name__}): physical pruning slices query, key, value and the "
            f"output projection, and this attention has further weights ({', '.join(extra)}: relative-position or "
            "approximate attention, DeBERTa, Nystromformer, ...); gate its heads without pruning"
        )
    return layout


def _unsliced_parts(layout: AttentionLayout) -> list[str]:
    """What the BERT/DistilBERT slicing would leave unsliced in a module it recognised: missing q/k/v projections,
    or other children with weights (a core that computes its contexts in ways the slicing does not know)."""
    parts = {"query": layout.query, "key": layout.key, "value": layout.value}
    missing = [name for name, proj in parts.items() if not isinstance(proj, nn.Linear)]
    known = {id(p) for p in (*parts.values(), layout.out_proj)}
    extra = [name for name, child in layout.core.named_children()
             if id(child) not in known and any(True for _ in child.parameters())]
    return [f"no {m} projection" for m in missing] + extra + [
        name for name, _ in layout.core.named_parameters(recurse=False)]


def _apply(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    for proj in (layout.query, layout.key, layout.value):
        keep_rows(proj, plan.query_rows)
    keep_columns(layout.out_proj, plan.query_rows)
    layout.set_num_heads(len(plan.kept))
    if not plan.kept:
        empty = EmptySelfAttention if layout.name == "bert" else EmptyDistilBertAttention
        layout.replace_core(model, site.module_name, empty(layout.core))


def load_pruned(model_dir: str | Path, attn_implementation: str | None = None, device: str = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """A classifier exported by ``headsweep export`` (or any ``save_pretrained`` folder), in eval mode: the stock
    architecture with the heads of ``config.pruned_heads`` removed, the saved weights loaded strictly."""
    return load_transformers_pruned(model_dir, prune_hf_heads, attn_implementation, device, dtype)
