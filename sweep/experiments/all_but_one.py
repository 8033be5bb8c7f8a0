"""``all_but_one`` (Michel et al. sec. 3.3): in one layer of one attention type, every head masked but one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.run.plan import attention_types
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


class AllButOne(Experiment):
    """One evaluation per (layer, kept head), reported under the kept head; eval id ``all_but_one/<head>``."""

    name = "all_but_one"
    section = "sweep"  # sweep.attention

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        units = []
        for shape in ctx.inventory.layers:
            if shape.attention not in types:
                continue
            heads = shape.heads()
            for kept in heads:
                masked = tuple(h for h in heads if h != kept)
                units.append(
                    WorkUnit(f"all_but_one/{kept}", "all_but_one", masked, kept.attention, kept.layer, kept.head)
                )
        return units


ALL_BUT_ONE = AllButOne()
