"""Physical head pruning of transformers encoders, and pruned ``save_pretrained`` folders.

Supported: BERT-family encoders (BERT, RoBERTa, ELECTRA, MiniLM) and DistilBERT, in the layouts
of :mod:`headsweep.workers.families.transformers.layout`: rows of W_Q, W_K, W_V and columns of
W_O go (:mod:`headsweep.workers.head_slicing`), and a module that loses every head is replaced by
one that computes no attention and adds only W_O's bias. Decoder-only models with grouped-query
attention are refused for now. The generic part (dispatch, parameter counts, ungated copies) is
:mod:`headsweep.workers.pruning`.

Exported transformers models keep the removed heads in ``config.pruned_heads``
(``{"layer": [head, ...]}``, original head numbers, the format transformers 4 used), and
:func:`load_pruned` rebuilds them with stock transformers 5: the model is built from its
config, the same heads are removed, then the saved weights are loaded with strict key and
shape checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.families.transformers.layout import AttentionLayout, attention_layout
from headsweep.workers.families.transformers.sites import find_sites
from headsweep.workers.gates import AttentionSite
from headsweep.workers.head_slicing import HeadSlice, keep_columns, keep_rows, plan_slice
from headsweep.workers.heads import Head, SiteKey
from headsweep.workers.pruning import group_by_site

PRUNED_HEADS_KEY = "pruned_heads"


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


def sites_to_prune(model: nn.Module, heads: Iterable[Head],
                   find: Callable[[nn.Module], list[AttentionSite]]) -> tuple[list[AttentionSite], dict]:
    """The attention sites of a transformers ``model`` (found by ``find``) and ``heads`` grouped by site, checked:
    a model pruned before is refused (its heads are renumbered: a mask in the original numbers would remove the
    wrong ones), and so is one without attention sites. Shared by both transformers families."""
    if getattr(getattr(model, "config", None), PRUNED_HEADS_KEY, None):
        raise HeadsweepError("this model was already pruned (config.pruned_heads is set): prune the original model")
    sites = find(model)
    if not sites:
        raise HeadsweepError(f"no attention modules recognised in {type(model).__name__}: nothing to prune")
    return sites, group_by_site(sites, heads)


def prune_hf_heads(model: nn.Module, heads: Iterable[Head]) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (attention ``self``) from a transformers BERT-family or DistilBERT model, in place."""
    sites, grouped = sites_to_prune(model, heads, find_sites)
    work = [(site, _prunable_layout(site), plan_slice(site.num_heads, site.head_dim, grouped[site.key]))
            for site in sites if grouped.get(site.key)]
    for site, layout, plan in work:  # every module checked before the first one changes
        _apply(model, site, layout, plan)
    slices = {site.key: plan for site, _, plan in work}
    _record_pruned(model, slices)
    return slices


def _prunable_layout(site: AttentionSite) -> AttentionLayout:
    layout = attention_layout(site.module)
    if layout is None or layout.name not in ("bert", "distilbert"):
        raise HeadsweepError(
            f"{site.module_name} ({type(site.module).__name__}): physical pruning supports BERT-family and "
            "DistilBERT attention; decoder-only models (grouped-query attention) are pruned by model.kind hf_causal_lm"
        )
    return layout


def _apply(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    for proj in (layout.query, layout.key, layout.value):
        keep_rows(proj, plan.query_rows)
    keep_columns(layout.out_proj, plan.query_rows)
    layout.set_num_heads(len(plan.kept))
    if not plan.kept:
        empty = EmptySelfAttention if layout.name == "bert" else EmptyDistilBertAttention
        layout.replace_core(model, site.module_name, empty(layout.core))


def _record_pruned(model: nn.Module, slices: dict[SiteKey, HeadSlice]) -> None:
    """Record the removed heads in ``config.pruned_heads`` (original numbers), which ``save_pretrained`` writes."""
    config = getattr(model, "config", None)
    if config is not None:
        setattr(config, PRUNED_HEADS_KEY, {str(layer): list(s.removed) for (_, layer), s in sorted(slices.items())})


def pruned_heads_of(config) -> list[Head]:
    """The removed heads recorded in a transformers config (empty if it was never pruned)."""
    record = getattr(config, PRUNED_HEADS_KEY, None) or {}
    try:
        return sorted(Head("self", int(layer), int(h)) for layer, hs in record.items() for h in hs)
    except (TypeError, ValueError, AttributeError):
        raise HeadsweepError(
            f"config.{PRUNED_HEADS_KEY} must map layer numbers to lists of heads, got {record!r}"
        ) from None


def save_pruned(model: nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """``save_pretrained`` a pruned transformers model (and its tokenizer); :func:`load_pruned` reads it back."""
    out = Path(out_dir)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def rebuild_pruned(model_dir: str | Path, attn_implementation: str | None,
                   prune: Callable[[nn.Module, list[Head]], object]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The architecture ``config.architectures`` names, built from ``model_dir``'s config with stock transformers,
    with the heads of ``config.pruned_heads`` removed by ``prune``; and the folder's saved weights (not loaded yet).

    Shared by the transformers families' ``load_pruned`` (classifiers here, causal LMs in ``hf_causal_lm``).
    """
    import transformers
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HeadsweepError(f"cannot read the model config in {model_dir}: {str(exc).splitlines()[0]}") from None
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise HeadsweepError(f"{model_dir}/config.json names no transformers architecture (architectures: {names})")
    if attn_implementation:
        config._attn_implementation = attn_implementation
    heads = pruned_heads_of(config)
    setattr(config, PRUNED_HEADS_KEY, {})
    model = cls(config)
    if heads:
        prune(model, heads)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(model_dir):
        state.update(load_file(str(file)))
    return model, state


def load_pruned(model_dir: str | Path, attn_implementation: str | None = None, device: str = "cpu") -> nn.Module:
    """Load a model saved by :func:`save_pruned` (or any ``save_pretrained`` directory), in eval mode.

    The architecture named in ``config.architectures`` is built from the config with stock
    transformers, the heads in ``config.pruned_heads`` are removed, and the saved weights are
    loaded strictly (every key, every shape). A directory without ``pruned_heads`` loads as
    the full model.
    """
    model, state = rebuild_pruned(model_dir, attn_implementation, prune_hf_heads)
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    if floating:
        model.to(floating[0])
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        reason = str(exc).splitlines()[0]
        raise HeadsweepError(f"the weights in {model_dir} do not fit its pruned config: {reason}") from None
    return model.to(device).eval()


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise HeadsweepError(f"no model.safetensors in {model_dir}")
    return [single]
