"""A run's row in ``runs``, its heartbeat, and which earlier run a new driver resumes.

The row is written when the run starts, rewritten every ``HEARTBEAT_S`` while it runs (so that
another driver can tell it is alive) and once more when it ends, with its status. A run of the
same config that did not complete is resumed: its stored evaluations are read back and not
computed again, unless its driver still lives.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from headsweep.errors import HeadsweepError
from headsweep.results.schema import COMPLETE, RUN_STATUSES, RUNNING, SCHEMA_VERSION
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.run.chunks import ChunkWriter
from headsweep.sweep.run.version import code_version
from headsweep.workers.ablation.registry import DEFAULT_METHOD
from headsweep.workers.core.family import DatasetInfo

# A running run's row is rewritten this often; a driver on another host whose row is older than
# STALE_AFTER_S is taken for dead, so its run may be resumed.
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0

# What a resumed run already stored: eval id -> (score, per-example statistics).
StoredResults = dict[str, tuple[float, np.ndarray]]


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def now() -> datetime:
    return datetime.now(UTC)


def driver_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_driver(facts: str | None) -> str:
    """``host:pid`` of the driver that last wrote a run's row (from its ``facts``; empty if none is named)."""
    return str(json.loads(facts or "{}").get("driver", ""))


def driver_alive(driver: str, heartbeat_age_s: float, ray_job_alive: bool | None = None) -> bool:
    """Whether the driver of a ``running`` run may still be writing it.

    ``ray_job_alive`` is what the Ray cluster this process is connected to knows of that driver
    (:func:`ray_job_alive`; None: nothing). A Ray job the cluster has ended is a driver gone (its process exited,
    or its node was lost). On this host its process is checked directly. Elsewhere a Ray job the cluster has alive
    is a driver alive; and a driver the cluster does not know (and any driver, seen by a reader of a store on S3)
    counts as alive while its heartbeat (the row's ``updated_at``, rewritten every ``HEARTBEAT_S`` whatever the run
    is doing) is younger than ``STALE_AFTER_S``.
    """
    if ray_job_alive is False:
        return False
    pid = local_pid(driver)
    if pid is not None:
        return pid != os.getpid() and process_exists(pid)
    if ray_job_alive:
        return True
    return heartbeat_age_s < STALE_AFTER_S


def ray_facts() -> dict[str, str]:
    """This driver's Ray job and the node it is connected to, when it runs on Ray (written in the run's ``facts``):
    how a later driver on the same cluster tells whether this one still lives (:func:`ray_job_alive`)."""
    import ray

    if not ray.is_initialized():
        return {}
    context = ray.get_runtime_context()
    return {"ray_job": context.get_job_id(), "ray_node": context.get_node_id()}


def ray_job_alive(facts: str | None) -> bool | None:
    """Whether the driver whose run row holds ``facts`` still runs, as the Ray cluster this process is connected to
    knows it: False once its Ray job has ended (Ray ends a driver's job when its process exits or its node is lost),
    True while it runs, None when this process is on no Ray cluster or on another one than that driver was (job ids
    repeat between clusters: the driver's node must be one this cluster knows, dead or alive)."""
    if "ray" not in sys.modules:  # a process that never imported Ray is on no cluster (and a reader stays fast)
        return None
    import ray

    named = json.loads(facts or "{}")
    job, node = named.get("ray_job"), named.get("ray_node")
    if not job or not node or not ray.is_initialized():
        return None
    try:
        from ray._private import state  # the GCS's job table: Ray offers no public call for it without a dashboard

        if not any(n.get("NodeID") == node for n in ray.nodes()):
            return None
        entry = next((j for j in state.jobs() if j.get("JobID") == job), None)
    except Exception:  # noqa: BLE001 - an answer Ray could not give leaves the other rules to decide
        return None
    return None if entry is None else not entry.get("IsDead", False)


def local_pid(driver: str) -> int | None:
    """The process id of a driver (``host:pid``) that ran on this host, whose process can be checked; else None."""
    host, _, pid = driver.rpartition(":")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def refuse_if_live(run: dict) -> str | None:
    """Two drivers must never write one run: refuse a ``running`` run whose driver still lives
    (:func:`driver_alive`). Returns why a ``running`` run's driver is taken for gone (None: the run was not running).
    """
    if run["status"] != RUNNING:
        return None
    driver = run_driver(run["facts"])
    age = (now() - run["updated_at"]).total_seconds()
    on_ray = ray_job_alive(run["facts"])
    if on_ray is False:
        return f"its Ray job {json.loads(run['facts'])['ray_job']} has ended on this cluster"
    if driver_alive(driver, age, on_ray):
        why = (f"its Ray job {json.loads(run['facts'])['ray_job']} runs on this cluster" if on_ray else
               f"last heartbeat {age:.0f} s ago; a driver on another host is taken for dead after "
               f"{STALE_AFTER_S:.0f} s without one")
        raise HeadsweepError(
            f"run {run['run_id']} of this config is still being written by the driver {driver} ({why}); "
            "wait for it, stop it, or start a separate run with --new"
        )
    if local_pid(driver) is not None:
        return f"its process {driver} is not running"
    return f"its driver {driver or '(not named)'} has written no heartbeat for {age:.0f} s"


def run_to_continue(store: ResultStore, cfg: Config, resume: str | None, auto_resume: bool) -> dict | None:
    """The earlier run of this very config that a driver would continue: ``--resume RUN_ID``, or the newest
    unfinished one (whether its driver still lives is :func:`resumable`'s question)."""
    runs = store.read("runs").to_pylist()
    if resume:
        run = next((r for r in runs if r["run_id"] == resume), None)
        if run is None:
            raise HeadsweepError(f"--resume {resume}: no such run in store {store.uri}")
        if run["config_hash"] != cfg.hash():
            before = json.loads(run["config"] or "{}").get("sweep", {}).get("ablation", DEFAULT_METHOD)
            if before != cfg.sweep.ablation:
                raise HeadsweepError(
                    f"--resume {resume}: that run was made with sweep.ablation {before}, this config asks "
                    f"{cfg.sweep.ablation}; deltas of two ablation methods are never mixed in one run: start a new "
                    "run (headsweep compare sets two runs side by side)")
            raise HeadsweepError(
                f"--resume {resume}: that run was made with another config (hash {run['config_hash']}, "
                f"this one {cfg.hash()}); results of different configs are never mixed: start a new run"
            )
        return run
    if not auto_resume:
        return None
    unfinished = [r for r in runs if r["config_hash"] == cfg.hash() and r["status"] != COMPLETE]
    return max(unfinished, key=lambda r: r["created_at"]) if unfinished else None


def resumable(store: ResultStore, cfg: Config, resume: str | None, auto_resume: bool) -> dict | None:
    """The earlier run of this very config to continue (:func:`run_to_continue`), refused while its driver lives."""
    run = run_to_continue(store, cfg, resume, auto_resume)
    if run is None:
        return None
    gone = refuse_if_live(run)
    return {**run, "driver_gone": gone} if gone else run


def complete_run(store: ResultStore, cfg: Config, prints: list[dict]) -> dict | None:
    """The newest complete run of this very config (and, where both have a fingerprint, these weights) when no run
    of it is unfinished: running the config again would only store the same results a second time (queries that name
    no run would count them twice), so the driver says so and writes nothing (``--new`` for a second run)."""
    from headsweep.sweep.models.weights import same_run_weights

    if store.local and not os.path.isdir(store.root):
        return None
    runs = [r for r in store.read("runs").to_pylist() if r["config_hash"] == cfg.hash()]
    if any(r["status"] != COMPLETE for r in runs):
        return None  # one to resume
    same = [r for r in runs if same_run_weights(r["facts"], prints)]
    return max(same, key=lambda r: r["created_at"]) if same else None


def check_still_resumable(store: ResultStore, cfg: Config, resume: str | None, auto_resume: bool,
                          before: dict | None, prints: list[dict] | None = None) -> None:
    """Under the store's claim on the config, just before the run's first row: the run to continue is still
    the one chosen before (``before``), so that two drivers of one config that started together never both
    start or continue a run. A driver that opened a run of this config since is refused by ``resumable``; one that
    completed a run of it (of the weights ``prints`` name, where given) since, here."""
    after = resumable(store, cfg, resume, auto_resume)
    if (after or {}).get("run_id") != (before or {}).get("run_id"):
        raise HeadsweepError(
            f"another driver started or stopped a run of this config in store {store.uri} while this one was "
            "starting: run the same command again"
        )
    if before is None and after is None and auto_resume and not resume and prints is not None:
        done = complete_run(store, cfg, prints)
        if done is not None:
            raise HeadsweepError(f"another driver completed run {done['run_id']} of this config in store {store.uri} "
                                 "while this one was starting: nothing written (--new for a second run)")


def stored_results(store: ResultStore, run_id: str, info: DatasetInfo) -> StoredResults:
    """Score and per-example statistics of every evaluation the run already stored."""
    store.remove_orphans(run_id)
    scores = {r["eval_id"]: r["score"] for r in store.read("evaluations", run_id).to_pylist()}
    position = {e: i for i, e in enumerate(info.example_ids)}
    stats: dict[str, np.ndarray] = {}
    examples = store.read("examples", run_id, columns=["eval_id", "example_id", "stats"])
    for row in examples.to_pylist():
        if row["eval_id"] in scores:
            array = stats.setdefault(row["eval_id"], np.zeros((len(position), len(row["stats"]))))
            array[position[row["example_id"]]] = row["stats"]
    return {e: (scores[e], stats[e]) for e in scores}


@dataclass
class RunRecord:
    """The run's row: what it is (config, model, data), how far it got and how it ended.

    ``info`` is the model being swept (replaced per training checkpoint); ``n_done`` is what
    ``writer`` has stored, counted when the row is written.
    """

    cfg: Config
    store: ResultStore
    run_id: str
    created_at: datetime
    info: DatasetInfo
    writer: ChunkWriter
    n_planned: int = 0
    baseline_score: float | None = None
    progress: dict = field(default_factory=dict)  # facts.progress: what `headsweep status` shows of a live run
    written: bool = False  # the row is in the store (a run stopped before its first row wrote nothing)
    ray: dict = field(default_factory=ray_facts)  # facts.ray_job, ray_node: the driver's Ray job and node
    _last_beat: float = field(default_factory=time.monotonic)
    _ended: bool = False  # a row saying how the run ended is written: no heartbeat may say running again
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _beating: threading.Event = field(default_factory=threading.Event, repr=False)  # set: the heartbeat stops

    def row(self, status: str, n_done: int, **extra) -> dict:
        info = self.info
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
            # progress is a live run's (ETA, pass left): a row that says how the run ended has none
            "facts": json.dumps({**info.facts, "driver": driver_id(), **self.ray,
                                 **({"progress": self.progress} if self.progress and status == RUNNING else {})},
                                sort_keys=True, default=str),
            "code_version": code_version(),
            "schema_version": SCHEMA_VERSION,
            "ablation": self.cfg.sweep.ablation,
            "n_planned": self.n_planned,
            "n_done": n_done,
            "baseline_score": self.baseline_score,
            **extra,
        }

    def write(self, status: str, n_done: int | None = None, **extra) -> None:
        """Write the row with ``status`` (``n_done`` defaults to what the writer has stored)."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")
        n_done = self.writer.written if n_done is None else n_done
        with self._lock:  # the heartbeat thread writes it too: one row at a time, and never after the last
            if status == RUNNING and self._ended:
                return
            self.store.write_rows("runs", self.run_id, [self.row(status, n_done, **extra)], "run")
            self.written, self._ended = True, status != RUNNING
            self._last_beat = time.monotonic()

    def bytes_left(self) -> int:
        """The space the run's evaluations planned so far and not stored yet will take, at the bytes per stored
        evaluation this run has taken (0 before the first is stored)."""
        done = self.writer.written
        left = self.n_planned - done
        if done <= 0 or left <= 0:
            return 0
        try:
            return self.store.run_bytes(self.run_id) * left // done
        except (OSError, pa.ArrowException):
            return 0

    def plan(self, n: int) -> None:
        """``n`` more evaluations planned: the row says so now, so that a run whose driver dies before its next
        heartbeat still shows how much it had planned."""
        self.n_planned += n
        self.write(RUNNING)

    def beat_due(self) -> bool:
        """Whether :meth:`heartbeat` would rewrite the row now."""
        return time.monotonic() - self._last_beat >= HEARTBEAT_S

    def heartbeat(self) -> None:
        """Rewrite the row now and then, so that another driver can tell this run is alive."""
        if self.beat_due():
            self.write(RUNNING)

    def start_heartbeat(self) -> None:
        """Keep the row's heartbeat going from a thread, also while nothing lands for long (a training step, an
        evaluation of a large model): a driver that stops beating is taken for dead after ``STALE_AFTER_S``."""
        threading.Thread(target=self._beat, name="headsweep-heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        self._beating.set()

    def _beat(self) -> None:
        while not self._beating.wait(HEARTBEAT_S / 4):
            try:
                self.heartbeat()
            except Exception as exc:  # noqa: BLE001 - a store that fails a heartbeat now may take the next one
                logging.getLogger(__name__).warning("run %s: heartbeat not written (%s); trying again", self.run_id,
                                                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
