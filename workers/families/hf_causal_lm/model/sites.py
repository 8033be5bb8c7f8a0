"""Attention sites of a causal LM, and which query heads share a key/value head.

The sites are the transformers layouts of :mod:`headsweep.workers.families.hf_shared.layout`
(Llama-style ``o_proj``, GPT-2 / GPTBigCode ``c_proj``); the gates act on the output projection's
input, one slice of ``head_dim`` features per query head.
"""

from __future__ import annotations

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.families.hf_shared.layout import attention_layout
from headsweep.workers.families.hf_shared.sites import check_sites
from headsweep.workers.families.hf_shared.sites import find_sites as find_transformers_sites

SUPPORTED = ("decoder-only causal LMs with Llama-style attention (Llama, Mistral, Qwen2, Qwen3, Phi-3, ...), "
             "GPT-2, GPTBigCode, GPT-NeoX, GPT-J, OPT, Falcon, Bloom and the other layouts of docs/families.md")


def find_sites(model: nn.Module) -> list[AttentionSite]:
    """Every self-attention module of a decoder-only transformers model (empty if none is recognised)."""
    return find_transformers_sites(model)


def sites_or_error(model: nn.Module) -> list[AttentionSite]:
    """:func:`find_sites`, or the one-line error naming what is missing (no heads, an unknown attention layout)
    and the supported families."""
    sites = find_sites(model)
    check_sites(model, sites, "hf_causal_lm", SUPPORTED)
    return sites


def kv_groups(sites: list[AttentionSite]) -> dict[str, list[list[int]]]:
    """For each layer (``self:LAYER``), the query heads of each key/value head, in key/value head order.

    Query head h reads key/value head ``h // (H / H_kv)`` (transformers' ``repeat_kv``); plain
    multi-head attention has one query head per group, multi-query attention one group.
    A physically pruned module says which key/value head each of its (renumbered) query heads reads: its
    groups may differ in size.
    """
    groups = {}
    for site in sites:
        index = getattr(site.module, "headsweep_kv_index", None)
        if index is not None:  # physically pruned (pruning.KV_INDEX_ATTR): groups of any size
            groups[f"{site.attention}:{site.layer}"] = [[h for h, kv in enumerate(index) if kv == g]
                                                        for g in range(max(index, default=-1) + 1)]
            continue
        layout = attention_layout(site.module)
        kv = layout.num_kv_heads if layout is not None else site.num_heads
        if kv < 1 or site.num_heads % kv:
            raise HeadsweepError(f"{site.module_name}: {site.num_heads} query heads cannot share {kv} key/value "
                                 "heads evenly")
        size = site.num_heads // kv
        groups[f"{site.attention}:{site.layer}"] = [list(range(g * size, (g + 1) * size)) for g in range(kv)]
    return groups
