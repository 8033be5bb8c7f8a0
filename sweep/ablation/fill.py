"""The run's constant fill for each model the driver sweeps: values the workers compute (mean's means) fetched from
one of them, or constants trained on them (optimal's); checked against what the run stored, and stored
(``ablation_values``). Which one is the method's declaration (``fill``, ``trained``), never its name.
"""

from __future__ import annotations

from headsweep.results.store import ResultStore
from headsweep.sweep.ablation.training import trained_fill
from headsweep.sweep.ablation.values import StoredFill, ablation_spec
from headsweep.sweep.cluster.dispatch import WorkerPool
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.ablation.worker_fill import fill_values_on_worker


def fetch_fill(cfg: Config, pool: WorkerPool, store: ResultStore, run_id: str, checkpoint: str | None
               ) -> StoredFill | None:
    """The constant fill the workers computed for this model (one worker asked: all compute the same), checked
    against what the run stored for it; trained constants trained (or read back on resume) and installed
    (:mod:`headsweep.sweep.ablation.training`); None for a method without constants (zero, resample, patch)."""
    spec = ablation_spec(cfg)
    method = method_of(spec)
    if method.fill != "constant":
        return None
    if method.trained:
        return trained_fill(spec, pool, store, run_id, checkpoint)
    values, tokens = pool.call(fill_values_on_worker)
    fill = StoredFill(store, run_id, checkpoint, spec.method, spec.per_position, values, tokens)
    fill.check()
    return fill
