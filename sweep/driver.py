"""The sweep driver: starts workers, streams work units to them, writes results as they land.

The worker pool (``headsweep.sweep.dispatch``) keeps a small window of calls in flight per actor and
hands results over as they finish; the driver writes them in chunks, tests them for
significance, and records the run's status in ``runs``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from headsweep.errors import HeadsweepError
from headsweep.results.schema import SCHEMA_VERSION
from headsweep.results.store import ResultStore
from headsweep.sweep.config import Config, from_dict
from headsweep.sweep.dispatch import WorkerPool, log, units_per_call, unwrap, wait_until_placed
from headsweep.sweep.placement import alive_nodes, check_placement
from headsweep.sweep.plan import plan, prune_levels
from headsweep.sweep.progress import Progress
from headsweep.sweep.pruning import ablation_importance, iterative_level_masks, level_masks
from headsweep.sweep.ray_session import init_ray, resolve_device
from headsweep.sweep.significance_runner import SignificanceTracker, tests_for
from headsweep.sweep.stored_masks import efficiency_mask, explicit_mask
from headsweep.sweep.version import code_version
from headsweep.workers.actor import EvalWorker
from headsweep.workers.efficiency import efficiency_on_worker
from headsweep.workers.family import DatasetInfo, MaskOutput, RuntimeOptions, task_kind
from headsweep.workers.heads import Head
from headsweep.workers.importance import importance_on_worker, normalize_by_layer
from headsweep.workers.work import WorkUnit

# A running run's row is rewritten this often; a driver on another host whose row is older than
# STALE_AFTER_S is taken for dead, so its run may be resumed.
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def now() -> datetime:
    return datetime.now(UTC)


def driver_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def refuse_if_live(run: dict) -> None:
    """Two drivers must never write one run: refuse a ``running`` run whose driver still lives.

    On this host the driver's process is checked directly; a driver on another host counts as
    alive while its heartbeat (``updated_at``, rewritten every ``HEARTBEAT_S``) is recent.
    """
    if run["status"] != "running":
        return
    driver = json.loads(run["facts"] or "{}").get("driver", "")
    host, _, pid = driver.rpartition(":")
    age = (now() - run["updated_at"]).total_seconds()
    if host == socket.gethostname() and pid.isdigit():
        alive = int(pid) != os.getpid() and process_exists(int(pid))
    else:
        alive = age < STALE_AFTER_S
    if alive:
        raise HeadsweepError(
            f"run {run['run_id']} of this config is still being written by the driver {driver} (last heartbeat "
            f"{age:.0f} s ago; a driver on another host is taken for dead after {STALE_AFTER_S:.0f} s without one); "
            "wait for it, stop it, or start a separate run with --new"
        )


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class ChunkWriter:
    """Buffers finished evaluations and writes them as chunks (examples, then evaluations)."""

    store: ResultStore
    run_id: str
    info: DatasetInfo
    flush_every: int
    flush_seconds: float
    checkpoint: str | None = None
    eval_rows: list[dict] = field(default_factory=list)
    example_rows: list[dict] = field(default_factory=list)
    written: int = 0
    _last_flush: float = field(default_factory=time.monotonic)

    def add(self, unit: WorkUnit, out: MaskOutput, baseline_score: float, worker: str) -> None:
        self.eval_rows.append(
            {
                "eval_id": unit.eval_id,
                "experiment": unit.experiment,
                "attention": unit.attention,
                "layer": unit.layer,
                "head": unit.head,
                "heads_masked": [str(h) for h in unit.masked],
                "n_masked": len(unit.masked),
                "level": unit.level,
                "checkpoint": self.checkpoint,
                "metric": self.info.metric,
                "score": out.score,
                "baseline_score": baseline_score,
                "delta": out.score - baseline_score,
                "n_examples": len(out.outputs),
                "seconds": out.seconds,
                "worker": worker,
                "finished_at": now(),
            }
        )
        for i, example_id in enumerate(self.info.example_ids):
            self.example_rows.append(
                {
                    "eval_id": unit.eval_id,
                    "example_id": example_id,
                    "stats": out.stats[i].tolist(),
                    "loss": float(out.loss[i]),
                    "output": out.outputs[i],
                    "reference": self.info.references[i],
                }
            )

    def maybe_flush(self) -> None:
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if len(self.eval_rows) >= self.flush_every or (self.eval_rows and due):
            self.flush()

    def flush(self) -> None:
        if not self.eval_rows:
            return
        name = f"chunk-{uuid.uuid4().hex}"
        self.store.write_rows("examples", self.run_id, self.example_rows, name)
        self.store.write_rows("evaluations", self.run_id, self.eval_rows, name)
        self.written += len(self.eval_rows)
        self.eval_rows, self.example_rows = [], []
        self._last_flush = time.monotonic()


@dataclass
class Sweep:
    """One run of a config against a store."""

    cfg: Config
    store: ResultStore
    address: str | None = None
    show_progress: bool = True
    run_id: str = field(default_factory=new_run_id)
    resume: str | None = None
    auto_resume: bool = True
    done: dict[str, tuple[float, np.ndarray]] = field(default_factory=dict)

    def resumable(self) -> dict | None:
        """The earlier run of this very config to continue: ``--resume RUN_ID``, or the newest unfinished one."""
        runs = self.store.read("runs").to_pylist()
        if self.resume:
            run = next((r for r in runs if r["run_id"] == self.resume), None)
            if run is None:
                raise HeadsweepError(f"--resume {self.resume}: no such run in store {self.store.uri}")
            if run["config_hash"] != self.cfg.hash():
                raise HeadsweepError(
                    f"--resume {self.resume}: that run was made with another config (hash {run['config_hash']}, "
                    f"this one {self.cfg.hash()}); results of different configs are never mixed: start a new run"
                )
            refuse_if_live(run)
            return run
        if not self.auto_resume:
            return None
        unfinished = [r for r in runs if r["config_hash"] == self.cfg.hash() and r["status"] != "complete"]
        if not unfinished:
            return None
        newest = max(unfinished, key=lambda r: r["created_at"])
        refuse_if_live(newest)
        return newest

    def stored_results(self, info: DatasetInfo) -> dict[str, tuple[float, np.ndarray]]:
        """Score and per-example statistics of every evaluation the run already stored."""
        self.store.remove_orphans(self.run_id)
        scores = {r["eval_id"]: r["score"] for r in self.store.read("evaluations", self.run_id).to_pylist()}
        position = {e: i for i, e in enumerate(info.example_ids)}
        stats: dict[str, np.ndarray] = {}
        examples = self.store.read("examples", self.run_id, columns=["eval_id", "example_id", "stats"])
        for row in examples.to_pylist():
            if row["eval_id"] in scores:
                array = stats.setdefault(row["eval_id"], np.zeros((len(position), len(row["stats"]))))
                array[position[row["example_id"]]] = row["stats"]
        return {e: (scores[e], stats[e]) for e in scores}

    def model_variants(self) -> list[tuple[str | None, Any]]:
        """``(checkpoint, model config)`` for each model of the run: one, or one per training checkpoint."""
        if not self.cfg.checkpoints:
            return [(None, self.cfg.model)]
        key = task_kind(self.cfg.model.kind).checkpoint_key
        return [(c, dataclasses.replace(self.cfg.model, **{key: c})) for c in self.cfg.checkpoints]

    def start_workers(self, model_cfg: Any) -> tuple[WorkerPool, DatasetInfo]:
        """One actor per worker, placed as the config asks, each holding the model; Ray restarts lost ones."""
        s = self.cfg.sweep
        check_placement(self.cfg, alive_nodes())
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // s.workers)
        runtime = RuntimeOptions(
            device=resolve_device(self.cfg),
            batch_size=s.batch_size,
            masks_per_batch=s.masks_per_batch,
            reuse=s.reuse,
            threads=threads,
            seed=self.cfg.seed,
        )
        names = [f"worker-{i}" for i in range(s.workers)]
        actors = [
            EvalWorker.options(
                num_cpus=s.num_cpus_per_worker, num_gpus=s.num_gpus_per_worker,
                max_restarts=s.worker_restarts, max_task_retries=0,
            ).remote(name, model_cfg.kind, model_cfg, self.cfg.data, runtime)
            for name in names
        ]
        pool = WorkerPool(actors, names, max_retries=s.max_retries)
        want = f"each worker asks {s.num_cpus_per_worker:g} CPU and {s.num_gpus_per_worker:g} GPU"
        try:
            infos = wait_until_placed(
                [a.load.remote() for a in actors], names, s.placement_timeout_s,
                lambda: f"{want}; the cluster has {ray.available_resources()} free",
            )
            pool.names = ray.get([a.where.remote() for a in actors])
        except (RayTaskError, RayActorError, HeadsweepError) as exc:
            pool.stop()
            cause = unwrap(exc)
            if isinstance(cause, HeadsweepError):
                raise cause from None
            raise HeadsweepError(f"worker failed to load the model: {str(cause).splitlines()[0]}") from None
        log(f"{len(actors)} workers ready: {', '.join(pool.names)}")
        return pool, infos[0]

    def run_row(self, info: DatasetInfo, status: str, **extra) -> dict:
        return {
            "created_at": self.created_at,
            "updated_at": now(),
            "status": status,
            "name": self.cfg.name,
            "config": self.cfg.to_json(),
            "config_hash": self.cfg.hash(),
            "model": info.model,
            "dataset": info.dataset,
            "metric": info.metric,
            "n_examples": info.n_examples,
            "heads": json.dumps(info.inventory.to_json()),
            "facts": json.dumps({**info.facts, "driver": driver_id()}, sort_keys=True, default=str),
            "code_version": code_version(),
            "schema_version": SCHEMA_VERSION,
            **extra,
        }

    def execute(self) -> str:
        """Run the sweep; returns the run id. The run row says how it ended."""
        self.store.check_writable()
        init_ray(self.address, self.cfg)
        variants = self.model_variants()
        pool, info = self.start_workers(variants[0][1])
        tests_for(self.cfg.significance, info.metric)
        plan(self.cfg, info.inventory)  # bad masks or attention types fail before anything is written
        if "efficiency" in self.cfg.sweep.experiments and self.cfg.efficiency.mask:
            explicit_mask(self.cfg.efficiency.mask, info.inventory)
        previous = self.resumable()
        self.created_at = now()
        if previous is not None:
            self.run_id, self.created_at = previous["run_id"], previous["created_at"]
            self.done = self.stored_results(info)
            log(f"resuming run {self.run_id}: {len(self.done)} evaluations already stored")
        writer = ChunkWriter(self.store, self.run_id, info, self.cfg.sweep.flush_every, self.cfg.sweep.flush_seconds)
        writer.written = len(self.done)
        counts = {"n_planned": 0, "n_done": 0, "baseline_score": None}
        self.store.write_rows("runs", self.run_id, [self.run_row(info, "running", **counts)], "run")
        self._beat, self._last_beat = (info, counts, writer), time.monotonic()
        try:
            for index, (checkpoint, model_cfg) in enumerate(variants):
                if index > 0:
                    pool, info = self.start_workers(model_cfg)
                    self._beat = (info, counts, writer)
                prefix = f"ckpt{index}/" if checkpoint is not None else ""
                writer.checkpoint = checkpoint
                base_score, tracker = self.sweep_model(pool, info, writer, counts, prefix)
                if index == 0:
                    counts["baseline_score"] = base_score
                # Workers go first: the remaining significance tasks may need the CPUs they hold.
                pool.stop()
                if tracker is not None:
                    tracker.finish()
        except BaseException as exc:
            writer.flush()
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            counts["n_done"] = writer.written
            error = None if status == "interrupted" else str(unwrap(exc)).splitlines()[0][:500]
            self.store.write_rows("runs", self.run_id, [self.run_row(info, status, error=error, **counts)], "run")
            raise
        finally:
            pool.stop()
        counts["n_done"] = writer.written
        self.store.write_rows("runs", self.run_id, [self.run_row(info, "complete", **counts)], "run")
        self.store.remove_orphans(self.run_id)
        return self.run_id

    def sweep_model(
        self, pool: WorkerPool, info: DatasetInfo, writer: ChunkWriter, counts: dict, prefix: str
    ) -> tuple[float, SignificanceTracker | None]:
        """Every experiment on one model; eval ids (and significance families) carry ``prefix``."""
        units = [dataclasses.replace(u, eval_id=prefix + u.eval_id) for u in plan(self.cfg, info.inventory)]
        counts["n_planned"] += len(units)
        if units[0].eval_id in self.done:
            base_score, base_stats = self.done[units[0].eval_id]
        else:
            [(_, base, worker)] = pool.stream(units[:1], per_call=1)
            writer.add(units[0], base, base.score, worker)
            writer.flush()
            base_score, base_stats = base.score, base.stats
        tracker = None
        if self.cfg.significance.enabled:
            tracker = SignificanceTracker(
                self.cfg.significance, self.store, self.run_id, info.metric, base_stats, family_prefix=prefix
            )
        self.run_units(pool, units[1:], writer, tracker, base_score)
        exps = self.cfg.sweep.experiments
        if "importance" in exps or "prune_level" in exps:
            writer.flush()  # ablation importance reads this run's single-head rows back
            importance = self.importance(pool, info, prefix, writer.checkpoint)
            if "prune_level" in exps:
                masks = self.prune_masks(pool, info, importance)
                levels = [dataclasses.replace(u, eval_id=prefix + u.eval_id)
                          for u in prune_levels(self.cfg, info.inventory, masks)]
                counts["n_planned"] += len(levels)
                self.run_units(pool, levels, writer, tracker, base_score)
        if "efficiency" in exps:
            writer.flush()  # a mask named by level or eval id may be one of this run's evaluations
            choice = efficiency_mask(self.cfg.efficiency, self.store, self.run_id, info.inventory, prefix,
                                     writer.checkpoint)
            rows = [{**choice.columns(info.inventory), **row, "checkpoint": writer.checkpoint, "finished_at": now()}
                    for row in pool.call(efficiency_on_worker, choice.heads, self.cfg.efficiency)]
            self.store.write_rows("efficiency", self.run_id, rows, name=(prefix + "efficiency").replace("/", "-"))
        writer.flush()
        return base_score, tracker

    def run_units(self, pool: WorkerPool, units, writer: ChunkWriter, tracker, baseline_score: float) -> None:
        """Stream ``units`` through the workers, writing and testing each result as it lands.

        Units a resumed run already stored are not computed again; their stored statistics join
        the significance family.
        """
        if tracker is not None:
            tracker.expect(units)
            for unit in units:
                if unit.eval_id in self.done:
                    tracker.add(unit, self.done[unit.eval_id][1])
        todo = [u for u in units if u.eval_id not in self.done]
        progress = Progress(len(todo), enabled=self.show_progress, detail=pool.status_line)
        for unit, out, worker in pool.stream(todo, units_per_call(self.cfg.sweep.masks_per_batch)):
            writer.add(unit, out, baseline_score, worker)
            writer.maybe_flush()
            if tracker is not None:
                tracker.add(unit, out.stats)
            progress.update(1, f"[{unit.eval_id}]")
            self.heartbeat()

    def heartbeat(self) -> None:
        """Rewrite the run row now and then, so that another driver can tell this run is alive."""
        if time.monotonic() - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = time.monotonic()
        info, counts, writer = self._beat
        row = self.run_row(info, "running", **{**counts, "n_done": writer.written})
        self.store.write_rows("runs", self.run_id, [row], "run")

    def importance(
        self, pool: WorkerPool, info: DatasetInfo, prefix: str = "", checkpoint: str | None = None
    ) -> dict[Head, float]:
        """Head importance for ordering pruning levels, written to the ``importance`` table."""
        imp = self.cfg.importance
        stored = self.stored_importance(checkpoint) if self.done else None
        if stored is not None:
            # A resumed run orders its pending pruning levels by the importance it already stored, so
            # they continue the same curve even where recomputing would not be bit-identical (GPU).
            return stored
        if imp.method == "gradient":
            data_cfg = self.importance_data()
            result = pool.call(importance_on_worker, data_cfg, imp.per_token, imp.normalize, ())
            raw, normalized = result.raw, result.normalized
        else:
            source = imp.from_run or self.run_id
            raw = ablation_importance(self.store, source, info.inventory, None if imp.from_run else checkpoint)
            normalized = normalize_by_layer(raw)
        scores = normalized if imp.normalize else raw
        ranked = sorted(scores, key=lambda h: (-scores[h], h))
        rank = {h: i + 1 for i, h in enumerate(ranked)}
        rows = [
            {"method": imp.method, "attention": h.attention, "layer": h.layer, "head": h.head,
             "score": raw[h], "score_normalized": normalized[h], "rank": rank[h], "checkpoint": checkpoint}
            for h in info.inventory.heads
        ]
        self.store.write_rows("importance", self.run_id, rows, name=(prefix + imp.method).replace("/", "-"))
        return scores

    def stored_importance(self, checkpoint: str | None) -> dict[Head, float] | None:
        """The scores this run stored for ``checkpoint`` (as pruning ranks them), or None if there are none."""
        rows = [r for r in self.store.read("importance", self.run_id).to_pylist() if r["checkpoint"] == checkpoint]
        if not rows:
            return None
        column = "score_normalized" if self.cfg.importance.normalize else "score"
        return {Head(r["attention"], r["layer"], r["head"]): r[column] for r in rows}

    def prune_masks(self, pool: WorkerPool, info: DatasetInfo, scores: dict[Head, float]):
        prune, imp = self.cfg.prune, self.cfg.importance
        if not prune.reestimate:
            return level_masks(scores, info.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)
        data_cfg = self.importance_data()

        def estimate(mask: tuple[Head, ...]) -> dict[Head, float]:
            result = pool.call(importance_on_worker, data_cfg, imp.per_token, imp.normalize, mask)
            return result.scores

        return iterative_level_masks(estimate, info.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)

    def importance_data(self) -> Any:
        """``importance.data`` typed as the model kind's data section."""
        return from_dict(task_kind(self.cfg.model.kind).data_config, self.cfg.importance.data, "importance.data")
