"""The one place a worker installs the run's fill (``sweep.ablation``) on its adapters.

``EvalWorker`` calls :meth:`WorkerFill.install` on every adapter it loads (the main one, adapters on other data,
screening and checkpoint variants). Constant fills (mean) are computed once per worker, on first install, and set
on every adapter the worker holds; ``zero`` with ``keep_first`` gets an empty fill that only keeps position 0;
per-example methods (resample, patch) are set per batch by the adapters (:mod:`headsweep.workers.ablation.donors`), not
here. Optimal ablation's constants are trained on the workers (:mod:`headsweep.workers.ablation.optimal`) and
installed by the driver (:meth:`WorkerFill.set_constants`); until then a gated-off head refuses to run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from headsweep.workers.ablation.means import MeanValues, check_right_padded, reference_means, site_name
from headsweep.workers.ablation.optimal import PATIENCE, TOLERANCE, UntrainedFill
from headsweep.workers.ablation.spec import AblationSpec, HeadFill

if TYPE_CHECKING:
    from headsweep.workers.core.family import EvalAdapter


def describe_reference(reference: Any) -> Any:
    """What ``runs.facts`` says of the reference: the evaluation data, or the section's set fields."""
    if reference is None:
        return "evaluation data (data)"
    if dataclasses.is_dataclass(reference):
        return {k: v for k, v in dataclasses.asdict(reference).items() if v is not None}
    return reference


class WorkerFill:
    """The run's fill in one worker (``EvalWorker``): computed once, installed on every adapter the worker holds."""

    def __init__(self, spec: AblationSpec):
        self.spec = spec
        self.means: MeanValues | None = None
        self._computing = False
        # Optimal ablation's constants, trained on the workers and installed by the driver (set_constants).
        self.constants: HeadFill | None = None

    @property
    def fill(self) -> HeadFill | None:
        if self.means is not None:
            return self.means.fill
        if self.spec.method == "optimal":
            return self.constants if self.constants is not None else UntrainedFill(keep_first=self.spec.keep_first)
        if self.spec.method == "zero" and self.spec.keep_first:
            return HeadFill(keep_first=True)  # no values: zero, position 0 kept
        return None

    def install(self, worker: Any, adapter: EvalAdapter, data: str = "evaluation data") -> None:
        """Give ``adapter`` (just loaded by ``worker``) the run's fill; the first call of a constant method computes
        it on the reference data (and installs it on every adapter ``worker.held_adapters()`` lists)."""
        if self._computing:  # the reference adapter, loaded while the means are taken: installed after
            return
        check_right_padded(adapter, self.spec, data)
        if self.spec.method == "mean" and self.means is None:
            self._computing = True
            try:
                # adapter(None): the main adapter (a variant holds a screening subset, not the evaluation data)
                reference = worker.adapter(self.spec.reference)
                self.means = reference_means(reference, self.spec, "ablation.reference data"
                                             if self.spec.reference is not None else "evaluation data")
            finally:
                self._computing = False
            for held in worker.held_adapters():
                held.gates.set_fill(self.means.fill)
        fill = self.fill
        if fill is not None:
            adapter.gates.set_fill(fill)

    def set_constants(self, worker: Any, values: dict[str, np.ndarray]) -> None:
        """Optimal ablation: ``values`` (``attention:layer`` -> ``(H, d)``) become the fill of every adapter
        ``worker`` holds, and of those it loads later."""
        fill = fill_of(self.spec, values)
        for held in worker.held_adapters():
            held.gates.set_fill(HeadFill({k: v.to(held.device) for k, v in fill.values.items()},
                                         keep_first=fill.keep_first))
        self.constants = fill

    def facts(self) -> dict[str, Any]:
        """``runs.facts["ablation"]``: the method, its settings, and for mean the reference and what was counted."""
        spec = self.spec
        if spec.method == "zero" and not spec.keep_first:
            return {}
        out: dict[str, Any] = {"method": spec.method, "keep_first": spec.keep_first}
        if spec.method == "resample":  # headsweep.workers.ablation.donors
            out.update(seed=spec.seed, resamples=spec.resamples,
                       donors="a seeded derangement among examples of the same token length, per draw")
        if spec.method == "patch":
            out.update(direction=spec.direction)
        if spec.method == "optimal":  # headsweep.workers.ablation.optimal
            out.update(reference=describe_reference(spec.reference), start="the head's mean over the reference",
                       optimiser=f"Adam lr={spec.lr:g}, full-batch gradients over the reference",
                       steps=spec.steps, seed=spec.seed,
                       stopping=f"at most {spec.steps} updates, or the best loss improved by less than a relative "
                                f"{TOLERANCE:g} over {PATIENCE} steps; the best constant seen kept",
                       masks="each removed head replaced by its own single-head constant (not trained per mask)")
        if self.means is not None:
            means = self.means
            by_type: dict[str, int] = {}
            for (attention, _layer), n in means.tokens.items():
                by_type.setdefault(attention, n)
            out.update(reference=describe_reference(spec.reference),
                       positions="per_position" if spec.per_position else "all",
                       tokens=by_type, longest=means.positions,
                       precision=f"sums in float64, means in {means.dtype}", seconds=round(means.seconds, 3))
        return out

    def values(self) -> dict[str, np.ndarray]:
        """The constant fill as numpy arrays by ``attention:layer`` (empty for methods without one)."""
        fill = self.means.fill if self.means is not None else self.constants
        if fill is None:
            return {}
        return {site_name(k): v.detach().cpu().numpy() for k, v in fill.values.items()}

    def tokens(self) -> dict[str, int]:
        """Real tokens counted per site, by ``attention:layer`` (empty without means)."""
        return {} if self.means is None else {site_name(k): n for k, n in self.means.tokens.items()}


def fill_of(spec: AblationSpec, values: dict[str, np.ndarray]) -> HeadFill | None:
    """The run's constant fill from ``values`` (``attention:layer`` -> array, as :meth:`WorkerFill.values` gives and
    the store keeps them), for a process that is not one of the run's workers (an L0 Tune trial); None where the
    method leaves nothing behind but zero (or sets its fill per batch)."""
    import torch

    if values:
        sites = {(name.rsplit(":", 1)[0], int(name.rsplit(":", 1)[1])): torch.from_numpy(np.asarray(array))
                 for name, array in values.items()}
        return HeadFill(sites, per_position=spec.per_position, keep_first=spec.keep_first)
    return WorkerFill(spec).fill


def fill_values_on_worker(worker: Any) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Worker-side step (``EvalWorker.run``): the worker's constant fill and the tokens each site's mean counted."""
    return worker.fill_values(), worker.fill_tokens()
