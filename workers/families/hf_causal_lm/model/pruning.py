"""Physical head pruning of decoder-only LMs with grouped-query attention, and pruned ``save_pretrained`` folders.

Supported layouts (:mod:`headsweep.workers.families.hf_shared.layout`): Llama-style attention with separate
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3), GPT-2
(one ``Conv1D`` ``c_attn`` holding q, k and v, and ``c_proj``; both keep their weight as ``(in, out)``) and
GPTBigCode (an ``nn.Linear`` ``c_attn``; multi-query or not). The rule is
:mod:`headsweep.workers.core.head_slicing`: a query head's rows of ``q_proj`` and columns of ``o_proj`` go; a
key/value head's rows of ``k_proj`` and ``v_proj`` go only when every query head reading it is gone.

After pruning, layers have their own head counts, which a stock config cannot state, so the pruned modules carry
them in the attributes their forward reads (transformers 5):

* Llama-style: ``num_key_value_groups`` (read by the eager and SDPA attention functions to repeat key/value heads).
  When every kept key/value head keeps the same number of query heads, that number is all it takes. Otherwise
  (uneven groups, e.g. 3 and 4 query heads left of 4 and 4) ``k_proj`` and ``v_proj`` become
  :class:`GroupedKVProjection`: the same weights (kept key/value heads only), whose output is laid out once per
  kept query head, and ``num_key_value_groups`` is 1. The query/output shapes come from the weights (the forward
  reshapes with ``-1`` heads).
* GPT-2: ``split_size`` (where ``c_attn``'s output is split into q, k, v) and ``num_heads``/``embed_dim``;
  GPTBigCode: ``embed_dim`` (its split) and ``num_key_value_groups`` (multi-query), or ``num_heads``.

A layer that loses every head gets :class:`EmptyAttention`: no attention is computed and the layer adds only the
output projection's bias (zero for Llama, which has none), as the gated model does with every gate at 0. With a
cache it still records one zero key/value head per position, so that the cache's length stays right when
generating (transformers 5 counts a layer that holds no elements as length 0).

Each pruned attention module records, in ``headsweep_kv_index``, the kept key/value head each kept query head
reads (:attr:`HeadSlice.kv_index`), so :func:`~.sites.kv_groups` can name the groups of a pruned model.

Exported models keep the removed heads in ``config.pruned_heads`` (``{"layer": [head, ...]}``, original numbers,
as every transformers family writes them: :mod:`headsweep.workers.families.hf_shared.pruning`);
:func:`load_pruned` rebuilds the stock architecture from ``config.json``, removes the same heads and loads the
saved weights strictly (tied weights, which ``save_pretrained`` writes once, excepted). A static (pre-allocated)
cache sized from the config does not fit a pruned model: generate with the default dynamic cache.
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
from headsweep.workers.families.hf_causal_lm.model.fused_pruning import (
    PRUNABLE,
    apply_described,
    apply_stacked_qkv,
    described_problem,
)
from headsweep.workers.families.hf_causal_lm.model.pruned_modules import (
    KV_INDEX_ATTR,
    EmptyAttention,
    GroupedKVProjection,
    replace_module,
)
from headsweep.workers.families.hf_shared.layout import AttentionLayout, attention_layout
from headsweep.workers.families.hf_shared.pruning import load_pruned as load_transformers_pruned
from headsweep.workers.families.hf_shared.pruning import prune_sites


def prune_causal_lm_heads(model: nn.Module, heads: Iterable[Head]) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (attention ``self``, original numbers) from a transformers causal LM, in place.

    Returns each pruned module's slice. Every module is checked before the first one changes.
    """
    return prune_sites(model, heads, _prunable_layout, _apply)


def _apply(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    if layout.name == "llama" and layout.query is layout.key:
        apply_stacked_qkv(model, site, layout, plan)
    elif layout.name == "llama":
        _apply_llama(model, site, layout, plan)
    elif layout.name in PRUNABLE:
        apply_described(model, site, layout, plan)
    elif hasattr(site.module, "kv_heads"):
        _apply_gpt_bigcode(model, site, layout, plan)
    else:
        _apply_gpt2(model, site, layout, plan)


def _prunable_layout(site: AttentionSite) -> AttentionLayout:
    layout = attention_layout(site.module)
    name = type(site.module).__name__
    if layout is None or layout.name not in ("llama", "gpt2", *PRUNABLE):
        raise HeadsweepError(f"{site.module_name} ({name}): not a decoder attention layout headsweep can prune")
    if layout.name in PRUNABLE:
        problem = described_problem(site, layout)
        if problem:
            raise HeadsweepError(f"{site.module_name} ({name}): {problem}; gate its heads without pruning")
    fused = layout.name == "llama" and layout.query is layout.key
    if layout.name == "llama" and not fused and not isinstance(layout.key, nn.Linear):
        raise HeadsweepError(f"{site.module_name} ({name}): its key projection is not one linear layer: physical "
                             "pruning needs q_proj, k_proj, v_proj or one qkv_proj")
    if fused and (not isinstance(layout.query, nn.Linear) or layout.query.out_features
                  != (layout.num_heads + 2 * layout.num_kv_heads) * layout.head_dim):
        raise HeadsweepError(f"{site.module_name} ({name}): its qkv_proj is not all query heads, then all key and "
                             "all value heads (Phi-3's layout): headsweep cannot slice it")
    if layout.name != "gpt2":
        extra = _unsliced_parts(site.module, layout)
        if extra:
            raise HeadsweepError(f"{site.module_name} ({name}): physical pruning does not slice its "
                                 f"{', '.join(extra)} (weights across or per heads besides q/k/v/o_proj: gated, "
                                 "normalised or sink attention); gate its heads without pruning")
    if layout.name == "gpt2" and getattr(site.module, "q_attn", None) is not None:
        raise HeadsweepError(f"{site.module_name} ({name}): physical pruning of cross-attention is not supported")
    if getattr(site.module, KV_INDEX_ATTR, None) is not None:
        raise HeadsweepError(f"{site.module_name} was already pruned: prune the original model")
    return layout


def _unsliced_parts(module: nn.Module, layout: AttentionLayout) -> list[str]:
    """Weights of a decoder attention module that pruning would have to slice but does not: parameters of the
    module itself (gpt-oss's sinks; an output bias of the model's width is no head's), and children with weights
    besides the q/k/v/o projections, except norms over one head's features (Qwen3's ``q_norm``/``k_norm``, shared
    by every head) and latent attention's shared low-rank projections."""
    sliced = {id(m) for m in (layout.query, layout.key, layout.value, layout.out_proj)}
    if layout.name == "mla":
        sliced |= {id(getattr(module, n, None)) for n in ("q_proj", "q_b_proj", "kv_b_proj", "q_a_proj",
                                                          "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")}
    width = getattr(layout.out_proj, "out_features", None)
    extra = [n for n, p in module.named_parameters(recurse=False) if not (p.dim() == 1 and p.numel() == width)]
    widths = {"q_proj": (layout.query, layout.num_heads), "k_proj": (layout.key, layout.num_kv_heads),
              "v_proj": (layout.value, layout.num_kv_heads)}
    # A projection wider than its heads packs something else with them (Qwen3-Next's output gate in q_proj).
    separate = layout.query is not layout.key and layout.name != "mla"
    extra += [f"{n} (wider than its heads)" for n, (proj, count) in widths.items()
              if separate and isinstance(proj, nn.Linear) and proj.out_features != count * layout.head_dim]
    for child_name, child in module.named_children():
        if id(child) in sliced or not any(True for _ in child.parameters()):
            continue
        weight = getattr(child, "weight", None)
        per_head = (not isinstance(child, nn.Linear) and isinstance(weight, torch.Tensor) and weight.dim() == 1
                    and weight.numel() == layout.head_dim and len(list(child.parameters())) <= 2)
        if not per_head:
            extra.append(child_name)
    return extra


def _apply_llama(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    module = site.module
    keep_rows(layout.query, plan.query_rows)
    keep_rows(layout.key, plan.kv_rows)
    keep_rows(layout.value, plan.kv_rows)
    keep_columns(layout.out_proj, plan.query_rows)
    if not plan.kept:
        replace_module(model, site.module_name, EmptyAttention(module, layout.out_proj, plan.head_dim))
        return
    index = plan.kv_index
    sizes = {index.count(kv) for kv in range(len(plan.kept_kv))}
    if len(sizes) == 1:  # even groups: the stock forward repeats each key/value head this many times
        module.num_key_value_groups = sizes.pop()
        kv_heads = len(plan.kept_kv)
    else:
        module.k_proj = GroupedKVProjection(layout.key, index, plan.head_dim)
        module.v_proj = GroupedKVProjection(layout.value, index, plan.head_dim)
        module.num_key_value_groups = 1
        kv_heads = len(plan.kept)
    # Modules that reshape by the head counts they store (StableLM's num_heads) read the pruned counts.
    for attribute, count in (("num_heads", len(plan.kept)), ("num_key_value_heads", kv_heads)):
        if isinstance(getattr(module, attribute, None), int):
            setattr(module, attribute, count)
    setattr(module, KV_INDEX_ATTR, index)


def _apply_gpt2(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    module = site.module
    width = layout.num_heads * layout.head_dim  # c_attn's output: q, k, v of this width each
    rows = plan.query_rows
    _keep_conv1d_outputs(layout.query, torch.cat([rows, rows + width, rows + 2 * width]))
    _keep_conv1d_inputs(layout.out_proj, rows)
    kept = len(plan.kept)
    if not kept:
        replace_module(model, site.module_name, EmptyAttention(module, layout.out_proj, plan.head_dim))
        return
    module.num_heads = kept
    module.embed_dim = kept * plan.head_dim  # GPT-2's forward splits c_attn's output by split_size
    module.split_size = kept * plan.head_dim
    setattr(module, KV_INDEX_ATTR, plan.kv_index)


def _apply_gpt_bigcode(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    """GPTBigCode: ``c_attn`` is an ``nn.Linear``; with multi-query attention its output is all query heads, then
    the one key and the one value head; without, each head's q, k, v side by side (``3 * head_dim`` per head)."""
    module, d = site.module, plan.head_dim
    if module.multi_query:
        width = layout.num_heads * d
        kv = torch.arange(width, width + 2 * module.kv_dim) if plan.kept else torch.empty(0, dtype=torch.long)
        keep_rows(layout.query, torch.cat([plan.query_rows, kv]))
    else:
        keep_rows(layout.query, _rows_of(plan.kept, 3 * d))
    keep_columns(layout.out_proj, plan.query_rows)
    kept = len(plan.kept)
    if not kept:
        replace_module(model, site.module_name, EmptyAttention(module, layout.out_proj, d))
        return
    module.num_heads = kept
    module.embed_dim = kept * d  # where the multi-query forward splits c_attn's output
    module.split_size = kept * d
    if module.multi_query:
        module.num_key_value_groups = kept
    else:
        module.kv_heads = kept
        module.kv_dim = kept * d
    setattr(module, KV_INDEX_ATTR, plan.kv_index)


def _rows_of(heads: tuple[int, ...], size: int) -> torch.Tensor:
    if not heads:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(h * size, (h + 1) * size) for h in heads])


def _keep_conv1d_outputs(conv: nn.Module, columns: torch.Tensor) -> None:
    """Keep only ``columns`` of a ``Conv1D``'s output (weight ``(in, out)``: its columns; and the bias)."""
    columns = columns.to(conv.weight.device)
    conv.weight = _parameter(conv.weight, conv.weight.detach().index_select(1, columns))
    conv.bias = _parameter(conv.bias, conv.bias.detach().index_select(0, columns))
    conv.nf = int(columns.numel())


def _keep_conv1d_inputs(conv: nn.Module, rows: torch.Tensor) -> None:
    """Keep only ``rows`` of a ``Conv1D``'s input (its weight's rows; the bias is untouched)."""
    conv.weight = _parameter(conv.weight, conv.weight.detach().index_select(0, rows.to(conv.weight.device)))
    conv.nx = int(rows.numel())


def _parameter(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.clone().contiguous(), requires_grad=old.requires_grad)


def load_pruned(model_dir: str | Path, attn_implementation: str | None = None, device: str = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """A causal LM exported by ``headsweep export`` (or any ``save_pretrained`` folder), in eval mode: the stock
    architecture with the heads of ``config.pruned_heads`` removed, the saved weights loaded strictly (tied
    weights, which ``save_pretrained`` writes once, excepted)."""
    return load_transformers_pruned(model_dir, prune_causal_lm_heads, attn_implementation, device, dtype)
