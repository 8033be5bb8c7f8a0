"""Planning helpers shared by the experiment kinds (and the run context that orders their work).

Evaluation ids are derived from what is evaluated (experiment and mask), never from timing,
so a resumed run recognises the evaluations it already stored. A run over several training
checkpoints puts ``ckpt<i>/`` in front of every id of checkpoint i.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.core.heads import Head, HeadInventory
from headsweep.workers.core.work import WorkUnit


def check_attention_types(wanted: Sequence[str], inventory: HeadInventory, key: str) -> None:
    """Every attention type in ``wanted`` (config key ``key``) is one the model has."""
    have = inventory.attention_types
    for a in wanted:
        if a not in have:
            raise HeadsweepError(f"{key}: this model has no {a!r} attention (it has {', '.join(have)})")


def attention_types(cfg: Config, inventory: HeadInventory) -> list[str]:
    """The attention types a grid covers: ``sweep.attention``, or all of the model's, in the model's order."""
    wanted = cfg.sweep.attention
    have = inventory.attention_types
    if not wanted:
        return have
    check_attention_types(wanted, inventory, "sweep.attention")
    return [a for a in have if a in wanted]


def with_prefix(units: Iterable[WorkUnit], prefix: str) -> list[WorkUnit]:
    """``units`` with ``prefix`` in front of their eval ids (the checkpoint of a run over several)."""
    return [dataclasses.replace(u, eval_id=prefix + u.eval_id) if prefix else u for u in units]


def unique(units: Iterable[WorkUnit]) -> list[WorkUnit]:
    """``units`` without repeated eval ids (the first one stays), in their order."""
    seen: set[str] = set()
    return [u for u in units if not (u.eval_id in seen or seen.add(u.eval_id))]


def by_importance(units: Sequence[WorkUnit], scores: Mapping[Head, float]) -> list[WorkUnit]:
    """``units`` with the masks of the most important heads first (``sweep.order: importance``).

    A mask's expected effect is the summed importance of the heads it gates off (heads without a score count 0);
    ties keep their planned order, so the order is deterministic.
    """
    def expected(unit: WorkUnit) -> float:
        return sum(scores.get(head, 0.0) for head in unit.masked)

    return sorted(units, key=lambda u: -expected(u))
