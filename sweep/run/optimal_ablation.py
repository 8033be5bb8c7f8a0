"""The driver's side of optimal ablation (``sweep.ablation: optimal``): train the constants on the workers, store
them, install them on every worker.

* **where**: on the workers the run already has (``EvalWorker.run`` with
  :func:`headsweep.workers.ablation.optimal.train_on_worker`), the heads cut into slices of about
  ``heads / (CHUNKS_PER_WORKER x workers)`` so that the workers share them out as each finishes one; a slice whose
  worker is lost runs again through ``WorkerPool.call`` (Ray restarts the worker, the pool's retries). Not Tune
  trials: a constant trains in seconds to minutes, with nothing to checkpoint between its steps.
* **stored** in ``ablation_values`` exactly as mean ablation's means (method ``optimal``, one row per head, the
  vectors file), before the run's first row; a resumed run reads them back (:func:`stored_values`) and installs them
  without training again, and L0 Tune trials apply them from the store as they do mean's.
* **installed** on every live worker (:func:`headsweep.workers.ablation.optimal.install_on_worker`), and again on a
  worker Ray restarts (``WorkerPool.on_restart``); until then a worker's gated-off heads refuse to run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from headsweep.results.store import ResultStore
from headsweep.sweep.run.ablation_values import StoredFill, stored_values
from headsweep.sweep.run.dispatch import WorkerPool, get, log
from headsweep.workers.ablation.optimal import heads_on_worker, install_on_worker, train_on_worker
from headsweep.workers.ablation.spec import AblationSpec

CHUNKS_PER_WORKER = 4


def _stored_optimal(store: ResultStore, run_id: str, checkpoint: str | None) -> dict[str, np.ndarray]:
    """The optimal constants this run stored for this model (empty if none: a new run, or another method's)."""
    rows = [r for r in store.read("ablation_values", run_id).to_pylist() if r["checkpoint"] == checkpoint]
    if not rows or any(r["method"] != "optimal" for r in rows):
        return {}
    return stored_values(store, run_id, checkpoint)


def train(pool: WorkerPool, heads: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Every head's constant, the slices spread over the live workers; a lost worker's slice retried by the pool."""
    live = pool.live()
    size = max(1, -(-len(heads) // (CHUNKS_PER_WORKER * len(live))))
    queue = [heads[i:i + size] for i in range(0, len(heads), size)]
    pending: dict = {}
    out: dict[str, Any] = {"constants": {}, "tokens": {}, "log": []}
    while queue or pending:
        busy = {w for w, _ in pending.values()}
        for i in pool.live():
            if queue and i not in busy:  # one slice in flight per worker
                chunk = queue.pop(0)
                pending[pool.actors[i].run.remote(train_on_worker, chunk)] = (i, tuple(chunk))
        [ref], _ = ray.wait(list(pending), num_returns=1)
        _, chunk = pending.pop(ref)
        try:
            part = get(ref)
        except RayActorError:
            part = pool.call(train_on_worker, list(chunk))  # restarts and retries as every other call
        out["constants"].update(part["constants"])
        out["tokens"].update(part["tokens"])
        out["log"].extend(part["log"])
    return out


def install(pool: WorkerPool, values: dict[str, np.ndarray]) -> None:
    """The constants on every live worker, and on any worker Ray restarts later."""
    ref = ray.put(values)
    ray.get([pool.actors[i].run.remote(install_on_worker, ref) for i in pool.live()])
    pool.on_restart = lambda actor: ray.get(actor.run.remote(install_on_worker, ref))


def optimal_fill(spec: AblationSpec, pool: WorkerPool, store: ResultStore, run_id: str, checkpoint: str | None
                 ) -> StoredFill:
    """This model's optimal constants (stored ones on a resumed run, else trained now), installed on the workers."""
    values = _stored_optimal(store, run_id, checkpoint)
    tokens: dict[str, int] = {}
    if values:
        log(f"optimal ablation: the constants run {run_id} stored ({sum(v.shape[0] for v in values.values())} heads)"
            " are reused, not trained again")
    else:
        heads = pool.call(heads_on_worker)
        start = time.perf_counter()
        log(f"optimal ablation: training {len(heads)} head constants on {len(pool.live())} workers "
            f"(Adam lr={spec.lr:g}, at most {spec.steps} steps each)")
        trained = train(pool, heads)
        by_site: dict[str, dict[int, np.ndarray]] = {}
        for (attention, layer, head), constant in trained["constants"].items():
            by_site.setdefault(f"{attention}:{layer}", {})[head] = constant
        values = {name: np.stack([found[h] for h in sorted(found)]) for name, found in by_site.items()}
        tokens = trained["tokens"]
        records = trained["log"]
        gain = float(np.mean([r["loss_mean"] - r["loss_optimal"] for r in records]))
        log(f"optimal ablation: {len(records)} constants trained in {time.perf_counter() - start:.1f}s "
            f"({sum(r['updates'] for r in records)} updates; reference loss below the mean's by {gain:.4g} per head "
            "on average)")
    install(pool, values)
    return StoredFill(store, run_id, checkpoint, "optimal", False, values, tokens)
