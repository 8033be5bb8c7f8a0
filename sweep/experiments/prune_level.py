"""``prune_level`` (Michel et al. sec. 4.2): at each level p, the ceil(p * N) least important heads masked.

Heads are ordered by the scores ``importance`` left in ``ctx.shared`` (or re-estimated under the
current mask before each step with ``prune.reestimate``); the masks come from
``headsweep.sweep.pruning.levels``. One evaluation per level, eval id ``prune_level/<scope>/<p>``.
With ``prune.uniform`` (``heads`` or ``kv_groups``) each level removes the same number of query heads per
key/value group, or of whole groups, from every layer (``headsweep.sweep.pruning.uniform``), so the pruned model is
a stock architecture; its scope is ``global-uniform_heads`` or ``global-uniform_kv_groups`` (the attention types
in place of ``global`` when ``prune.attention`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.results.views import PruningCurve
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment, GatedHeads
from headsweep.sweep.experiments.importance.kind import SHARED_KEY, importance_data
from headsweep.sweep.experiments.plan import check_attention_types
from headsweep.sweep.output.progress import step
from headsweep.sweep.pruning.levels import iterative_level_masks, level_masks
from headsweep.sweep.pruning.uniform import UNIFORM_UNITS, layers_in_scope, removable, uniform_level_masks
from headsweep.workers.core.heads import Head, HeadInventory
from headsweep.workers.core.setting_ranges import check_ranges, ranged
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


DEFAULT_LEVELS = [round(0.1 * i, 1) for i in range(11)]


@dataclass
class PruneSection:
    """Pruning levels (Michel et al. sec. 4.2): mask the ceil(p * N) least important heads."""

    levels: list[float] = ranged(default_factory=lambda: list(DEFAULT_LEVELS), at_least=0, at_most=1)
    attention: list[str] | None = None
    min_heads_per_layer: int = ranged(0, at_least=0)
    reestimate: bool = False
    uniform: str | None = None

    def check(self) -> None:
        if self.uniform is not None and self.uniform not in UNIFORM_UNITS:
            raise HeadsweepError(f"unknown prune.uniform {self.uniform!r} (known: {', '.join(UNIFORM_UNITS)}, or "
                                 "null for global levels)")
        check_ranges(self, "prune")


def prune_scope_name(attention: list[str] | None, uniform: str | None = None) -> str:
    """The scope in a level's eval id: ``global``, or the attention types joined by ``+``; with ``-uniform_heads``
    or ``-uniform_kv_groups`` after it for uniform levels."""
    return ("+".join(attention) if attention else "global") + (f"-uniform_{uniform}" if uniform else "")


def check_min_heads(min_heads: int, inventory: HeadInventory, attention: list[str] | None) -> None:
    """Refuse a ``prune.min_heads_per_layer`` that no layer in scope can keep (more than its heads), or that keeps
    every head of every layer in scope (each level would mask none)."""
    layers = [s for s in inventory.layers if not attention or s.attention in attention]
    short = [s for s in layers if s.num_heads < min_heads]
    if short:
        s = min(short, key=lambda s: s.num_heads)
        raise HeadsweepError(
            f"prune.min_heads_per_layer {min_heads} is more than the {s.num_heads} heads of {s.attention} layer "
            f"{s.layer}: a layer cannot keep more heads than it has; set it to {s.num_heads} or less"
        )
    if min_heads > 0 and layers and all(s.num_heads <= min_heads for s in layers):
        most = max(s.num_heads for s in layers)
        raise HeadsweepError(
            f"prune.min_heads_per_layer {min_heads} keeps every head: each layer in scope has {most} heads or fewer, "
            f"so no pruning level would mask any; set it below {most}"
        )


class PruneLevel(Experiment):
    """A pruning curve; ``attention`` of a level is its attention type when the scope is exactly one."""

    name = "prune_level"
    section = "prune"
    settings = PruneSection
    pruning_curve = PruningCurve("prune_level", "importance", levels=True)

    def check_settings(self, cfg: Config) -> None:
        cfg.prune.check()
        if cfg.prune.reestimate and cfg.importance.method != "gradient":
            raise HeadsweepError("prune.reestimate needs importance.method gradient")

    def check_config(self, cfg: Config) -> None:
        if not cfg.prune.levels:
            raise HeadsweepError("prune.levels is empty, so prune_level would evaluate nothing: list the shares of "
                                 "heads to prune (e.g. prune.levels=[0.1,0.5]), or leave prune_level out of "
                                 "sweep.experiments")

    def needs(self, cfg: Config) -> tuple[str, ...]:
        return ("importance",)

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        return [GatedHeads("prune.attention", attention=tuple(cfg.prune.attention or ()) or None)]

    def validate(self, ctx: Context) -> None:
        prune = ctx.cfg.prune
        if prune.attention:
            check_attention_types(prune.attention, ctx.inventory, "prune.attention")
        check_min_heads(prune.min_heads_per_layer, ctx.inventory, prune.attention)
        if prune.uniform:
            removable(self._layers(ctx), prune.uniform, prune.min_heads_per_layer)

    def _layers(self, ctx: Context):
        from headsweep.sweep.experiments.kv_group import layer_groups

        groups = {f"{s.attention}:{s.layer}": layer_groups(ctx, s.attention, s.layer, s.num_heads)
                  for s in ctx.inventory.layers}
        return layers_in_scope(ctx.inventory, groups, ctx.cfg.prune.attention)

    def plan(self, ctx: Context) -> list[WorkUnit]:
        scope = ctx.cfg.prune.attention
        self.validate(ctx)
        name = prune_scope_name(scope, ctx.cfg.prune.uniform)
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
            if prune.uniform:
                return uniform_level_masks(lambda _mask: scores, self._layers(ctx), prune.levels, prune.uniform,
                                           prune.min_heads_per_layer)
            return level_masks(scores, ctx.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)
        from headsweep.workers.analyses.importance import importance_on_worker  # torch: only when a run re-estimates

        data_cfg = importance_data(ctx.cfg)

        def estimate(mask: tuple[Head, ...]) -> dict[Head, float]:
            with step("importance re-estimate", enabled=ctx.show_progress, detail=ctx.pool.status_line):
                return ctx.pool.call(importance_on_worker, data_cfg, imp.per_token, imp.normalize, mask).scores

        if prune.uniform:
            return uniform_level_masks(estimate, self._layers(ctx), prune.levels, prune.uniform,
                                       prune.min_heads_per_layer)
        return iterative_level_masks(estimate, ctx.inventory, prune.levels, prune.attention, prune.min_heads_per_layer)


PRUNE_LEVEL = PruneLevel()
