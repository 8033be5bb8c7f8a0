"""Independent routes to what a gated-off head leaves behind, with no headsweep gate or fill code.

* :func:`folded_fill`: weight surgery. Head ``h`` of a projection ``y = W_O x + b`` contributes
  ``W_O[:, h] x_h``; replacing ``x_h`` by a constant ``c_h`` is the same linear map as zeroing the head's input
  columns of ``W_O`` and adding ``W_O[:, h] c_h`` to the bias. No hooks: the stock module runs on changed weights
  (what ``headsweep export`` does to a mean- or optimally-ablated head).
* :func:`substituted`: a forward pre-hook on the output projection that writes recorded values over a head's slice
  of its input, position by position in a plain loop (TransformerLens' ``hook_z`` patching).

Both work on ``nn.Linear`` (weight ``(out, in)``) and on GPT-2's ``Conv1D`` (weight ``(in, out)``, bias always
present), on batch-first ``(B, T, E)`` and time-first ``(T, B, E)`` inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


def head_columns(out_proj: nn.Module, head: int, head_dim: int) -> tuple[slice, slice]:
    """The index of a head's input features in the projection's weight: columns of ``nn.Linear``'s ``(out, in)``,
    rows of a ``Conv1D``'s ``(in, out)``."""
    span = slice(head * head_dim, (head + 1) * head_dim)
    return (slice(None), span) if isinstance(out_proj, nn.Linear) else (span, slice(None))


def projected(out_proj: nn.Module, head: int, head_dim: int, value: torch.Tensor) -> torch.Tensor:
    """``W_O[:, h] @ value`` in float64 (the head's contribution to the projection's output)."""
    weight = out_proj.weight[head_columns(out_proj, head, head_dim)].double()
    return weight @ value.double() if isinstance(out_proj, nn.Linear) else value.double() @ weight


@contextmanager
def folded_fill(out_proj: nn.Module, head_dim: int, fills: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, each head ``h`` of ``fills`` has its input columns of ``out_proj`` zeroed and
    ``W_O[:, h] @ fills[h]`` added to the bias (a zero bias created where the projection has none, as Llama's and
    Qwen2's ``o_proj``); weights and bias put back after.

    The fold is summed in float64 and rounded once to the weights' dtype, so the surgery adds one rounding of the
    exact bias to the projection's own.
    """
    weight = out_proj.weight
    saved_weight = weight.detach().clone()
    had_bias = out_proj.bias is not None
    saved_bias = out_proj.bias.detach().clone() if had_bias else None
    with torch.no_grad():
        bias = saved_bias.double() if had_bias else weight.new_zeros(weight.shape[0 if isinstance(
            out_proj, nn.Linear) else 1], dtype=torch.float64)
        for head, value in fills.items():
            bias = bias + projected(out_proj, head, head_dim, value)
        for head in fills:
            weight[head_columns(out_proj, head, head_dim)] = 0.0
        if had_bias:
            out_proj.bias.copy_(bias.to(weight.dtype))
        else:
            out_proj.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved_weight)
            if had_bias:
                out_proj.bias.copy_(saved_bias)
            else:
                out_proj.bias = None


@dataclass(frozen=True)
class Substitution:
    """What one head's slice becomes: ``value`` of shape ``(d,)`` (every position), ``(P + 1, d)`` (position ``t``
    takes row ``min(t, P)``) or ``(B, T, d)`` (batch first: example ``b`` at position ``t`` takes ``value[b, t]``);
    ``keep_first``: position 0 keeps the model's own value."""

    head: int
    value: torch.Tensor
    keep_first: bool = False

    def at(self, example: int, position: int, rows: int) -> torch.Tensor:
        """The value of example ``example`` (of ``rows`` in the pass) at ``position``."""
        v = self.value
        if v.dim() == 1:
            return v
        if v.dim() == 2:
            return v[min(position, v.shape[0] - 1)]
        # A pass carrying k copies of the batch (mask-major) gives copy m's example b the row m*B + b.
        assert rows % v.shape[0] == 0, (rows, v.shape)
        return v[example % v.shape[0], position]


@contextmanager
def substituted(out_proj: nn.Module, head_dim: int, batch_dim: int, subs: list[Substitution]
                ) -> Iterator[list[int]]:
    """Inside the block, a forward pre-hook on ``out_proj`` writes each substitution over its head's slice of the
    input, one (example, position) at a time. Yields the list of calls' input shapes (a route that never ran
    shows an empty list)."""
    calls: list[tuple[int, ...]] = []
    time_dim = 1 - batch_dim

    def hook(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        calls.append(tuple(x.shape))
        out = x.clone(memory_format=torch.contiguous_format)
        rows, steps = x.shape[batch_dim], x.shape[time_dim]
        for sub in subs:
            span = slice(sub.head * head_dim, (sub.head + 1) * head_dim)
            for b in range(rows):
                for t in range(1 if sub.keep_first else 0, steps):
                    index = (b, t, span) if batch_dim == 0 else (t, b, span)
                    out[index] = sub.at(b, t, rows).to(out.dtype)
        return (out, *args[1:])

    handle = out_proj.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()
