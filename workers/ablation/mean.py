"""``sweep.ablation: mean`` (Wang et al. 2022): a gated-off head takes its mean output over reference data.

Each worker computes the means once, on its first load (:func:`headsweep.workers.ablation.means.reference_means`:
deterministic, so a worker Ray restarts computes the same values), over ``ablation.reference`` (default: the
evaluation data), one per head or, with ``ablation.positions: per_position``, per absolute position. The driver
stores them in ``ablation_values`` and checks a resumed run's against them; export folds them into the output
projections' biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from headsweep.workers.ablation.means import MeanValues, describe_reference, reference_means
from headsweep.workers.ablation.method import AblationMethod, reference_setting


@dataclass(frozen=True)
class MeanSettings:
    """``ablation.reference``: the data whose head outputs give the means (a data section typed like ``data``; None:
    the evaluation data). ``ablation.positions``: ``all`` (one mean per head over every non-padding token) or
    ``per_position`` (one per absolute position; positions the reference never reaches take the pooled mean)."""

    reference: dict | None = reference_setting()
    positions: Literal["all", "per_position"] = "all"


class Mean(AblationMethod):
    name = "mean"
    fill = "constant"
    settings = MeanSettings
    reference = "optional"
    fold = "constants"

    def per_position(self, settings: MeanSettings) -> str | None:
        return "ablation.positions: per_position" if settings.positions == "per_position" else None

    def compute(self, worker: Any, spec: Any) -> MeanValues:
        # worker.adapter(None): the main adapter (a variant holds a screening subset, not the evaluation data)
        adapter = worker.adapter(spec.reference)
        return reference_means(adapter, spec, "ablation.reference data" if spec.reference is not None
                               else "evaluation data")

    def facts(self, spec: Any, means: MeanValues | None) -> dict[str, Any]:
        out = super().facts(spec, means)
        if means is not None:
            by_type: dict[str, int] = {}
            for (attention, _layer), n in means.tokens.items():
                by_type.setdefault(attention, n)
            out.update(reference=describe_reference(spec.reference),
                       positions="per_position" if spec.per_position else "all",
                       tokens=by_type, longest=means.positions,
                       precision=f"sums in float64, means in {means.dtype}", seconds=round(means.seconds, 3))
        return out


MEAN = Mean()
