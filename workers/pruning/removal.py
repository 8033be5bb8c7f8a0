"""Physical head pruning, the family-independent part: remove heads' weights instead of gating them.

Masking a head saves no compute; removing its rows of W_Q, W_K, W_V and its columns of W_O
does. The pruned model computes exactly what the gated model computes (the gate at the output
projection's input is the only place a head meets the rest of the model), with fewer
parameters and less work. A layer may lose every head: its attention then adds only the
output projection's bias.

Which rows and columns go is :mod:`headsweep.workers.core.head_slicing`; where they live in a
module is each family's business (``ModelFamily.prune``: ``hf_classifier.pruning`` for BERT-family and
DistilBERT encoders, ``hf_causal_lm.model.pruning`` for decoder-only LMs, ``fairseq_translation.pruning`` for
fairseq encoder-decoders, under ``headsweep.workers.families``). :func:`prune_heads` takes a bare model and
asks the built-in families which one it is (:func:`headsweep.workers.families.registry.family_of_model`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

from torch import nn

from headsweep.workers.core.family import ModelFamily
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.head_slicing import HeadSlice
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.registry import family_of_model


def prune_heads(model: nn.Module, heads: Iterable[Head], family: ModelFamily | None = None) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` from ``model`` in place; returns each pruned module's slice.

    ``family`` defaults to the built-in family whose attention modules ``model`` has (transformers
    encoders and decoders, fairseq encoder-decoder Transformers). Heads are named as in the
    results tables (``self:0:3``, ``enc_dec:1:2``); the pruned model numbers each layer's kept heads
    from 0 again, in their old order.
    """
    family = family or family_of_model(model)
    return family.prune(model, list(heads))


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


# A module's own settings (flags, sizes, names), as restore_stock may change them.
PLAIN_SETTINGS = (bool, int, float, str)


@contextlib.contextmanager
def as_stock(model: nn.Module, gates: HeadGates) -> Iterator[nn.Module]:
    """The gated ``model`` itself, run as the stock library runs it while active: its gate hooks off and what
    gating changed besides them undone (:meth:`HeadGates.restore_stock`); hooks and settings put back after.

    What :func:`ungated_copy` gives without a second copy of the weights (the efficiency experiment's full model:
    on Llama-3.2-1B's shape each copy is 4.6 GiB)."""
    saved = []
    for site in gates.sites:
        proj, module = site.out_proj, site.module
        hooks = (proj._forward_pre_hooks, proj._forward_pre_hooks_with_kwargs)
        settings = {k: v for k, v in vars(module).items() if isinstance(v, (*PLAIN_SETTINGS, type(None)))}
        saved.append((hooks, [dict(h) for h in hooks], module, settings))
        for handle in site.hook_handles:
            for h in hooks:
                h.pop(handle.id, None)
        gates.restore_stock(site, module)
    try:
        yield model
    finally:
        for hooks, before, module, settings in saved:
            for h, items in zip(hooks, before, strict=True):
                h.clear()
                h.update(items)
            for key, value in settings.items():
                setattr(module, key, value)
            added = [k for k, v in vars(module).items() if k not in settings and isinstance(v, PLAIN_SETTINGS)]
            for key in added:  # a setting restore_stock added
                delattr(module, key)


def ungated_copy(model: nn.Module, gates: HeadGates) -> nn.Module:
    """A deep copy of a gated model with the gates' hooks taken off: what the stock library runs.

    Whatever else gating changed is undone on the copy by the gates themselves
    (:meth:`HeadGates.restore_stock`: fairseq modules get their fused attention path back wherever
    their shapes allow it).
    """
    clone = copy.deepcopy(model)
    names = {id(m): n for n, m in model.named_modules()}
    for site in gates.sites:
        proj = clone.get_submodule(names[id(site.out_proj)])
        for handle in site.hook_handles:
            proj._forward_pre_hooks.pop(handle.id, None)
            proj._forward_pre_hooks_with_kwargs.pop(handle.id, None)
        gates.restore_stock(site, clone.get_submodule(names[id(site.module)]))
    return clone
