"""``baseline``: the unmasked model, the reference of every other evaluation (always evaluated, first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context

UNIT = WorkUnit("baseline", "baseline", ())


class Baseline(Experiment):
    """Evaluates no mask, first in the first pass: its score is every row's ``baseline_score``
    and its per-example statistics the baseline of every significance test."""

    name = "baseline"
    reference = True

    def run(self, ctx: Context) -> None:
        ctx.evaluate_reference(UNIT)


BASELINE = Baseline()
