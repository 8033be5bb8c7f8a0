"""``kv_group``: every query head that reads one key/value head, masked together (grouped-query attention).

With grouped-query attention (H query heads, H_kv key/value heads) query head h reads key/value head
``h // (H / H_kv)``; masking the whole group is what removing that key/value head would remove. The
groups come from the model (``DatasetInfo.facts["kv_groups"]``, recorded by families that know them,
e.g. ``hf_causal_lm``). A model without grouped heads (plain multi-head attention, or a family that
records no groups) is not an error: each group is one query head; ``runs.facts["kv_group"]`` says so, and
so does a ``headsweep: warning:`` line on the terminal.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.plan import attention_types
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context

logger = logging.getLogger(__name__)  # headsweep's logger: its warnings reach the terminal

FACT = "kv_group"
UNGROUPED = "the model has no grouped key/value heads: each kv_group is one query head (the same masks as single_head)"


def layer_groups(ctx: Context, attention: str, layer: int, num_heads: int) -> list[list[int]]:
    """The query heads of each key/value head of one layer (one head per group when the model records none)."""
    recorded = (ctx.info.facts.get("kv_groups") or {}).get(f"{attention}:{layer}")
    return [list(g) for g in recorded] if recorded else [[h] for h in range(num_heads)]


class KVGroup(Experiment):
    """One evaluation per (layer, key/value head); eval id ``kv_group/<attention>:<layer>:kv<group>``, the
    masked query heads in ``heads_masked``, ``head`` null (the row stands for a group, not a head)."""

    name = "kv_group"
    section = "sweep"  # sweep.attention

    def validate(self, ctx: Context) -> None:
        grouped = any(len(g) > 1 for shape in ctx.inventory.layers
                      for g in layer_groups(ctx, shape.attention, shape.layer, shape.num_heads))
        # Recorded with the run (runs.facts), which is written after validation.
        ctx.info.facts[FACT] = "masks every query head of each key/value head" if grouped else UNGROUPED
        if not grouped:
            logger.warning("kv_group: the model has no grouped key/value heads (each layer has as many key/value "
                           "heads as query heads): its %d kv_group masks are one query head each, the same masks as "
                           "single_head", len(self.plan(ctx)))

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        units = []
        for shape in ctx.inventory.layers:
            if shape.attention not in types:
                continue
            for g, heads in enumerate(layer_groups(ctx, shape.attention, shape.layer, shape.num_heads)):
                masked = tuple(ctx.inventory.check(Head(shape.attention, shape.layer, h)) for h in heads)
                units.append(WorkUnit(f"kv_group/{shape.attention}:{shape.layer}:kv{g}", self.name, masked,
                                      shape.attention, shape.layer, None))
        return units


KV_GROUP = KVGroup()
