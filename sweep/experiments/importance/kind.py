"""``importance`` (Michel et al. sec. 4.1): a score per head, written to the ``importance`` table.

``importance.method: gradient`` estimates ``E|dL/dxi_h|`` on ``importance.data`` in a worker
(``headsweep.workers.importance.importance_on_worker``); ``lrp`` each head's share of the relevance of the
top-1 logit on ``importance.data`` (Voita et al. sec. 4; ``headsweep.workers.lrp``); ``ablation`` takes the
harm of each head's single-head ablation in this run (or in ``importance.from_run``): minus the delta where the metric's
higher is better, the delta where lower is (perplexity), see ``headsweep.sweep.pruning.levels.ablation_importance``.
The scores (normalised per layer or raw, as configured) are left in ``ctx.shared["importance"]`` for the
kinds that order heads by them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.pruning.levels import ablation_importance
from headsweep.sweep.terminal.progress import step
from headsweep.workers.heads import Head
from headsweep.workers.registry import model_family

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context

SHARED_KEY = "importance"


def importance_data(cfg: Config) -> Any:
    """``importance.data`` typed as the model family's data section."""
    return from_dict(model_family(cfg.model.kind).data_config, cfg.importance.data, "importance.data")


FILE_KEYS = ("path", "source", "target", "data_bin")


def _same_place(key: str, value: Any) -> Any:
    """A file or folder named by a data key, as the file system knows it (a relative path, a link and the path
    it points to are one place); other keys as written."""
    if key in FILE_KEYS and isinstance(value, str) and "://" not in value:
        return os.path.realpath(value)
    return value


def same_data_file(a: dict, b: Any) -> bool:
    """Whether the data section ``a`` (a dict) names the same data as the typed data section ``b``: the same
    files (by where they are, not how they are spelled) and, for binarised data, the same folder and split."""
    keys = (*FILE_KEYS, "split")
    mine = {k: _same_place(k, a.get(k)) for k in keys if a.get(k)}
    theirs = {k: _same_place(k, getattr(b, k, None)) for k in keys if getattr(b, k, None)}
    return bool(mine) and mine == theirs


def names_test_split(data: dict) -> bool:
    """Whether a data section names a test split (a file or split called test...)."""
    keys = ("path", "source", "name", "split") if data.get("data_bin") else ("path", "source", "name")
    names = [str(data.get(k) or "") for k in keys]
    return any(Path(n).name.lower().startswith("test") or n.lower() == "test" for n in names if n)


def refuse_eval_data(key: str, data: dict, cfg: Config, same_advice: str, test_advice: str,
                     resolved: Any = None) -> None:
    """The rule for data a kind trains or estimates on (``importance.data``, ``l0.data``): not the evaluation set
    (the same section, file, or ``resolved`` typed section) nor a test split, unless ``<key>.allow_eval_data``."""
    if data == dataclasses.asdict(cfg.data) or same_data_file(data, cfg.data) or resolved == cfg.data:
        raise HeadsweepError(f"{key}.data is the evaluation set; {same_advice}, or set {key}.allow_eval_data: true")
    if names_test_split(data):
        raise HeadsweepError(f"{key}.data looks like a test split; {test_advice}, or set {key}.allow_eval_data: true")


class Importance(Experiment):
    """Head importance, estimated once per model (a resumed run reuses the scores it stored)."""

    name = "importance"
    section = "importance"
    table = "importance"

    def needs(self, cfg: Config) -> tuple[str, ...]:
        imp = cfg.importance
        return ("single_head",) if imp.method == "ablation" and not imp.from_run else ()

    def check_config(self, cfg: Config) -> None:
        imp = cfg.importance
        if imp.method in ("gradient", "lrp"):
            if imp.data is None and only_for_order(cfg):
                raise HeadsweepError(
                    "sweep.order: importance sends the masks of the most important heads first, so it needs head "
                    "importance before the grid: set importance.data (training or validation data, kept apart from "
                    "the evaluation set), or importance.method: ablation with importance.from_run (an earlier run's "
                    "single-head deltas), or leave sweep.order at planned"
                )
            if imp.data is None:
                raise HeadsweepError(
                    f"{imp.method} importance needs importance.data (training or validation data, kept apart from "
                    "the evaluation set)"
                )
            if not imp.allow_eval_data:
                refuse_eval_data("importance", imp.data, cfg, "estimate importance on training or validation data",
                                 "use training or validation data")
        if imp.method == "ablation" and not imp.from_run and "single_head" not in cfg.sweep.experiments:
            raise HeadsweepError(
                "importance.method ablation orders heads by single-head deltas: add single_head to sweep.experiments "
                "or name an earlier run with importance.from_run"
            )

    def validate(self, ctx: Context) -> None:
        # importance.data loads in a worker now (kept there for the estimate), so that a file the model cannot
        # read (labels outside its label set, text longer than its positions) fails before the baseline is written.
        if ctx.cfg.importance.method in ("gradient", "lrp"):
            ctx.pool.call(load_data_on_worker, importance_data(ctx.cfg))

    def run(self, ctx: Context) -> None:
        stored = stored_importance(ctx) if ctx.done else None
        # A resumed run orders its pending pruning levels by the importance it already stored, so
        # they continue the same curve even where recomputing would not be bit-identical (GPU).
        ctx.shared[SHARED_KEY] = stored if stored is not None else self.estimate(ctx)

    def estimate(self, ctx: Context) -> dict[Head, float]:
        """Estimate and write the scores; returns them as pruning ranks them."""
        # Imported here: torch is loaded when a run estimates importance, not when a config is read.
        from headsweep.workers.importance import importance_on_worker, normalize_by_layer

        imp = ctx.cfg.importance
        if imp.method == "gradient":
            with step("gradient importance", enabled=ctx.show_progress, detail=ctx.pool.status_line):
                result = ctx.pool.call(importance_on_worker, importance_data(ctx.cfg), imp.per_token, imp.normalize, ())
            raw, normalized = result.raw, result.normalized
        elif imp.method == "lrp":
            from headsweep.workers.lrp import lrp_on_worker

            with step("LRP relevance", enabled=ctx.show_progress, detail=ctx.pool.status_line):
                result = ctx.pool.call(lrp_on_worker, importance_data(ctx.cfg), imp.normalize, ())
            raw, normalized = result.raw, result.normalized
        else:
            source = imp.from_run or ctx.run_id
            raw = ablation_importance(ctx.store, source, ctx.inventory, None if imp.from_run else ctx.checkpoint)
            normalized = normalize_by_layer(raw)
        scores = normalized if imp.normalize else raw
        ranked = sorted(scores, key=lambda h: (-scores[h], h))
        rank = {h: i + 1 for i, h in enumerate(ranked)}
        rows = [
            {"method": imp.method, "attention": h.attention, "layer": h.layer, "head": h.head,
             "score": raw[h], "score_normalized": normalized[h], "rank": rank[h], "checkpoint": ctx.checkpoint}
            for h in ctx.inventory.heads
        ]
        ctx.write("importance", rows, name=imp.method)
        return scores


def only_for_order(cfg: Config) -> bool:
    """Whether importance joins the run only because ``sweep.order: importance`` asks for it (no kind the run
    lists is importance or needs it)."""
    from headsweep.sweep.experiments import experiment_kind  # the registry imports this module

    if cfg.sweep.order != "importance":
        return False
    listed = [experiment_kind(name) for name in cfg.sweep.experiments]
    return not any(kind is IMPORTANCE or IMPORTANCE.name in kind.needs(cfg) for kind in listed)


def load_data_on_worker(worker: Any, data_cfg: Any) -> None:
    """Worker-side (``EvalWorker.run``): the worker's model on ``data_cfg``, loaded and kept, so that every check
    the family makes of data against its model runs."""
    worker.adapter(data_cfg)


def stored_importance(ctx: Context) -> dict[Head, float] | None:
    """The scores this run stored for ``ctx``'s checkpoint (as pruning ranks them), or None if there are none."""
    rows = [r for r in ctx.store.read("importance", ctx.run_id).to_pylist() if r["checkpoint"] == ctx.checkpoint]
    if not rows:
        return None
    column = "score_normalized" if ctx.cfg.importance.normalize else "score"
    return {Head(r["attention"], r["layer"], r["head"]): r[column] for r in rows}


IMPORTANCE = Importance()
