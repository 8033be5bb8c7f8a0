"""The one place a worker installs the run's fill (``sweep.ablation``) on its adapters.

``EvalWorker`` calls :meth:`WorkerFill.install` on every adapter it loads (the main one, adapters on other data,
screening and checkpoint variants). What it installs is the method's to say
(:class:`~headsweep.workers.ablation.method.AblationMethod`): values the method computes on the worker (mean's
means) are computed once per worker, on first install, and set on every adapter the worker holds; otherwise the
method's ``worker_fill`` (zero's ``keep_first``, optimal's refusal until its constants come). Per-example methods
(resample, patch) are set per batch by the adapters (:mod:`headsweep.workers.ablation.donors`), not here. Constants
trained by the driver (optimal) are installed by :meth:`WorkerFill.set_constants`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from headsweep.workers.ablation.means import MeanValues, check_right_padded, site_name
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.head_fill import HeadFill

if TYPE_CHECKING:
    from headsweep.workers.core.family import EvalAdapter


class WorkerFill:
    """The run's fill in one worker (``EvalWorker``): computed once, installed on every adapter the worker holds."""

    def __init__(self, spec: AblationSpec):
        self.spec = spec
        self.means: MeanValues | None = None
        self._computing = False
        self._computed = False  # the method's compute() ran (once per worker)
        # Optimal ablation's constants, trained on the workers and installed by the driver (set_constants).
        self.constants: HeadFill | None = None

    @property
    def fill(self) -> HeadFill | None:
        if self.means is not None:
            return self.means.fill
        if self.constants is not None:
            return self.constants
        return method_of(self.spec).worker_fill(self.spec)

    def install(self, worker: Any, adapter: EvalAdapter, data: str = "evaluation data") -> None:
        """Give ``adapter`` (just loaded by ``worker``) the run's fill; the first call of a constant method computes
        it on the reference data (and installs it on every adapter ``worker.held_adapters()`` lists)."""
        if self._computing:  # the reference adapter, loaded while the means are taken: installed after
            return
        check_right_padded(adapter, self.spec, data)
        if self.means is None and not self._computed:
            self._computing = True
            try:
                self.means = method_of(self.spec).compute(worker, self.spec)
            finally:
                self._computing = False
            self._computed = True
            if self.means is not None:
                for held in worker.held_adapters():
                    held.gates.set_fill(self.means.fill)
        fill = self.fill
        if fill is not None:
            adapter.gates.set_fill(fill)

    def set_constants(self, worker: Any, values: dict[str, np.ndarray]) -> None:
        """Optimal ablation: ``values`` (``attention:layer`` -> ``(H, d)``) become the fill of every adapter
        ``worker`` holds, and of those it loads later."""
        fill = fill_of(self.spec, values)
        assert fill is not None
        for held in worker.held_adapters():
            held.gates.set_fill(HeadFill({k: v.to(held.device) for k, v in fill.values.items()},
                                         keep_first=fill.keep_first))
        self.constants = fill

    def facts(self) -> dict[str, Any]:
        """``runs.facts["ablation"]``: what the method records of itself, its settings and its values."""
        return method_of(self.spec).facts(self.spec, self.means)

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
