"""The sweep driver: starts workers, runs the experiment kinds of the config, records the run.

What is evaluated comes from the experiment kinds (``headsweep.sweep.experiments``), phase by
phase; the worker pool (``headsweep.sweep.cluster.dispatch``) keeps a small window of calls in flight
per actor; results are written in chunks as they land (``headsweep.sweep.run.chunks``) and tested
for significance, and the run's row in ``runs`` says how far it got (``headsweep.sweep.run.runs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from headsweep.errors import HeadsweepError
from headsweep.results.schema import COMPLETE, FAILED, INTERRUPTED, PARTIAL, RUNNING
from headsweep.results.store import ResultStore, StoreFull, StoreUnwritable
from headsweep.sweep import experiments
from headsweep.sweep.ablation.fill import fetch_fill
from headsweep.sweep.ablation.values import ablation_spec
from headsweep.sweep.cluster import warm_workers
from headsweep.sweep.cluster.dispatch import WorkerPool, log, unwrap
from headsweep.sweep.cluster.placement import WorkerAsk, alive_nodes, check_placement, check_threads
from headsweep.sweep.cluster.ray_session import init_ray, resolve_device
from headsweep.sweep.configuration.ablation import averaged_outcomes
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.models.hub_pins import pin_hub_models
from headsweep.sweep.models.weights import check_resumed_weights, run_fingerprints, run_models
from headsweep.sweep.run.budget import BudgetReached, SessionBudget
from headsweep.sweep.run.chunks import ChunkWriter
from headsweep.sweep.run.claim import store_claim
from headsweep.sweep.run.context import Context, KindRoles
from headsweep.sweep.run.inputs import write_inputs
from headsweep.sweep.run.memory import check_memory
from headsweep.sweep.run.runs import (
    RunRecord,
    StoredResults,
    check_still_resumable,
    complete_run,
    new_run_id,
    now,
    resumable,
    run_to_continue,
    stored_results,
)
from headsweep.sweep.run.screening import Screening
from headsweep.sweep.run.worker_start import wait_for_workers
from headsweep.sweep.statistics.significance_runner import check_resample_memory, tests_for
from headsweep.workers.ablation.registry import METHODS
from headsweep.workers.actor.checks import model_heads_on_worker
from headsweep.workers.actor.eval_worker import EvalWorker
from headsweep.workers.core.family import DatasetInfo
from headsweep.workers.core.heads import HeadInventory
from headsweep.workers.families.registry import FAMILIES, model_family
from headsweep.workers.memory.batch_budget import host_available, machine_cpus


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
    done: StoredResults = field(default_factory=dict)
    screened: set[str] = field(default_factory=set)  # of a resumed run: eval ids screened out (sweep.screen)
    warned: set[str] = field(default_factory=set)  # data warnings already shown
    hub: dict = field(default_factory=dict)  # runs.facts "hub": each hub id loaded, its commit and cache folder
    weights: list = field(default_factory=list)  # runs.facts "weights": each model's content fingerprint
    record: RunRecord | None = None  # the run's row, once the run is opened (``record.written``: in the store)
    # Seconds the workers stay warm after the run, for the next run on the cluster (--keep-workers); 0: they end.
    keep_workers_s: float = 0.0

    def model_variants(self) -> list[tuple[str | None, Any]]:
        """``(checkpoint, model config)`` for each model of the run: one, or one per training checkpoint."""
        return run_models(self.cfg)

    def start_workers(self, model_cfg: Any) -> tuple[WorkerPool, DatasetInfo]:
        """One actor per worker, placed as the config asks, each holding the model; Ray restarts lost ones."""
        s = self.cfg.sweep
        check_placement(self.cfg, alive_nodes())
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // s.workers)
        # Each family keeps the settings its own options have (a family may add some: ModelFamily.runtime_options).
        runtime = model_family(model_cfg.kind).runtime(
            device=resolve_device(self.cfg),
            masks_per_batch=s.masks_per_batch,
            reuse=s.reuse,
            threads=threads,
            seed=self.cfg.seed,
            loss=s.loss,
            fused_attention=s.fused_attention,
            context_cache=s.context_cache,
            ablation=ablation_spec(self.cfg),
            **s.batching(),
        )
        names = [f"worker-{i}" for i in range(s.workers)]
        setups = [(name, model_cfg.kind, model_cfg, self.cfg.data, runtime) for name in names]
        if self.keep_workers_s > 0 and self.address:
            shape = warm_workers.Shape(s.num_cpus_per_worker, s.num_gpus_per_worker, s.worker_restarts)
            actors, kept = warm_workers.take_workers(s.workers, shape, setups, self.keep_workers_s)
            if kept:
                log(f"{kept} of {len(actors)} workers kept warm by an earlier run: no process start")
            pool = WorkerPool(actors, names, max_retries=s.max_retries, warm_owner=warm_workers.owner(),
                              setups=setups)
        else:
            actors = [
                EvalWorker.options(
                    num_cpus=s.num_cpus_per_worker, num_gpus=s.num_gpus_per_worker,
                    max_restarts=s.worker_restarts, max_task_retries=0,
                ).remote(*setup)
                for setup in setups
            ]
            pool = WorkerPool(actors, names, max_retries=s.max_retries)
        try:
            # `where` answers once Ray placed a worker and started its process, before its model loads (an actor
            # runs its calls in order): the wait can say which workers are loading and which wait.
            started = [a.where.remote() for a in actors]
            infos = wait_for_workers([a.load.remote() for a in actors], started, s.placement_timeout_s,
                                     WorkerAsk(s.num_cpus_per_worker, s.num_gpus_per_worker))
            pool.names = ray.get(started)
        except (RayTaskError, RayActorError, HeadsweepError) as exc:
            cause = unwrap(exc)
            # a load refused in the worker leaves it sound: a warm one may serve the next run
            pool.release() if isinstance(cause, HeadsweepError) and isinstance(exc, RayTaskError) else pool.stop()
            if isinstance(cause, HeadsweepError):
                raise cause from None
            raise HeadsweepError(f"worker failed to load the model: {str(cause).splitlines()[0]}") from None
        log(f"{len(actors)} workers ready: {', '.join(pool.names)}")
        if self.hub:
            infos[0].facts = {**infos[0].facts, "hub": self.hub}
        if self.weights:
            infos[0].facts = {**infos[0].facts, "weights": self.weights}
        for text in dict.fromkeys(w for info in infos for w in info.facts.get("warnings", [])):
            if text not in self.warned:  # once per run, whatever the number of workers and checkpoints
                self.warned.add(text)
                warn(text)
        return pool, infos[0]

    def execute(self) -> str:
        """Run the sweep; returns the run id. The run row says how it ended. While it runs, no kind, family or
        method may be registered but the entry points its config names (the registries are frozen)."""
        with experiments.KINDS.frozen(), FAMILIES.frozen(), METHODS.frozen():
            return self._execute()

    def _execute(self) -> str:
        """The run (:meth:`execute`).

        The store is checked first and written only from the run's first row on (``open_run``): a run refused
        before that leaves it as it was, not even an empty folder.
        """
        self.store.check_writable()
        self.store.check_files()
        # Hub ids become id@<commit> before anything starts: the config hash names the commit, workers load it.
        self.cfg, self.hub = pin_hub_models(self.cfg)
        if not self.address:  # a cluster's nodes are checked once connected (check_placement)
            check_threads(self.cfg, machine_cpus(), "this machine has")
        # Before Ray starts: what the model folders' files show (a tokenizer without its vocabulary) is refused, not
        # found by every worker.
        self.check_model_files()
        # What the weights are: a later use of the run with other weights (changed in place) is refused.
        self.weights = run_fingerprints([model for _, model in self.model_variants()])
        # Before Ray starts: a run to continue must be of these weights, and a complete run is not run again.
        previous = run_to_continue(self.store, self.cfg, self.resume, self.auto_resume)
        if previous is not None:
            check_resumed_weights(previous, self.weights)
        # `--resume RUN_ID` of a complete run, like the config of one run again: continuing it would only rewrite
        # its row.
        complete = previous if previous is not None and previous["status"] == COMPLETE else None
        if previous is None and self.resume is None and self.auto_resume:
            complete = complete_run(self.store, self.cfg, self.weights)
        if complete is not None:
            self.run_id = complete["run_id"]
            log(f"run {self.run_id} of this config is complete in store {self.store.uri}: nothing to do, nothing "
                "written (headsweep run --new starts a second run of it)")
            return self.run_id
        # Before Ray starts: a model the workers cannot hold together is refused, not swapped or killed mid-load.
        check_memory(self.cfg, [model for _, model in self.model_variants()], self.address)
        init_ray(self.address, self.cfg)
        variants = self.model_variants()
        pool, info = self.start_workers(variants[0][1])
        try:
            record = self.open_run(pool, info)
        except BaseException as exc:
            # refused against the loaded model: no call is running, warm workers may serve the next run
            pool.release() if isinstance(exc, HeadsweepError) else pool.stop()
            if self.record is not None and self.record.written:  # stopped after its first row: the row says so
                self._stopped(self.record, exc, None)
            raise
        record.start_heartbeat()
        budget = SessionBudget.from_config(self.cfg.sweep.budget)
        first: Context | None = None  # the first model's: its baseline is the run's baseline_score
        try:
            for index, (checkpoint, model_cfg) in enumerate(variants):
                if index > 0:
                    pool, info = self.start_workers(model_cfg)
                    record.info = info
                    fill = fetch_fill(self.cfg, pool, self.store, self.run_id, checkpoint)
                    if fill is not None:
                        fill.write()
                ctx = Context(
                    self.cfg, info, pool, self.store, self.run_id,
                    prefix=f"ckpt{index}/" if checkpoint is not None else "", checkpoint=checkpoint,
                    done=self.done, writer=record.writer, record=record, show_progress=self.show_progress,
                    budget=budget, kinds=kind_roles(self.cfg),
                    screening=Screening.of(self.cfg, frozenset(experiments.declaring("screened")), self.screened),
                )
                if first is None:
                    first = ctx
                self.sweep_model(ctx)
                record.baseline_score = first.baseline_score
                # Workers go first: the remaining significance tasks may need the CPUs they hold.
                pool.release()
                ctx.finish()
        except BudgetReached as exc:
            record.writer.flush()
            record.baseline_score = _baseline(first)
            record.write(PARTIAL)
            log(f"budget reached ({exc}): run {self.run_id} is marked partial with {record.writer.written} "
                "evaluations stored; run the same command again to continue it")
            return self.run_id
        except StoreFull as exc:
            # Nothing more fits: what is buffered is dropped (the rerun computes it again), and the row that says
            # how the run ended is tried once, being small; without it the run still reads as resumable.
            full = exc.needing(record.bytes_left())
            record.baseline_score = _baseline(first)
            with contextlib.suppress(StoreFull):
                record.write(FAILED, error=str(full))
            raise full from None
        except BaseException as exc:
            self._stopped(record, exc, first)
            raise
        finally:
            record.stop_heartbeat()
            pool.stop()
        record.write(COMPLETE)
        self.store.remove_orphans(self.run_id)
        return self.run_id

    def _stopped(self, record: RunRecord, exc: BaseException, first: Context | None) -> None:
        """Write the row of a run that Ctrl-C or SIGTERM (a ``KeyboardInterrupt``: interrupted) or an error
        (failed) stopped, with what it stored. Where the store refuses the buffered rows (the write that stopped the
        run), they are left for the rerun to compute and the row is still tried: it says how the run ended."""
        with contextlib.suppress(StoreUnwritable):
            record.writer.flush()
        record.baseline_score = _baseline(first)
        status = INTERRUPTED if isinstance(exc, KeyboardInterrupt) else FAILED
        error = None if status == INTERRUPTED else str(unwrap(exc)).splitlines()[0][:500]
        record.write(status, error=error)

    def open_run(self, pool: WorkerPool, info: DatasetInfo) -> RunRecord:
        """Check the config against the loaded model, find the run to resume, write the ``running`` row.

        Every check against the model comes before the first write, so bad input leaves the store untouched.
        """
        tests = tests_for(self.cfg.significance, info.metric, averaged_outcomes(self.cfg))
        # On a cluster the significance tasks may run on any node: this machine's memory is the one known here.
        check_resample_memory(self.cfg.significance, tests, info.n_examples, host_available(),
                              self.cfg.sweep.memory_limit_gib)
        ctx = Context(self.cfg, info, pool, self.store, self.run_id)
        screening = Screening.of(self.cfg, frozenset(experiments.declaring("screened")))
        if screening is not None:
            screened = [k for k in experiments.experiments_of(self.cfg) if k.screened]
            screening.check_model(info.n_examples, sum(len(k.plan(ctx)) for k in screened))
        experiments.validate(ctx)
        self.check_checkpoints(pool, info)
        previous = resumable(self.store, self.cfg, self.resume, self.auto_resume)
        created_at = now()
        if previous is not None:
            check_resumed_weights(previous, self.weights)
            self.run_id, created_at = previous["run_id"], previous["created_at"]
            if previous.get("driver_gone"):  # a run whose row says running: its driver died without a word
                log(f"run {self.run_id} was left running by a driver that is gone ({previous['driver_gone']})")
            self.done = stored_results(self.store, self.run_id, info)
            self.screened = Screening.stored(self.store, self.run_id)
            log(f"resuming run {self.run_id}: {len(self.done)} evaluations already stored")
        # Mean ablation's values: a resumed run's must equal those it stored (checked before anything is written).
        fill = fetch_fill(self.cfg, pool, self.store, self.run_id, self.model_variants()[0][0])
        writer = ChunkWriter(self.store, self.run_id, info, self.cfg.sweep.flush_every, self.cfg.sweep.flush_seconds,
                             ablation=self.cfg.sweep.ablation)
        writer.written = len(self.done)
        record = self.record = RunRecord(self.cfg, self.store, self.run_id, created_at, info, writer)
        # Another driver of this config may have chosen the same run (or none) since: checked again under a
        # claim that one driver of a config holds at a time, until its row says it is running.
        with store_claim(self.store, self.cfg.hash()):
            check_still_resumable(self.store, self.cfg, self.resume, self.auto_resume, previous, self.weights)
            record.write(RUNNING, n_done=0)
        if fill is not None:
            fill.write()
        write_inputs(self.store, self.run_id, info)  # once per run: the texts the drill-downs show
        return record

    def check_model_files(self) -> None:
        """What each model's files show without loading it (``ModelFamily.check_model``), before Ray starts; a
        training checkpoint's line says which entry of ``checkpoints`` it is."""
        for index, (checkpoint, model_cfg) in enumerate(self.model_variants(), start=1):
            try:
                model_family(model_cfg.kind).check_model(model_cfg)
            except HeadsweepError as exc:
                if checkpoint is None:
                    raise
                raise HeadsweepError(f"checkpoints entry {index} ({checkpoint}): {exc}") from None

    def check_checkpoints(self, pool: WorkerPool, info: DatasetInfo) -> None:
        """Every later training checkpoint exists, loads, and has the first one's heads, before anything is written.

        Each is opened (without data) in a worker and let go again; the first was loaded by the workers already.
        """
        for index, (checkpoint, model_cfg) in enumerate(self.model_variants()[1:], start=2):
            try:
                heads = pool.call(model_heads_on_worker, model_cfg)
            except HeadsweepError as exc:
                raise HeadsweepError(f"checkpoints entry {index} ({checkpoint}): {exc}") from None
            if heads is not None and heads.to_json() != info.inventory.to_json():
                raise HeadsweepError(
                    f"checkpoints entry {index} ({checkpoint}) has other attention heads than the first "
                    f"({describe_heads(heads)} vs {describe_heads(info.inventory)}): a run over checkpoints "
                    "sweeps one architecture"
                )

    def sweep_model(self, ctx: Context) -> None:
        """Every experiment kind of the run on one model, phase by phase (``experiments.schedule``)."""
        ctx.writer.checkpoint = ctx.checkpoint
        for phase in experiments.schedule(self.cfg):
            if phase.streams:
                ctx.evaluate([unit for kind in phase.kinds for unit in kind.plan(ctx)])
            else:
                ctx.ensure_reference()
                ctx.flush()  # a step may read this run's evaluations back (ablation importance, efficiency masks)
                for kind in phase.kinds:
                    kind.run(ctx)
            ctx.pool.relay_notes()
        ctx.ensure_reference()  # a run of the baseline alone
        ctx.flush()


def kind_roles(cfg: Config) -> KindRoles:
    """What the context asks of ``cfg``'s kinds, from their declarations."""
    ordering = experiments.ordering_kind(cfg)
    return KindRoles(experiments.reference_kind().name, None if ordering is None else ordering.name,
                     experiments.declaring("screened"))


def _baseline(first: Context | None) -> float | None:
    """The run's baseline score: the first model's, once its evaluation is stored (also for a run that stops
    later: budget, Ctrl-C, an error), else None."""
    return None if first is None else first.baseline_score


def warn(text: str) -> None:
    """A ``headsweep: warning: ...`` line (the console shows the ``headsweep`` logger's warnings)."""
    logging.getLogger("headsweep").warning("%s", text)


def describe_heads(inventory: HeadInventory) -> str:
    """``enc_self 3x8, dec_self 3x8``: layers x heads per attention type (uneven layers listed)."""
    parts = []
    for attention in inventory.attention_types:
        counts = [s.num_heads for s in inventory.layers if s.attention == attention]
        shape = f"{len(counts)}x{counts[0]}" if len(set(counts)) == 1 else "/".join(map(str, counts))
        parts.append(f"{attention} {shape}")
    return ", ".join(parts)
