"""Whether a causal LM without some heads is still a stock architecture, and its config if so.

transformers' Llama-style configs (Llama, Mistral, Qwen2, Qwen3, Gemma) state one ``num_attention_heads``, one
``num_key_value_heads`` and a ``head_dim`` apart from ``hidden_size``, and their attention modules read these three
(``num_key_value_groups = num_attention_heads // num_key_value_heads``). A mask fits such a config when every layer
keeps the same number of query heads and of key/value heads, every kept key/value head keeps the same number of
query heads (the stock forward repeats each key/value head that many times, so the kept query heads, renumbered in
their old order, read their own key/value heads), and no layer loses every head (a stock config has no layer without
attention). The pruned weights, saved with these three numbers in ``config.json``
(:func:`headsweep.workers.families.hf_shared.stock.stock_config`), are then what stock ``from_pretrained`` builds
and loads.

GPT-2 (``n_embd / n_head``) and BERT-family configs derive the head size from the hidden size: fewer heads would
mean smaller heads there, so no mask of theirs has a stock config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import group_by_site
from headsweep.workers.core.head_slicing import plan_slice
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_shared.layout import attention_layout
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.families.hf_shared.stock import TIED_HEAD_SIZE, check_stock_config


def stock_sizes(model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
    """The sizes ``config.json`` states for ``model`` without ``heads`` (:data:`STOCK_KEYS`); a one-line error
    naming what a stock config cannot state otherwise. Checks only: the model is left as it is."""
    name = type(model).__name__
    sites = find_sites(model)
    layouts = [attention_layout(s.module) for s in sites]
    config = getattr(model, "config", None)
    if not sites or any(lay is None or lay.name not in ("llama", "mla") for lay in layouts) or config is None \
            or not hasattr(config, "num_key_value_heads"):
        raise HeadsweepError(_no_stock_config(model, layouts))
    if getattr(config, "pruned_heads", None):
        raise HeadsweepError("this model was already pruned (config.pruned_heads is set): prune the original model")
    grouped = group_by_site(sites, heads)
    kept: dict[int, tuple[int, int]] = {}  # layer -> (query heads, key/value heads) kept
    uneven, empty = [], []
    for site, layout in zip(sites, layouts, strict=True):
        assert layout is not None
        plan = plan_slice(site.num_heads, site.head_dim, grouped.get(site.key, []), layout.num_kv_heads)
        if not plan.kept:
            empty.append(site.layer)
            continue
        sizes = {plan.kv_index.count(kv) for kv in range(len(plan.kept_kv))}
        if len(sizes) > 1:
            uneven.append(site.layer)
        kept[site.layer] = (len(plan.kept), len(plan.kept_kv))
    if empty:
        raise HeadsweepError(f"the mask removes every head of layer{_s(empty)} {_layers(empty)}: a stock config "
                             "cannot state a layer without attention; keep at least one key/value group in every "
                             "layer (or export without --stock: headsweep.load_pruned loads it)")
    counts = set(kept.values())
    if uneven or len(counts) > 1:
        raise HeadsweepError(f"--stock needs the same heads in every layer and in every key/value group: "
                             f"{_differences(kept, uneven)}; the masks of a prune_level run with "
                             f"prune: {{uniform: {_fitting_unit(sites, layouts, grouped)}}} fit, or export without "
                             "--stock (headsweep.load_pruned loads it)")
    query, kv = counts.pop()
    head_dims = {s.head_dim for s in sites}
    if len(head_dims) > 1:  # no transformers config states this, but say so rather than write a wrong one
        raise HeadsweepError(f"{name}'s layers have heads of sizes {sorted(head_dims)}: a stock config states one")
    sizes = {"num_attention_heads": query, "num_key_value_heads": kv, "head_dim": head_dims.pop()}
    if layouts[0] is not None and layouts[0].name == "mla":
        # Latent attention states its head sizes apart (qk_nope_head_dim, qk_rope_head_dim, v_head_dim); its
        # config's head_dim is the rotary size, not a head's width.
        sizes = {"num_attention_heads": query, "num_key_value_heads": kv}
    check_stock_config(model, sizes)
    _check_rebuilt_attention(model, sites[0], sizes)
    return sizes


def _no_stock_config(model: nn.Module, layouts: list) -> str:
    """Why no stock config states a pruned model of a layout other than Llama's and latent attention's."""
    name, config = type(model).__name__, getattr(model, "config", None)
    aliases = getattr(config, "attribute_map", {}) or {}  # GPT-2's hidden_size is an alias of n_embd: name n_embd
    width = next((k for k in ("hidden_size", "n_embd", "d_model") if hasattr(config, k) and k not in aliases),
                 "hidden_size")
    count = next((k for k in ("num_attention_heads", "n_head", "num_heads") if hasattr(config, k)
                  and k not in aliases), "num_attention_heads")
    names = {getattr(lay, "name", None) for lay in layouts}
    if names & {"bloom"} or ("falcon" in names and getattr(config, "alibi", False)):
        return (f"{name}'s config derives the head size from {width} / {count} and its ALiBi slopes from {count}: "
                "a stock config with fewer heads would give the kept heads other slopes, so none states a pruned "
                f"{name}; export without --stock (headsweep.load_pruned keeps each kept head's slope)")
    return TIED_HEAD_SIZE.format(name=name, how=f"{width} / {count}")


def _check_rebuilt_attention(model: nn.Module, site: Any, sizes: dict[str, int]) -> None:
    """Refuse ``sizes`` where the model's own attention class, built from the pruned config (on the meta device: no
    memory), would not have the pruned shapes: a config class that derives the head size from ``hidden_size /
    num_attention_heads`` and ignores ``head_dim`` (StableLM) would load the stock folder with other shapes. A class
    that cannot be built so is left to ``from_pretrained``'s own shape checks."""
    import copy

    import torch

    config: Any = copy.deepcopy(model.config)
    for key, value in sizes.items():
        setattr(config, key, value)
    try:
        with torch.device("meta"):
            rebuilt = type(site.module)(config, layer_idx=site.layer)
    except Exception:  # noqa: BLE001 - another constructor: nothing to compare here
        return
    if "head_dim" not in sizes:  # latent attention: stock_config compares every rebuilt shape
        return
    query = getattr(rebuilt, "q_proj", None)
    want = sizes["num_attention_heads"] * sizes["head_dim"]
    fused = getattr(rebuilt, "qkv_proj", None)
    if isinstance(fused, nn.Linear) and query is None:  # Phi-3: queries, then keys and values
        query = fused
        want = (sizes["num_attention_heads"] + 2 * sizes["num_key_value_heads"]) * sizes["head_dim"]
    if isinstance(query, nn.Linear) and query.out_features != want:
        raise HeadsweepError(
            f"{type(model.config).__name__} does not state the pruned head size: built from the pruned config "
            f"({sizes}), {type(site.module).__name__} has {query.out_features // (want // sizes['head_dim'])}-wide "
            f"heads, not {sizes['head_dim']} (the config derives them from hidden_size / num_attention_heads); export "
            "without --stock (headsweep.load_pruned loads it)")


def _fitting_unit(sites, layouts, grouped) -> str:
    """``kv_groups`` when the mask removes only whole key/value groups, else ``heads``."""
    for site, layout in zip(sites, layouts, strict=True):
        removed = set(grouped.get(site.key, []))
        size = site.num_heads // layout.num_kv_heads
        for g in range(layout.num_kv_heads):
            if 0 < len(removed & set(range(g * size, (g + 1) * size))) < size:
                return "heads"
    return "kv_groups"


def _differences(kept: dict[int, tuple[int, int]], uneven: list[int]) -> str:
    by_count: dict[tuple[int, int], list[int]] = {}
    for layer, count in sorted(kept.items()):
        by_count.setdefault(count, []).append(layer)
    parts = [f"layer{_s(layers)} {_layers(layers)} keep{'' if len(layers) > 1 else 's'} {q} query / {kv} key-value "
             "heads" for (q, kv), layers in sorted(by_count.items(), key=lambda item: item[1][0])] \
        if len(by_count) > 1 else []
    if uneven:
        parts.append(f"layer{_s(uneven)} {_layers(uneven)} keep{'' if len(uneven) > 1 else 's'} unequal numbers of "
                     "query heads per key/value head")
    return "; ".join(parts)


def _s(items: list) -> str:
    return "s" if len(items) > 1 else ""


def _layers(layers: list[int], shown: int = 8) -> str:
    text = ", ".join(map(str, layers[:shown]))
    return text + (f" (+{len(layers) - shown} more)" if len(layers) > shown else "")
