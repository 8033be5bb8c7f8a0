"""The driver's side of constants trained on the workers (``sweep.ablation: optimal``, a method whose ``trained`` is
set): train them, store them, install them on every worker.

* **where**: on the workers the run already has, through the pool's stream (``WorkerPool.stream``, each call
  :func:`headsweep.workers.ablation.optimal.train_units` on a slice of heads of about
  ``heads / (CHUNKS_PER_WORKER x workers)``), so the workers share the slices out as each finishes one and a slice
  whose worker is lost runs again elsewhere, with the retries and restarts every evaluation gets. Not Tune trials: a
  constant trains in seconds to minutes, with nothing to checkpoint between its steps.
* **stored** in ``ablation_values`` exactly as mean ablation's means (one row per head, the vectors file), before
  the run's first row; a resumed run reads them back (:func:`stored_values`) and installs them without training
  again, and L0 Tune trials apply them from the store as they do mean's.
* **installed** on every live worker (:func:`headsweep.workers.ablation.optimal.install_on_worker`), and again on a
  worker Ray restarts (``WorkerPool.on_restart``); until then a worker's gated-off heads refuse to run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray

from headsweep.results.store import ResultStore
from headsweep.sweep.ablation.values import StoredFill, stored_values
from headsweep.sweep.cluster.dispatch import WorkerPool, log
from headsweep.workers.ablation.optimal import heads_on_worker, install_on_worker, train_units
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit

CHUNKS_PER_WORKER = 4


def _stored_constants(store: ResultStore, run_id: str, checkpoint: str | None, method: str
                      ) -> dict[str, np.ndarray]:
    """The constants this run stored for this model under ``method`` (empty if none: a new run, or another
    method's)."""
    rows = [r for r in store.read("ablation_values", run_id).to_pylist() if r["checkpoint"] == checkpoint]
    if not rows or any(r["method"] != method for r in rows):
        return {}
    return stored_values(store, run_id, checkpoint)


def _send(actor: Any, batch: list[WorkUnit]) -> Any:
    return actor.run.remote(train_units, batch)


def train(pool: WorkerPool, heads: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Every head's constant, slices of heads streamed over the live workers (a lost worker's slice retried by
    the pool, as evaluations are)."""
    units = [WorkUnit(str(Head(*h)), "ablation", (Head(*h),)) for h in heads]
    size = max(1, -(-len(heads) // (CHUNKS_PER_WORKER * len(pool.live()))))
    out: dict[str, Any] = {"constants": {}, "tokens": {}, "log": []}
    for unit, part, _worker in pool.stream(units, size, send=_send):
        head = unit.masked[0]
        out["constants"][(head.attention, head.layer, head.head)] = part["constant"]
        out["tokens"].update(part["tokens"])
        out["log"].append(part["log"])
    return out


def install(pool: WorkerPool, values: dict[str, np.ndarray]) -> None:
    """The constants on every live worker, and on any worker Ray restarts later."""
    ref = ray.put(values)
    ray.get([pool.actors[i].run.remote(install_on_worker, ref) for i in pool.live()])
    pool.on_restart = lambda actor: ray.get(actor.run.remote(install_on_worker, ref))


def trained_fill(spec: AblationSpec, pool: WorkerPool, store: ResultStore, run_id: str, checkpoint: str | None
                 ) -> StoredFill:
    """This model's trained constants (stored ones on a resumed run, else trained now), installed on the workers."""
    values = _stored_constants(store, run_id, checkpoint, spec.method)
    tokens: dict[str, int] = {}
    if values:
        count = sum(v.shape[0] for v in values.values())
        log(f"{spec.method} ablation: the constants run {run_id} stored ({count} heads) are reused, not trained again")
    else:
        heads = pool.call(heads_on_worker)
        start = time.perf_counter()
        log(f"{spec.method} ablation: training {len(heads)} head constants on {len(pool.live())} workers "
            f"({method_of(spec).training_summary(spec)})")
        trained = train(pool, heads)
        by_site: dict[str, dict[int, np.ndarray]] = {}
        for (attention, layer, head), constant in trained["constants"].items():
            by_site.setdefault(f"{attention}:{layer}", {})[head] = constant
        values = {name: np.stack([found[h] for h in sorted(found)]) for name, found in by_site.items()}
        tokens = trained["tokens"]
        records = trained["log"]
        gain = float(np.mean([r["loss_mean"] - r["loss_optimal"] for r in records]))
        log(f"{spec.method} ablation: {len(records)} constants trained in {time.perf_counter() - start:.1f}s "
            f"({sum(r['updates'] for r in records)} updates; reference loss below the mean's by {gain:.4g} per head "
            "on average)")
    install(pool, values)
    return StoredFill(store, run_id, checkpoint, spec.method, False, values, tokens)
