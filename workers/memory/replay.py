"""Replaying a model from cached baseline states: the tools every family's reuse is built from.

An exact ablation of heads in layer l changes nothing before their output projection: the
inputs of layers 0..l and layer l's per-head contexts are the baseline's. So a masked forward
pass can run the model's *own* forward with

* the layers before l replaced by "return the cached state" (:func:`replaced_forwards`), and
* layer l's attention output given directly from its cached contexts: the baseline projection
  minus the masked heads' projected contexts (:func:`gated_projection`), with no
  query/key/value or attention-score work.

Replacing ``forward`` on the module instance (not on its class) for the duration of one call
keeps every other part of the model (masks, residuals, layer norms, pooling, heads) the
model's own code, so each family needs to name only where its layers and attention cores are.
The baseline states themselves are kept between calls in a :class:`BaselineCache` (a strategy built on
:class:`RecordedBaselines` records them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from headsweep.workers.core.gates import AttentionSite, gate_rows
from headsweep.workers.core.head_fill import HeadFill, apply_gates
from headsweep.workers.core.heads import Head, HeadInventory


class ReuseUnsupported(Exception):
    """A model's layout is not one that reuse knows; the message says why (the plain path runs instead)."""


class States(Protocol):
    """Baseline states of one evaluation batch: anything that knows its size in bytes."""

    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=States)


class BaselineCache(Generic[S]):
    """Baseline states per evaluation batch, kept between calls while they fit a byte budget.

    States that do not fit are recorded again on every call instead (see
    :func:`headsweep.workers.memory.batch_budget.cache_budget` for the budget).
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.kept_bytes = 0
        self._kept: dict[Hashable, S] = {}

    def get(self, key: Hashable, record: Callable[[], S]) -> S:
        """The states kept under ``key``, or ``record()`` now (kept if they fit the budget)."""
        if key in self._kept:
            return self._kept[key]
        states = record()
        if self.kept_bytes + states.nbytes <= self.budget_bytes:
            self._kept[key] = states
            self.kept_bytes += states.nbytes
        return states


class RecordedBaselines(Generic[S]):
    """A reuse strategy's baseline states per evaluation batch, kept in a :class:`BaselineCache`; the subclass
    records one batch's states (``record``, called with what ``states`` is given after the key)."""

    def __init__(self, budget_bytes: int):
        self.cache: BaselineCache[S] = BaselineCache(budget_bytes)

    @property
    def kept_bytes(self) -> int:
        return self.cache.kept_bytes

    def states(self, key: Hashable, *inputs: Any) -> S:
        """Baseline states of batch ``key``: kept from an earlier call, or recorded now (and kept if they fit)."""
        return self.cache.get(key, lambda: self.record(*inputs))

    def record(self, *inputs: Any) -> S:
        """Run the ungated model once on a batch, keeping what masked passes start from."""
        raise NotImplementedError


def first_gated_layer(mask: Sequence[Head]) -> int | None:
    """The lowest layer with a masked head (None for the empty mask): where a masked pass starts."""
    return min((h.layer for h in mask), default=None)


def by_first_gated_layer(masks: Sequence[Sequence[Head]], inventory: HeadInventory) -> dict[int | None, list[int]]:
    """The positions of ``masks`` grouped by their first gated layer (None: the empty mask), each head checked
    against ``inventory`` first: a head the model lacks is the caller's error, not a reason to stop reusing."""
    groups: dict[int | None, list[int]] = {}
    for i, mask in enumerate(masks):
        for head in mask:
            inventory.check(head)
        groups.setdefault(first_gated_layer(mask), []).append(i)
    return groups


def _enclosing_layer(modules: dict[str, nn.Module], name: str) -> tuple[str, int]:
    """The name of the ``nn.ModuleList`` element that contains module ``name``, and its index."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[: i - 1]) if i > 1 else ""
        if parts[i - 1].isdigit() and isinstance(modules.get(parent), nn.ModuleList):
            return parent, int(parts[i - 1])
    raise ReuseUnsupported(f"{name} is not inside a layer list (nn.ModuleList)")


def layer_stack(model: nn.Module, sites: Sequence[AttentionSite]) -> tuple[nn.ModuleList, list[int]]:
    """The one layer list (``nn.ModuleList``) holding every attention site, and each site's index in it; or
    :class:`ReuseUnsupported` when the sites sit in several lists or outside any."""
    modules = dict(model.named_modules())
    found = [_enclosing_layer(modules, s.module_name) for s in sites]
    lists = {parent for parent, _ in found}
    if len(lists) != 1:
        raise ReuseUnsupported(f"attention modules sit in {len(lists)} layer lists, not one stack")
    return modules[lists.pop()], [index for _, index in found]


@contextmanager
def replaced_forwards(replacements: dict[nn.Module, Callable]) -> Iterator[None]:
    """Inside the block, calling each module runs its replacement instead of its ``forward``.

    Module hooks still run around the replacement (``nn.Module.__call__`` looks ``forward`` up
    on the instance first). Forwards already set on an instance are restored afterwards.
    """
    missing = object()
    saved = {m: m.__dict__.get("forward", missing) for m in replacements}
    try:
        for module, fn in replacements.items():
            module.forward = fn
        yield
    finally:
        for module, old in saved.items():
            if old is missing:
                module.__dict__.pop("forward", None)
            else:
                module.forward = old


def pass_through(x, *args, **kwargs):
    """A replacement forward that returns its first argument unchanged (a skipped layer)."""
    return x


def returning(value) -> Callable:
    """A replacement forward that ignores its inputs and returns ``value``."""

    def forward(*args, **kwargs):
        return value

    return forward


def gated_projection(ctx: torch.Tensor, out_proj: nn.Linear, num_heads: int,
                     masked: Sequence[Sequence[int]], batch_dim: int, fill: HeadFill | None = None,
                     site: tuple[str, int] | None = None) -> torch.Tensor:
    """``out_proj`` of ``ctx`` with the heads ``masked[m]`` gated off, for every m, concatenated along ``batch_dim``.

    ``ctx`` is the baseline input of the output projection (per-head contexts side by side).
    The output is ``W_O concat_h(xi_h ctx_h) + b_O``, i.e. the baseline projection minus the
    masked heads' projected contexts, computed as the gate hook computes it (gate, then one
    ``F.linear`` over all masks' rows), so a mask's attention output is the same floating-point
    result as on the plain path. ``F.linear`` rather than ``out_proj(...)``: no hook sees it. With a ``fill``
    (the gates' :class:`~headsweep.workers.core.head_fill.HeadFill`, ``site`` its key), gated-off heads take its values,
    mixed in by the gate hook's own :func:`~headsweep.workers.core.head_fill.apply_gates`.
    """
    k = len(masked)
    gates = gate_rows(masked, num_heads, ctx.device, ctx.dtype)
    reps = [1] * ctx.dim()
    reps[batch_dim] = k
    stacked = ctx.repeat(*reps)
    heads = stacked.reshape(*stacked.shape[:-1], num_heads, stacked.shape[-1] // num_heads)
    view = [1] * (heads.dim() - 2) + [num_heads, 1]
    view[batch_dim] = stacked.shape[batch_dim]
    rows = gates.repeat_interleave(ctx.shape[batch_dim], dim=0).view(view)
    if fill is None:
        gated = heads * rows
    else:
        if site is None:
            raise ValueError("gated_projection with a fill needs the site's key")
        gated = apply_gates(heads, rows, fill.at(site, heads, batch_dim), fill.keep_first, batch_dim)
    return F.linear(gated.reshape(stacked.shape), out_proj.weight, out_proj.bias)
