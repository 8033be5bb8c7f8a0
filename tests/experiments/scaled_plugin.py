"""The toy plugin of tests/experiments/test_ablation_plugin.py: ablation method "scaled", a gated-off head's output
times ``ablation.factor`` (a setting of its own), as a package outside headsweep defines one and installs it as a
``headsweep.ablations`` entry point (``scaled = "scaled_plugin:SCALED"``).

Its own module, importing neither torch nor the tests' helpers: the CLI imports it when a config names the method,
and a config it refuses costs no more than a built-in method's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.head_fill import HeadFill
from headsweep.workers.core.heads import SiteKey
from headsweep.workers.core.setting_ranges import ranged

if TYPE_CHECKING:
    import torch

DEFAULT_FACTOR = 0.5


@dataclass(frozen=True)
class ScaledSettings:
    """``ablation.factor``: what share of its output a gated-off head keeps (1 would keep all of it)."""

    factor: float = ranged(DEFAULT_FACTOR, at_least=0, below=1)


@dataclass
class ScaledFill(HeadFill):
    """``c_h = factor * z_h``: the fill is the head's own output, scaled (by a power of two in the test: exact in
    floating point)."""

    factor: float = DEFAULT_FACTOR

    def at(self, key: SiteKey, heads: torch.Tensor, batch_dim: int) -> torch.Tensor | None:
        return heads * self.factor


class Scaled(AblationMethod):
    name = "scaled"
    settings = ScaledSettings
    fold_refusal = "the fill is a share of each input's own output"

    def worker_fill(self, spec: AblationSpec) -> HeadFill | None:
        settings: ScaledSettings = self.settings_in(spec)
        return ScaledFill(keep_first=spec.keep_first, factor=settings.factor)


SCALED = Scaled()
