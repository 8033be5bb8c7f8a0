"""``single_head`` (Michel et al. sec. 3.2): every head masked alone, in the attention types of ``sweep.attention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.run.plan import attention_types
from headsweep.workers.heads import Head
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


def single_head_unit(h: Head) -> WorkUnit:
    """The evaluation of head ``h`` masked alone (other kinds plan it under this id to share a stored one)."""
    return WorkUnit(f"single_head/{h}", "single_head", (h,), h.attention, h.layer, h.head)


class SingleHead(Experiment):
    """One evaluation per head, reported under that head; eval id ``single_head/<head>``."""

    name = "single_head"
    section = "sweep"  # sweep.attention

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        return [single_head_unit(h) for h in ctx.inventory.heads if h.attention in types]


SINGLE_HEAD = SingleHead()
