"""``importance`` (Michel et al. sec. 4.1): a score per head, written to the ``importance`` table.

``importance.method: gradient`` estimates ``E|dL/dxi_h|`` on ``importance.data`` in a worker
(``headsweep.workers.analyses.importance.importance_on_worker``); ``lrp`` each head's share of the relevance of the
top-1 logit on ``importance.data`` (Voita et al. sec. 4; ``headsweep.workers.analyses.lrp``); ``ablation`` takes the
harm of each head's single-head ablation in this run (or in ``importance.from_run``): minus the delta where the
metric's higher is better, the delta where lower is (perplexity), see :func:`ablation_importance`.
The scores (normalised per layer or raw, as configured) are left in ``ctx.shared["importance"]`` for the
kinds that order heads by them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import refuse_eval_data, typed_data
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment, GatedHeads
from headsweep.sweep.experiments.importance.settings import ImportanceSection
from headsweep.sweep.experiments.importance.tables import IMPORTANCE_TABLE
from headsweep.sweep.experiments.importance.worker import load_data_on_worker
from headsweep.sweep.experiments.registry import experiment_kind
from headsweep.sweep.output.progress import step
from headsweep.workers.core.heads import Head, HeadInventory

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context

SHARED_KEY = "importance"


def importance_data(cfg: Config) -> Any:
    """``importance.data`` typed as the model family's data section."""
    return typed_data(cfg, cfg.importance.data, "importance.data")


class Importance(Experiment):
    """Head importance, estimated once per model (a resumed run reuses the scores it stored)."""

    name = "importance"
    orders_masks = True
    section = "importance"
    settings = ImportanceSection
    table = "importance"
    tables = (IMPORTANCE_TABLE,)

    def check_settings(self, cfg: Config) -> None:
        imp = cfg.importance
        imp.check()
        if imp.data is not None:
            importance_data(cfg)  # typed like the evaluation data, so a misspelt key fails here, not on a worker
        if cfg.sweep.order == "importance" and imp.method == "ablation" and not imp.from_run:
            raise HeadsweepError(
                "sweep.order: importance evaluates masks by importance estimated before the grid: set "
                "importance.method to gradient or lrp, or name an earlier run with importance.from_run"
            )

    def data_sections(self, cfg: Config) -> list[tuple[str, Any]]:
        return [("importance.data", importance_data(cfg))] if cfg.importance.method in ("gradient", "lrp") else []

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        if cfg.importance.method != "gradient":
            return []
        return [GatedHeads("importance.method", every_head=(
            "gradient importance scores every head of the model against its donor's activations",
            # lrp is not every model's (hf_seq2seq's FSMT refuses it): the line must not send a user to another refusal
            "use importance.method ablation with importance.from_run, or importance.method lrp where the model "
            "family supports it"))]

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
        if ctx.cfg.importance.method == "lrp":  # a model the rules do not cover (FSMT, PegasusX): refused here
            from headsweep.workers.analyses.lrp import lrp_problem_on_worker  # torch: on the workers

            problem = ctx.pool.call(lrp_problem_on_worker, importance_data(ctx.cfg))
            if problem:
                raise HeadsweepError(problem)

    def run(self, ctx: Context) -> None:
        stored = stored_importance(ctx) if ctx.done else None
        # A resumed run orders its pending pruning levels by the importance it already stored, so
        # they continue the same curve even where recomputing would not be bit-identical (GPU).
        ctx.shared[SHARED_KEY] = stored if stored is not None else self.estimate(ctx)

    def estimate(self, ctx: Context) -> dict[Head, float]:
        """Estimate and write the scores; returns them as pruning ranks them."""
        # Imported here: torch is loaded when a run estimates importance, not when a config is read.
        from headsweep.workers.analyses.importance import importance_on_worker, normalize_by_layer

        imp = ctx.cfg.importance
        if imp.method == "gradient":
            with step("gradient importance", enabled=ctx.show_progress, detail=ctx.pool.status_line):
                result = ctx.pool.call(importance_on_worker, importance_data(ctx.cfg), imp.per_token, imp.normalize, ())
            raw, normalized = result.raw, result.normalized
        elif imp.method == "lrp":
            from headsweep.workers.analyses.lrp import lrp_on_worker

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

    def report(self, part: ReportPart) -> None:
        from headsweep.sweep.experiments.importance.report import importance_part  # matplotlib: in the report only

        importance_part(part)


def only_for_order(cfg: Config) -> bool:
    """Whether importance joins the run only because ``sweep.order: importance`` asks for it (no kind the run
    lists is importance or needs it)."""
    if cfg.sweep.order != "importance":
        return False
    listed = [experiment_kind(name) for name in cfg.sweep.experiments]
    return not any(kind is IMPORTANCE or IMPORTANCE.name in kind.needs(cfg) for kind in listed)


def stored_importance(ctx: Context) -> dict[Head, float] | None:
    """The scores this run stored for ``ctx``'s checkpoint (as pruning ranks them), or None if there are none."""
    rows = [r for r in ctx.store.read("importance", ctx.run_id).to_pylist() if r["checkpoint"] == ctx.checkpoint]
    if not rows:
        return None
    column = "score_normalized" if ctx.cfg.importance.normalize else "score"
    return {Head(r["attention"], r["layer"], r["head"]): r[column] for r in rows}


def ablation_importance(store: Any, run_id: str, inventory: HeadInventory,
                        checkpoint: str | None = None) -> dict[Head, float]:
    """Importance from single-head ablation: the harm of removing the head (removing an important head
    hurts): minus the delta where higher is better (accuracy, BLEU), the delta where lower is (perplexity).

    Reads the ``single_head`` evaluations of ``run_id`` (of one training checkpoint, where the run
    has several) from the store; every head of the model must have one.
    """
    from headsweep.workers.core.metrics import higher_is_better

    columns = ["experiment", "attention", "layer", "head", "delta", "checkpoint", "metric"]
    rows = store.read("evaluations", run_id, columns=columns)
    harm = {
        Head(r["attention"], r["layer"], r["head"]): r["delta"] * (-1.0 if higher_is_better(r["metric"]) else 1.0)
        for r in rows.to_pylist()
        if r["experiment"] == "single_head" and r["checkpoint"] == checkpoint
    }
    missing = [h for h in inventory.heads if h not in harm]
    if missing:
        raise HeadsweepError(
            f"importance.method ablation: run {run_id} has no single_head evaluation of {len(missing)} heads "
            f"(e.g. {missing[0]}); run single_head on the same model first"
        )
    return {h: harm[h] for h in inventory.heads}


IMPORTANCE = Importance()
