"""The run's constant fill for each model the driver sweeps (mean's means, optimal's constants): fetched from the
workers or trained on them, checked against what the run stored, and stored (``ablation_values``).
"""

from __future__ import annotations

from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.run.ablation_values import StoredFill, ablation_spec
from headsweep.sweep.run.dispatch import WorkerPool
from headsweep.sweep.run.optimal_ablation import optimal_fill
from headsweep.workers.ablation.worker_fill import fill_values_on_worker


def fetch_fill(cfg: Config, pool: WorkerPool, store: ResultStore, run_id: str, checkpoint: str | None
               ) -> StoredFill | None:
    """The constant fill the workers computed for this model (one worker asked: all compute the same), checked
    against what the run stored for it; optimal's constants trained (or read back on resume) and installed
    (:mod:`headsweep.sweep.run.optimal_ablation`); None for a method without one (zero, resample, patch)."""
    spec = ablation_spec(cfg)
    if not spec.constant:
        return None
    if spec.method == "optimal":
        return optimal_fill(spec, pool, store, run_id, checkpoint)
    values, tokens = pool.call(fill_values_on_worker)
    fill = StoredFill(store, run_id, checkpoint, spec.method, spec.per_position, values, tokens)
    fill.check()
    return fill
