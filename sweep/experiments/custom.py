"""``custom``: the user's masks (``sweep.masks``, lists of head names); giving masks asks for this kind."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment, GatedHeads
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


class Custom(Experiment):
    """One evaluation per mask; eval id ``custom/<heads, sorted, comma-separated>``."""

    name = "custom"
    section = "sweep"  # sweep.masks

    def implied(self, cfg: Config) -> bool:
        return bool(cfg.sweep.masks)

    def check_config(self, cfg: Config) -> None:
        if not cfg.sweep.masks:
            raise HeadsweepError("experiment 'custom' needs sweep.masks (a list of masks, each a list of head names)")

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        return [GatedHeads("sweep.masks", named=tuple(name for mask in cfg.sweep.masks for name in mask))]

    def validate(self, ctx: Context) -> None:
        self.plan(ctx)  # every head name is checked against the model's heads

    def plan(self, ctx: Context) -> list[WorkUnit]:
        units = []
        for mask in ctx.cfg.sweep.masks:
            heads = tuple(sorted({ctx.inventory.check(Head.parse(name)) for name in mask}))
            if not heads:
                raise HeadsweepError("sweep.masks holds an empty mask")
            units.append(WorkUnit("custom/" + ",".join(map(str, heads)), "custom", heads))
        return units


CUSTOM = Custom()
