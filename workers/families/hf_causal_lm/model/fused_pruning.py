"""Physical head pruning of the decoder layouts described as data (:mod:`..hf_shared.site_table`) and of Phi-3's
fused ``qkv_proj``: which output rows of a fused query/key/value projection belong to a head, and what the
module's forward must read afterwards.

Rows of the fused projection, per layout (``d`` the head size, ``H`` query heads, ``G`` key/value heads):

* ``per_head`` (GPT-NeoX's ``query_key_value``, Bloom's, Falcon's without multi-query): head ``h`` owns rows
  ``3dh .. 3d(h+1)``, its query, key and value side by side.
* Falcon multi-query: all query heads, then the one key and the one value head (kept while any head is).
* Falcon's new decoder architecture (``grouped``): per key/value group, its ``H/G`` query heads, its key, its value.
* Phi-3's ``qkv_proj`` (``stacked``): all query heads, all key heads, all value heads.
* Multi-head latent attention (DeepSeek-V2/V3): head ``h`` owns ``qk_head_dim`` rows of ``q_proj`` (or ``q_b_proj``)
  and ``qk_nope_head_dim + v_head_dim`` rows of ``kv_b_proj``; the latent projections are shared and stay.
* Separate ``q_proj``/``k_proj``/``v_proj`` (Phi, GPT-J, OPT): as Llama's.

Where a grouped layout's forward needs groups of one size (Falcon's new architecture, Phi-3) and the kept groups
differ, each kept query head gets its own copy of its key/value rows: the same numbers, one group per head.

ALiBi (Bloom, Falcon with ``alibi``): the model builds one slope per head of its config for every layer, so a pruned
layer keeps its own heads' rows of that tensor (:class:`KeptAlibiRows`, a forward pre-hook that load_pruned
installs again when it prunes a rebuilt model).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.head_slicing import HeadSlice, keep_columns, keep_rows
from headsweep.workers.families.hf_causal_lm.model.pruned_modules import (
    KV_INDEX_ATTR,
    EmptyAttention,
    GroupedKVProjection,
    replace_module,
)
from headsweep.workers.families.hf_shared.layout import AttentionLayout

#: Described layouts whose physical pruning is implemented here.
PRUNABLE = ("gpt_neox", "bloom", "falcon", "phi", "gptj", "opt", "mla")
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads")


class KeptAlibiRows:
    """Forward pre-hook of a pruned ALiBi attention module: keeps the rows of the model's ``alibi`` tensor (Bloom's
    ``(batch * heads, 1, keys)``, Falcon's ``(batch, heads, 1, keys)``: one slope per head of the config) that
    belong to the module's kept heads."""

    def __init__(self, total: int, kept: tuple[int, ...]):
        self.total, self.kept = total, kept

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        alibi = kwargs.get("alibi")
        if isinstance(alibi, torch.Tensor):
            index = torch.tensor(self.kept, dtype=torch.long, device=alibi.device)
            if alibi.dim() == 4:  # Falcon: (batch, heads, 1, keys), and its mask carries the slopes per head too
                kept = alibi.index_select(1, index)
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == self.total:
                    kwargs = {**kwargs, "attention_mask": mask.index_select(1, index)}
            else:  # Bloom: (batch * heads, 1, keys)
                per_head = alibi.view(-1, self.total, *alibi.shape[1:])
                kept = per_head.index_select(1, index).reshape(-1, *alibi.shape[1:])
            kwargs = {**kwargs, "alibi": kept}
        return args, kwargs


def described_problem(site: AttentionSite, layout: AttentionLayout) -> str | None:
    """Why a described layout cannot be pruned here (None: it can)."""
    module = site.module
    if layout.name not in PRUNABLE:
        return "not a decoder attention layout headsweep can prune"
    if layout.name == "mla":
        parts = _mla_parts(module)
        return None if parts else ("latent attention without the q_proj / q_b_proj, kv_b_proj, qk_nope_head_dim and "
                                   "v_head_dim of DeepSeek-V2/V3: headsweep cannot slice its heads")
    if layout.name == "falcon":
        return None if isinstance(module.query_key_value, nn.Linear) else "no linear query_key_value"
    if layout.name in ("gpt_neox", "bloom"):
        fused = layout.query
        if not isinstance(fused, nn.Linear) or fused.out_features != 3 * layout.num_heads * layout.head_dim:
            return "its query_key_value is not three rows of each head"
        return None
    if not all(isinstance(p, nn.Linear) for p in (layout.query, layout.key, layout.value)):
        return "no separate q_proj, k_proj and v_proj"
    return None


def apply_described(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    """Remove ``plan``'s heads from one described attention module, in place."""
    module, d = site.module, plan.head_dim
    if layout.name == "mla":
        query, kv_b, qk, nope_v = _mla_parts(module)
        keep_rows(query, _rows_of(plan.kept, qk))
        keep_rows(kv_b, _rows_of(plan.kept, nope_v))
    elif layout.name in ("gpt_neox", "bloom"):
        keep_rows(layout.query, _rows_of(plan.kept, 3 * d))
    elif layout.name == "falcon":
        _slice_falcon(module, layout, plan)
    else:
        keep_rows(layout.query, plan.query_rows)
        keep_rows(layout.key, plan.kv_rows)
        keep_rows(layout.value, plan.kv_rows)
    keep_columns(layout.out_proj, plan.query_rows)
    alibi = _alibi_heads(module, layout)
    if not plan.kept:
        replace_module(model, site.module_name, EmptyAttention(module, layout.out_proj, d,
                                                               adds_residual=layout.name == "bloom"))
        return
    kv_heads = len(plan.kept) if layout.name != "falcon" else module.num_kv_heads
    if layout.name in ("phi", "gptj", "opt") and layout.num_kv_heads < layout.num_heads:
        kv_heads = _kv_groups(module, layout, plan)
    _set_counts(module, len(plan.kept), kv_heads)
    if layout.name in ("phi", "gptj", "opt") and getattr(module, "embed_dim", None) == layout.num_heads * d:
        module.embed_dim = len(plan.kept) * d  # the attention's width, where XGLM reshapes its output
    if alibi:
        module.register_forward_pre_hook(KeptAlibiRows(alibi, plan.kept), with_kwargs=True)
    setattr(module, KV_INDEX_ATTR, plan.kv_index)


def apply_stacked_qkv(model: nn.Module, site: AttentionSite, layout: AttentionLayout, plan: HeadSlice) -> None:
    """Phi-3: one ``qkv_proj`` (all queries, all keys, all values) and ``o_proj``; its forward splits the fused
    output at ``config.num_attention_heads`` query heads, so the module gets its own copy of the config."""
    module, d = site.module, plan.head_dim
    width, kv_width = layout.num_heads * d, layout.num_kv_heads * d
    index = plan.kv_index
    even = len({index.count(kv) for kv in range(len(plan.kept_kv))}) <= 1
    kv_rows = plan.kv_rows if even else _rows_of(tuple(plan.kept_kv[i] for i in index), d)
    keep_rows(layout.query, torch.cat([plan.query_rows, width + kv_rows, width + kv_width + kv_rows]))
    keep_columns(layout.out_proj, plan.query_rows)
    if not plan.kept:
        replace_module(model, site.module_name, EmptyAttention(module, layout.out_proj, d))
        return
    kv_heads = len(plan.kept_kv) if even else len(plan.kept)
    module.config = copy.copy(module.config)
    module.config.num_attention_heads = len(plan.kept)
    module.config.num_key_value_heads = kv_heads
    _set_counts(module, len(plan.kept), kv_heads)
    setattr(module, KV_INDEX_ATTR, index)


def _set_counts(module: nn.Module, heads: int, kv_heads: int) -> None:
    """The pruned head counts where the module's forward reads them (and its key/value repeat factor)."""
    for attrs, count in ((HEAD_COUNT_ATTRS, heads), (KV_COUNT_ATTRS, kv_heads)):
        for attr in attrs:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, count)
    if isinstance(getattr(module, "num_key_value_groups", None), int) and kv_heads:
        module.num_key_value_groups = heads // kv_heads


def _kv_groups(module: nn.Module, layout: AttentionLayout, plan: HeadSlice) -> int:
    """Separate key/value projections with grouped heads: the kept key/value heads; uneven groups read theirs
    through :class:`GroupedKVProjection` (one key/value head per query head). Returns the key/value head count."""
    index = plan.kv_index
    if len({index.count(kv) for kv in range(len(plan.kept_kv))}) == 1:
        return len(plan.kept_kv)
    module.k_proj = GroupedKVProjection(layout.key, index, plan.head_dim)
    module.v_proj = GroupedKVProjection(layout.value, index, plan.head_dim)
    return len(plan.kept)


def _slice_falcon(module: nn.Module, layout: AttentionLayout, plan: HeadSlice) -> None:
    d, n = plan.head_dim, layout.num_heads
    fused = module.query_key_value
    if module.new_decoder_architecture:
        groups = module.num_kv_heads
        size = n // groups
        index = plan.kv_index
        even = len({index.count(kv) for kv in range(len(plan.kept_kv))}) <= 1
        blocks = []
        # Per kept group (or, with uneven groups, per kept head): its kept queries, then its key and value.
        members = [[h for h in plan.kept if h // size == g] for g in plan.kept_kv] if even else \
            [[h] for h in plan.kept]
        for heads in members:
            g = heads[0] // size
            start = g * (size + 2) * d
            rows = [start + (h % size) * d for h in heads] + [start + size * d, start + (size + 1) * d]
            blocks += [torch.arange(r, r + d) for r in rows]
        keep_rows(fused, torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.long))
        module.num_kv_heads = len(members)
    elif module.multi_query:
        kv = torch.arange(n * d, n * d + 2 * d) if plan.kept else torch.empty(0, dtype=torch.long)
        keep_rows(fused, torch.cat([plan.query_rows, kv]))
    else:
        keep_rows(fused, _rows_of(plan.kept, 3 * d))
        module.num_kv_heads = len(plan.kept)


def _alibi_heads(module: nn.Module, layout: AttentionLayout) -> int:
    """The head count the model's ALiBi tensor has rows for (0: the module takes no ALiBi)."""
    config = getattr(module, "config", None)
    if layout.name == "bloom" or (layout.name == "falcon" and getattr(config, "alibi", False)):
        return layout.num_heads
    return 0


def _mla_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, int, int] | None:
    """Latent attention's per-head projections: the query's (``q_proj``, or ``q_b_proj`` after the low-rank
    ``q_a_proj``), ``kv_b_proj``, and their rows per head; None if the module is not laid out so."""
    query = getattr(module, "q_proj", None) or getattr(module, "q_b_proj", None)
    kv_b = getattr(module, "kv_b_proj", None)
    sizes = [getattr(module, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads")]
    if not isinstance(query, nn.Linear) or not isinstance(kv_b, nn.Linear) or \
            not all(isinstance(s, int) and s > 0 for s in sizes):
        return None
    nope, rope, value, heads = sizes
    if query.out_features != heads * (nope + rope) or kv_b.out_features != heads * (nope + value):
        return None
    return query, kv_b, nope + rope, nope + value


def _rows_of(heads: tuple[int, ...], size: int) -> torch.Tensor:
    if not heads:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(h * size, (h + 1) * size) for h in heads])
