"""What a gated-off head leaves behind: the one object every gate of a run reads (``sweep.ablation``).

A head gate ``xi_h`` acts on the head's slice ``z_h`` of the output projection's input (TransformerLens's
``hook_z``, pyvene's ``head_attention_value_output``). Zero ablation is ``xi_h z_h``. Every other method replaces
the slice by a value ``c_h`` the model does see in training:

    z'_h = xi_h z_h + (1 - xi_h) c_h

so ``xi_h = 1`` leaves the head as it is (bit for bit: ``z + 0 c = z``), ``xi_h = 0`` puts ``c_h`` in its place, and
``dL/dxi_h = dL/dz'_h . (z_h - c_h)``: gradient importance under a fill is attribution patching of that ablation.
What ``c_h`` is depends on the method:

* ``zero``: no fill (the gate alone, the path every earlier run took: nothing here runs);
* ``mean`` / ``optimal``: one vector per head (``(H, d)`` per attention site), or with ``per_position`` one per
  absolute position (``(P + 1, H, d)``: rows ``0..P-1`` for the reference's positions ``0..P-1``, row ``P``, the
  mean over all of its positions, for positions it never reaches: the pooled value, as the optimal-ablation code
  uses);
* ``resample`` / ``patch``: one value per example and token (``(B, T, H, d)`` batch first), the head's output on a
  donor (or the corrupted) input, set per batch by the adapter; a pass that carries ``k`` masks (examples
  repeated mask-major) repeats it ``k`` times.

``keep_first`` leaves the first position of every sequence untouched whatever the gate (decoder-only models' BOS
attention sink). The gate hook (:class:`headsweep.workers.core.gates.HeadGates`) and prefix reuse's
:func:`headsweep.workers.memory.replay.gated_projection` both call :func:`apply_gates`, so a mask's value is the same
floating-point result on both paths, for every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from headsweep.workers.core.heads import SiteKey

if TYPE_CHECKING:  # the driver reads AblationSpec: torch stays out of its import time
    import torch


@dataclass(frozen=True)
class AblationSpec:
    """The run's ablation as a worker reads it (``RuntimeOptions.ablation``, built by the driver from
    ``sweep.ablation`` and the ``ablation`` section).

    ``reference``: the data section (typed as the family's ``data``) the means are taken over or the constants
    trained on; None: the evaluation data. ``per_position``: a constant fill holds one value per absolute position
    (what the method's settings ask: ``AblationMethod.per_position``). ``keep_first``: position 0 is never replaced
    (and not counted in the means). ``settings``: the method's own settings object (its ``settings`` dataclass, read
    with ``AblationMethod.settings_in``; None: its defaults). The default, ``zero``, changes nothing.
    """

    method: str = "zero"
    reference: Any = None
    per_position: bool = False
    keep_first: bool = False
    settings: Any = None


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
