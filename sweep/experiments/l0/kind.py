"""``l0`` (Voita et al. 2019 sec. 6): Hard Concrete head gates trained per penalty weight, on Ray Tune.

One Tune trial per ``l0.lambdas`` entry runs ``training.l0_trainable`` (this folder): the run's
model (this context's checkpoint) loaded on ``l0.data``, gates trained for ``l0.steps`` updates, each
trial asking what a sweep worker asks (``sweep.num_cpus_per_worker``, ``sweep.num_gpus_per_worker``),
a trial checkpoint every ``l0.checkpoint_every`` steps, ``FailureConfig(max_failures=sweep.max_retries)``
so a trial whose process dies continues from its last checkpoint. The Tune experiment lives in the store
beside the tables, ``<store>/tune/run_id=<run>/<prefix>l0`` (not a table: readers never scan it); a rerun
of a failed run restores it (``Tuner.restore(..., resume_errored=True)``), so finished trials are not
trained again and a failed one resumes from its checkpoint. Each trial's loss and expected number of open
gates are logged live (and kept in Tune's ``progress.csv`` / ``result.json`` in that folder).

Then, per lambda: its gates go to the ``gates`` table, and the mask of its closed gates is evaluated
through the normal evaluation path as experiment ``l0_gates`` (eval id ``l0_gates/<scope>/<lambda>``,
``level`` = share of the gated heads closed, tested against the baseline like every evaluation), so it
sits in the ``pruning`` view beside the gradient-importance curve of ``prune_level``. Closed heads are
switched off and every other head left at gate 1, as a pruned model runs. A trial that fails its
retries fails the run with one line naming its lambda, after the other trials' results are stored.

``l0.train: all`` (model weights trained with the gates, as the paper): the trial's final checkpoint holds the
fine-tuned model's state dict; it is written to ``<store>/tune/run_id=<run>/<prefix>l0-weights/lambda-<lambda>.pt``
and the unit of that lambda names it (``WorkUnit.weights``), so the workers evaluate the fine-tuned model with its
closed heads masked. The row's baseline stays the original model's (the paper's comparison), and its significance
test pairs the fine-tuned model's per-example statistics with the original model's. The workers read that file, so
``train: all`` needs a store on the local filesystem (one machine, or a filesystem the workers share).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import refuse_eval_data, typed_data
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment, GatedHeads
from headsweep.sweep.experiments.l0.settings import L0Section
from headsweep.sweep.experiments.l0.tables import GATES, L0_CURVE
from headsweep.sweep.experiments.plan import check_attention_types
from headsweep.sweep.experiments.prune_level import prune_scope_name
from headsweep.sweep.output.console import say as log
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit
from headsweep.workers.families.registry import model_family

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context

EVAL_EXPERIMENT = L0_CURVE.experiment


def l0_data(cfg: Config) -> Any:
    """``l0.data`` typed as the model family's data section."""
    return typed_data(cfg, cfg.l0.data, "l0.data")


def lambda_name(lam: float) -> str:
    """How a lambda is written in eval ids and file names (shortest exact repr)."""
    return repr(float(lam))


class L0Gates(Experiment):
    """Hard Concrete gates per lambda (Ray Tune), their table, and the evaluation of each closed-gate mask."""

    name = "l0"
    section = "l0"
    settings = L0Section
    table = "gates"
    tables = (GATES,)
    pruning_curve = L0_CURVE

    def check_settings(self, cfg: Config) -> None:
        """The ``l0`` section is checked only for a run of l0 (``check_config``)."""

    def data_sections(self, cfg: Config) -> list[tuple[str, Any]]:
        return [("l0.data", l0_data(cfg))]

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        return [GatedHeads("l0.attention", attention=tuple(cfg.l0.attention or ()) or None)]

    def check_config(self, cfg: Config) -> None:
        l0 = cfg.l0
        l0.check()
        if l0.data is None:
            raise HeadsweepError("l0 needs l0.data: the training data of the gates, kept apart from the evaluation set")
        data = l0_data(cfg)
        if not l0.allow_eval_data:
            advice = "train the gates on training data"
            refuse_eval_data("l0", l0.data, cfg, advice, advice, resolved=data)

    def validate(self, ctx: Context) -> None:
        from headsweep.sweep.experiments.l0.training import l0_data_on_worker  # torch: on the workers

        if ctx.cfg.l0.attention:
            check_attention_types(ctx.cfg.l0.attention, ctx.inventory, "l0.attention")
        self._check_resources(ctx.cfg)
        if ctx.cfg.l0.train == "all" and not _local_store(ctx):
            raise HeadsweepError(
                f"l0.train: all needs a store on the local filesystem (the workers read each trial's fine-tuned "
                f"weights from it), got {ctx.store.root}; use a local --store, or l0.train: gates"
            )
        # The training data loads in a worker now (kept there), so a bad or empty file fails before any write.
        if ctx.pool.call(l0_data_on_worker, l0_data(ctx.cfg)) == 0:
            raise HeadsweepError("l0.data has no examples: no training data for the L0 gates")

    def _check_resources(self, cfg: Config) -> None:
        """A trial asks what a worker asks, beside the workers: refuse a cluster where none could ever start."""
        import ray

        s = cfg.sweep
        if s.wait_for_resources or not ray.is_initialized():
            return
        total = ray.cluster_resources()
        for key, per in (("CPU", s.num_cpus_per_worker), ("GPU", s.num_gpus_per_worker)):
            left = total.get(key, 0.0) - s.workers * per
            if per > 0 and left + 1e-9 < per:
                raise HeadsweepError(
                    f"l0: each Tune trial asks {per:g} {key} like a sweep worker, but the cluster has "
                    f"{total.get(key, 0.0):g} {key} and the {s.workers} worker(s) hold {s.workers * per:g}; "
                    "lower sweep.workers, or set sweep.wait_for_resources: true on an autoscaling cluster"
                )

    def run(self, ctx: Context) -> None:
        from headsweep.sweep.experiments.l0.hard_concrete import HardConcrete  # torch: when l0 runs
        from headsweep.sweep.experiments.l0.training import load_trial_state, rows_from_state

        l0 = ctx.cfg.l0
        scope = prune_scope_name(l0.attention)
        gated = [layer for layer in ctx.inventory.layers if l0.attention is None or layer.attention in l0.attention]
        n_gated = sum(layer.num_heads for layer in gated)
        sites = [(layer.attention, layer.layer, layer.num_heads) for layer in gated]
        concrete = HardConcrete(beta=l0.beta)
        results = self.tune(ctx)
        units, failed = [], []
        for lam in l0.lambdas:
            result = results.get(lam)
            if result is None or result.error is not None or result.checkpoint is None:
                failed.append((lam, result))
                continue
            state = load_trial_state(result.checkpoint)
            rows = rows_from_state(state, sites, concrete, l0.closing)
            for row in rows:
                row.update({"l0_lambda": float(lam), "train": l0.train, "checkpoint": ctx.checkpoint})
            ctx.write("gates", rows, name=f"l0-lambda-{lambda_name(lam)}")
            mask = tuple(sorted(Head(r["attention"], r["layer"], r["head"]) for r in rows if r["closed"]))
            # train: all evaluates the trial's fine-tuned model (its closed heads masked) against the original one
            weights = self.save_weights(ctx, lam, state) if l0.train == "all" else None
            units.append(WorkUnit(f"{EVAL_EXPERIMENT}/{scope}/{lambda_name(lam)}", EVAL_EXPERIMENT, mask,
                                  l0.attention[0] if l0.attention and len(l0.attention) == 1 else None,
                                  level=len(mask) / n_gated, weights=weights))
            log(f"l0 lambda={lam:g}: {len(mask)} of {n_gated} gates closed")
        if units:
            ctx.evaluate(units)
        if failed:
            ctx.flush()
            lam, result = failed[0]
            why = _last_line(result.error or "no checkpoint") if result is not None else "no result"
            raise HeadsweepError(
                f"l0: the Tune trial of lambda={lam:g} failed after {ctx.cfg.sweep.max_retries} retries ({why[:300]}); "
                f"the other trials' results are stored, and rerunning the config resumes it from its last checkpoint"
            )

    def save_weights(self, ctx: Context, lam: float, state: dict[str, Any]) -> str:
        """Write the fine-tuned model of a ``train: all`` trial (its state's ``model``) where the workers read it.

        Returns the file's path, ``<tune folder>/<prefix>l0-weights/lambda-<lambda>.pt``: the model's own
        parameters and buffers (no gates), loadable with ``torch.load(..., weights_only=True)``. Written to a
        temporary name and renamed, so a file that exists is whole (a resumed run writes it again).
        """
        import os

        import torch

        if "model" not in state:
            raise HeadsweepError(f"l0: the checkpoint of the lambda={lam:g} trial holds no model weights (was it "
                                 "trained with l0.train: gates?); train it again with l0.train: all")
        storage, name = _tune_location(ctx)
        folder = os.path.join(storage, f"{name}-weights")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"lambda-{lambda_name(lam)}.pt")
        torch.save(state["model"], path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    # -- Ray Tune ------------------------------------------------------------------------------
    def tune(self, ctx: Context) -> dict[float, Any]:
        """Run (or restore and finish) the Tune experiment of this context; its results by lambda."""
        from ray import tune

        from headsweep.sweep.ablation.values import ablation_spec, stored_values
        from headsweep.sweep.cluster.ray_session import resolve_device
        from headsweep.sweep.experiments.l0.training import L0Job, l0_trainable

        cfg, l0, s = ctx.cfg, ctx.cfg.l0, ctx.cfg.sweep
        family = model_family(cfg.model.kind)
        model_cfg = cfg.model if ctx.checkpoint is None else dataclasses.replace(
            cfg.model, **{family.checkpoint_key: ctx.checkpoint})
        # The gates train under the run's ablation: a trial is no worker, so mean ablation's values come from the store.
        runtime = family.runtime(device=resolve_device(cfg), threads=max(1, int(s.num_cpus_per_worker)),
                                 seed=cfg.seed, reuse=False, ablation=ablation_spec(cfg), **s.batching())
        job = L0Job(cfg.model.kind, model_cfg, l0_data(cfg), runtime, l0, report_every=max(1, l0.steps // 20),
                    fill_values=stored_values(ctx.store, ctx.run_id, ctx.checkpoint))
        trainable = tune.with_resources(tune.with_parameters(l0_trainable, job=job),
                                        {"cpu": s.num_cpus_per_worker, "gpu": s.num_gpus_per_worker})
        storage_fs = None if _local_store(ctx) else ctx.store.fs
        storage, name = _tune_location(ctx)
        path = f"{storage}/{name}"
        if tune.Tuner.can_restore(path, storage_filesystem=storage_fs):
            log(f"l0: resuming the Tune experiment in {path}")
            tuner = tune.Tuner.restore(path, trainable, resume_errored=True, storage_filesystem=storage_fs)
        else:
            tuner = tune.Tuner(
                trainable,
                param_space={"lam": tune.grid_search([float(x) for x in l0.lambdas])},
                tune_config=tune.TuneConfig(reuse_actors=False),
                run_config=tune.RunConfig(
                    name=name, storage_path=storage, storage_filesystem=storage_fs, verbose=0,
                    failure_config=tune.FailureConfig(max_failures=s.max_retries),
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                    callbacks=[_LiveLog()],
                ),
            )
        log(f"l0: {len(l0.lambdas)} Tune trials ({l0.steps} steps each) in {path}")
        grid = tuner.fit()
        out: dict[float, Any] = {}
        for i in range(len(grid)):
            result = grid[i]
            lam = float(result.config["lam"])
            out[lam] = result
        return out


def _local_store(ctx: Context) -> bool:
    from pyarrow import fs as pafs

    return isinstance(ctx.store.fs, pafs.LocalFileSystem)


def _tune_location(ctx: Context) -> tuple[str, str]:
    """The run's Tune folder in the store and this context's experiment name in it."""
    return f"{ctx.store.root}/tune/run_id={ctx.run_id}", (ctx.prefix + "l0").replace("/", "-")


def _last_line(error: object) -> str:
    """The cause of a trial's failure: the last line of Tune's error (the worker's own exception comes last)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _live_log_class() -> type:
    from ray.tune import Callback

    class LiveLog(Callback):
        """Each trial's reported loss and expected open gates as the driver's status lines."""

        every_s = 10.0  # one line per trial every few seconds: a 500-step trial reports 20 times or more

        def __init__(self) -> None:
            self.last: dict[str, float] = {}

        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            now = time.monotonic()
            if now - self.last.get(trial.trial_id, -1e9) < self.every_s and not result.get("done"):
                return
            self.last[trial.trial_id] = now
            lam = trial.config.get("lam")
            loss = result.get("loss")
            text = f"loss {loss:.4g}, " if loss is not None else ""
            log(f"l0 lambda={lam:g} step {result.get('step')}: {text}expected open gates "
                f"{result.get('expected_open', float('nan')):.3g}, closed {result.get('closed')}")

        def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            # Tune calls this, not on_trial_error, for a failure it retries (a process killed, a node lost).
            step = (trial.last_result or {}).get("step")
            at = f" at step {step}" if step is not None else ""
            log(f"l0 lambda={trial.config.get('lam'):g}: trial failed{at} (failure {trial.num_failures}); Tune "
                "restarts it from its last checkpoint")

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            log(f"l0 lambda={trial.config.get('lam'):g}: trial failed after {trial.num_failures} failure(s), "
                "no retries left")

    return LiveLog


def _LiveLog() -> Any:  # noqa: N802 - reads as the class it builds; ray.tune is imported only when l0 runs
    return _live_log_class()()


L0 = L0Gates()
