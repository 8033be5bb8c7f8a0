"""``prune_level`` (Michel et al. sec. 4.2): at each level p, the ceil(p * N) least important heads masked.

Heads are ordered by the scores ``importance`` left in ``ctx.shared`` (or re-estimated under the
current mask before each step with ``prune.reestimate``); the masks come from
``headsweep.sweep.pruning``. One evaluation per level, eval id ``prune_level/<scope>/<p>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.importance import SHARED_KEY, importance_data
from headsweep.sweep.plan import check_attention_types
from headsweep.sweep.progress import step
from headsweep.sweep.pruning import iterative_level_masks, level_masks
from headsweep.sweep.sections import Config
from headsweep.workers.heads import Head
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.experiments.context import Context


def prune_scope_name(attention: list[str] | None) -> str:
    """The scope in a level's eval id: ``global``, or the attention types joined by ``+``."""
    return "+".join(attention) if attention else "global"


class PruneLevel(Experiment):
    """A pruning curve; ``attention`` of a level is its attention type when the scope is exactly one."""

    name = "prune_level"
    section = "prune"

    def needs(self, cfg: Config) -> tuple[str, ...]:
        return ("importance",)

    def validate(self, ctx: Context) -> None:
        if ctx.cfg.prune.attention:
            check_attention_types(ctx.cfg.prune.attention, ctx.inventory, "prune.attention")

    def plan(self, ctx: Context) -> list[WorkUnit]:
        scope = ctx.cfg.prune.attention
        self.validate(ctx)
        name = prune_scope_name(scope)
        attention = scope[0] if scope and len(scope) == 1 else None
        return [
            WorkUnit(f"prune_level/{name}/{p:.4f}", "prune_level", mask, attention, level=p)
            for p, mask in self.masks(ctx)
        ]

    def masks(self, ctx: Context) -> list[tuple[float, tuple[Head, ...]]]:
        """``(level, mask)`` for each level, least important heads first."""
        prune, imp = ctx.cfg.prune, ctx.cfg.importance
        if not prune.reestimate:
            scores = ctx.shared[SHARED_KEY]
            return level_masks(scores, ctx.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)
        from headsweep.workers.importance import importance_on_worker  # torch: only when a run re-estimates

        data_cfg = importance_data(ctx.cfg)

        def estimate(mask: tuple[Head, ...]) -> dict[Head, float]:
            with step("importance re-estimate", enabled=ctx.show_progress, detail=ctx.pool.status_line):
                return ctx.pool.call(importance_on_worker, data_cfg, imp.per_token, imp.normalize, mask).scores

        return iterative_level_masks(estimate, ctx.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)


PRUNE_LEVEL = PruneLevel()
