"""``single_head`` (Michel et al. sec. 3.2): every head masked alone, in the attention types of ``sweep.attention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.plan import attention_types
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.experiments.context import Context


class SingleHead(Experiment):
    """One evaluation per head, reported under that head; eval id ``single_head/<head>``."""

    name = "single_head"
    section = "sweep"  # sweep.attention

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        return [
            WorkUnit(f"single_head/{h}", "single_head", (h,), h.attention, h.layer, h.head)
            for h in ctx.inventory.heads
            if h.attention in types
        ]


SINGLE_HEAD = SingleHead()
