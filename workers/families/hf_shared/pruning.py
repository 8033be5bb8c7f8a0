"""What physical pruning of a transformers model is, whatever its layout: the checks before, the record after,
and exported ``save_pretrained`` folders.

Which rows and columns go, and how a module keeps working with fewer heads, is each family's
(``hf_classifier.pruning``: BERT-family encoders and DistilBERT; ``hf_causal_lm.model.pruning``: Llama-style decoders,
GPT-2 and GPTBigCode). Both record the removed heads in ``config.pruned_heads`` (``{"layer": [head, ...]}``,
original head numbers, the format transformers 4 used), which ``save_pretrained`` writes into ``config.json``;
:func:`load_pruned` rebuilds such a folder with stock transformers 5: the architecture ``config.architectures``
names is built from the config, the same heads are removed with the family's pruning, then the saved weights are
loaded with strict key and shape checks (only weights tied to a loaded one, which ``save_pretrained`` writes
once, may be absent).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite, group_by_site
from headsweep.workers.core.head_slicing import HeadSlice, plan_slice
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.hf_shared.layout import AttentionLayout
from headsweep.workers.families.hf_shared.shared_layers import refuse_shared
from headsweep.workers.families.hf_shared.sites import find_sites

PRUNED_HEADS_KEY = "pruned_heads"

#: A family's pruning: removes the heads from the model in place.
Pruner = Callable[[nn.Module, list[Head]], object]
#: A family's check of one site before anything changes: its layout, or a clear error if it cannot prune it.
Prunable = Callable[[AttentionSite], AttentionLayout]
#: A family's removal of one module's heads, in place.
ApplySlice = Callable[[nn.Module, AttentionSite, AttentionLayout, HeadSlice], None]


def sites_to_prune(model: nn.Module, heads: Iterable[Head]) -> tuple[list[AttentionSite], dict[SiteKey, list[int]]]:
    """The attention sites of a transformers ``model`` and ``heads`` grouped by site, checked: a model pruned before
    is refused (its heads are renumbered: a mask in the original numbers would remove the wrong ones), and so are
    one without attention sites and one whose attention module runs at several depths (ALBERT)."""
    if getattr(getattr(model, "config", None), PRUNED_HEADS_KEY, None):
        raise HeadsweepError("this model was already pruned (config.pruned_heads is set): prune the original model")
    sites = find_sites(model)
    if not sites:
        raise HeadsweepError(f"no attention modules recognised in {type(model).__name__}: nothing to prune")
    refuse_shared(sites, "physical pruning (export, efficiency)")
    return sites, group_by_site(sites, heads)


def prune_sites(model: nn.Module, heads: Iterable[Head], prunable: Prunable, apply: ApplySlice
                ) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (attention ``self``, original numbers) from a transformers ``model`` in place, and record
    them in ``config.pruned_heads``; returns each pruned module's slice.

    Every module that loses heads is checked (``prunable``) and its slice planned before the first one changes
    (``apply``): a mask the model cannot take leaves it as it was.
    """
    sites, grouped = sites_to_prune(model, heads)
    work = []
    for site in sites:
        if grouped.get(site.key):
            layout = prunable(site)
            work.append((site, layout, plan_slice(site.num_heads, site.head_dim, grouped[site.key],
                                                  layout.num_kv_heads)))
    for site, layout, plan in work:
        apply(model, site, layout, plan)
    slices = {site.key: plan for site, _, plan in work}
    record_pruned(model, slices)
    return slices


def record_pruned(model: nn.Module, slices: dict[SiteKey, HeadSlice]) -> None:
    """Record the removed heads in ``config.pruned_heads`` (original numbers), which ``save_pretrained`` writes:
    keyed by layer (``"3"``) for ``self`` attention, by ``"<attention>:<layer>"`` for the others (``enc_dec:3``)."""
    config = getattr(model, "config", None)
    if config is not None:
        setattr(config, PRUNED_HEADS_KEY, {(str(layer) if attention == "self" else f"{attention}:{layer}"):
                                           list(s.removed) for (attention, layer), s in sorted(slices.items())})


def pruned_heads_of(config) -> list[Head]:
    """The removed heads recorded in a transformers config (empty if it was never pruned)."""
    record = getattr(config, PRUNED_HEADS_KEY, None) or {}
    try:
        return sorted(Head(*(str(key).rpartition(":")[0] or "self", int(str(key).rpartition(":")[2])), int(h))
                      for key, hs in record.items() for h in hs)
    except (TypeError, ValueError, AttributeError):
        raise HeadsweepError(
            f"config.{PRUNED_HEADS_KEY} must map layer numbers to lists of heads, got {record!r}"
        ) from None


def save_pruned(model: nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """``save_pretrained`` a pruned transformers model (and its tokenizer); :func:`load_pruned` reads it back."""
    import inspect

    out = Path(out_dir)
    # A folder with pruned_heads is read by load_pruned, key for key: saved under the model's own parameter names,
    # not converted back to the original checkpoint layout (MoE experts unpacked, GPT-NeoX's embed_out), which only
    # from_pretrained's converters would undo.
    internal = bool(getattr(getattr(model, "config", None), PRUNED_HEADS_KEY, None)) and \
        "save_original_format" in inspect.signature(model.save_pretrained).parameters
    model.save_pretrained(out, **({"save_original_format": False} if internal else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def rebuild_pruned(model_dir: str | Path, attn_implementation: str | None,
                   prune: Pruner) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The architecture ``config.architectures`` names, built from ``model_dir``'s config with stock transformers,
    with the heads of ``config.pruned_heads`` removed by ``prune``; and the folder's saved weights (not loaded yet).
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
    return model, _renamed(model, state)


def _renamed(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the keys ``save_pretrained`` wrote under an architecture's original checkpoint names (GPT-NeoX's
    ``embed_out`` for ``lm_head``) renamed back as ``from_pretrained`` does: transformers' own key renamings for
    the model, applied to keys the model does not have."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):  # another transformers: keys as saved
        return state
    have = set(model.state_dict())
    out = {}
    for key, value in state.items():
        new = key
        for renaming in renamings if key not in have else ():
            new, _ = renaming.rename_source_key(new)
        out[new] = value
    return out


def load_pruned(model_dir: str | Path, prune: Pruner, attn_implementation: str | None = None, device: str = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """A model saved by :func:`save_pruned` (or any ``save_pretrained`` folder), in eval mode, pruned by ``prune``.

    In ``dtype``, or the saved weights' floating-point dtype. A folder without ``pruned_heads`` loads as the full
    model.
    """
    model_dir = Path(model_dir)
    model, state = rebuild_pruned(model_dir, attn_implementation, prune)
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    if dtype is not None or floating:
        model.to(dtype or floating[0])
    _load_strict(model, state, model_dir)
    return model.to(device).eval()


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], model_dir: Path) -> None:
    """``load_state_dict`` that refuses unexpected keys, wrong shapes and missing keys, except a missing key
    whose parameter is shared with a loaded one (tied input and output embeddings)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.state_dict(keep_vars=True).items():
        owners.setdefault(id(param), []).append(name)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that do not fit
        reason = str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:2]).strip()
        raise HeadsweepError(f"the weights in {model_dir} do not fit its pruned config: {reason}") from None
    tied = {n for names in owners.values() if any(m in state for m in names) for n in names}
    # Weights the architecture computes when it is built and save_pretrained never writes (Marian's sinusoidal
    # position tables).
    unsaved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    missing = [k for k in result.missing_keys if k not in tied and k not in unsaved]
    if result.unexpected_keys or missing:
        what = f"unexpected {result.unexpected_keys[:3]}" if result.unexpected_keys else f"missing {missing[:3]}"
        raise HeadsweepError(f"the weights in {model_dir} do not fit its pruned config: {what}")


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise HeadsweepError(f"no model.safetensors in {model_dir}")
    return [single]

