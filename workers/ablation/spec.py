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
:func:`headsweep.workers.memory.replay.gated_projection` both call
:func:`headsweep.workers.core.head_fill.apply_gates`, so a mask's value is the same
floating-point result on both paths, for every method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
