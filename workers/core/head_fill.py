"""The gate arithmetic every ablation method shares: ``z'_h = xi_h z_h + (1 - xi_h) c_h`` per head slice.

:class:`HeadFill` holds ``c_h`` per attention site (what a method computed: :mod:`headsweep.workers.ablation`);
:func:`apply_gates` mixes it in. Both sit beside the gates (:mod:`headsweep.workers.core.gates`) because the gate hook
and prefix reuse (:func:`headsweep.workers.memory.replay.gated_projection`) call them: the methods build fills, the
core applies them, and the core never imports a method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headsweep.workers.core.heads import SiteKey

if TYPE_CHECKING:  # the driver imports the methods that build fills: torch stays out of its import time
    import torch


@dataclass
class HeadFill:
    """Per attention site, what a gated-off head's slice of the output projection's input becomes.

    ``values[site]`` has shape ``(H, d)`` (one vector per head), ``(P + 1, H, d)`` with ``per_position`` (row ``P``
    for positions from ``P`` on), or ``(B, T, H, d)`` with ``per_example`` (batch first, whatever the model's
    layout). A site without values is filled with zeros. ``keep_first``: position 0 is never changed.
    """

    values: dict[SiteKey, torch.Tensor] = field(default_factory=dict)
    per_position: bool = False
    per_example: bool = False
    keep_first: bool = False

    def __post_init__(self) -> None:
        if self.per_position and self.per_example:
            raise ValueError("a fill is per position or per example, not both")

    def at(self, key: SiteKey, heads: torch.Tensor, batch_dim: int) -> torch.Tensor | None:
        """The fill of site ``key`` shaped to broadcast against ``heads`` (the projection input viewed as
        ``(..., H, d)``), in its dtype and on its device; None for a site without values (zero)."""
        value = self.values.get(key)
        if value is None:
            return None
        value = value.to(device=heads.device, dtype=heads.dtype)
        if not (self.per_position or self.per_example):
            return value.view(*([1] * (heads.dim() - 2)), *value.shape)
        if heads.dim() != 4:
            raise ValueError(f"{key}: a fill per position or per example needs (batch, time, H, d) inputs, "
                             f"got {tuple(heads.shape)}")
        time_dim = 1 - batch_dim
        steps = heads.shape[time_dim]
        if self.per_position:
            import torch

            rows = torch.arange(steps, device=heads.device).clamp_(max=value.shape[0] - 1)
            return value.index_select(0, rows).unsqueeze(batch_dim)  # (1, T, H, d) or (T, 1, H, d)
        if value.shape[1] != steps:
            raise ValueError(f"{key}: per-example fill has {value.shape[1]} positions, the input {steps}")
        copies, rest = divmod(heads.shape[batch_dim], value.shape[0])
        if rest:
            raise ValueError(f"{key}: per-example fill has {value.shape[0]} rows, the input "
                             f"{heads.shape[batch_dim]} (not a multiple)")
        shaped = value if batch_dim == 0 else value.transpose(0, 1)
        # Mask-major packing (rows m*B .. m*B+B-1 carry mask m): the whole batch's fill once per mask.
        return shaped if copies == 1 else shaped.repeat(*[copies if d == batch_dim else 1 for d in range(4)])


def apply_gates(heads: torch.Tensor, gates: torch.Tensor, fill: torch.Tensor | None, keep_first: bool,
                batch_dim: int) -> torch.Tensor:
    """``heads * gates + (1 - gates) * fill`` (just ``heads * gates`` without a fill), position 0 kept as it was
    with ``keep_first``. ``gates`` broadcasts against ``heads`` ``(..., H, d)`` (a trailing axis of 1)."""
    out = heads * gates
    if fill is not None:
        out = out + (1 - gates) * fill
    if keep_first:
        if heads.dim() != 4:
            raise ValueError(f"ablation.keep_first needs (batch, time, H, d) inputs, got {tuple(heads.shape)}")
        first = [slice(None)] * 4
        first[1 - batch_dim] = slice(0, 1)
        import torch

        out = torch.cat([heads[tuple(first)], out.narrow(1 - batch_dim, 1, heads.shape[1 - batch_dim] - 1)],
                        dim=1 - batch_dim)
    return out
