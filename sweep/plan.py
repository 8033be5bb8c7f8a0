"""Planning: which masks a sweep evaluates, each with a stable evaluation id.

Evaluation ids are derived from what is evaluated (experiment and mask), never from timing,
so a resumed run recognises the evaluations it already stored.
"""

from __future__ import annotations

from headsweep.errors import HeadsweepError
from headsweep.sweep.config import Config
from headsweep.workers.heads import Head, HeadInventory
from headsweep.workers.work import WorkUnit

BASELINE = WorkUnit("baseline", "baseline", ())


def _attention_types(cfg: Config, inventory: HeadInventory) -> list[str]:
    wanted = cfg.sweep.attention
    have = inventory.attention_types
    if not wanted:
        return have
    for a in wanted:
        if a not in have:
            raise HeadsweepError(f"sweep.attention: this model has no {a!r} attention (it has {', '.join(have)})")
    return [a for a in have if a in wanted]


def single_head(inventory: HeadInventory, types: list[str]) -> list[WorkUnit]:
    """Michel et al. sec. 3.2: every head masked alone."""
    return [
        WorkUnit(f"single_head/{h}", "single_head", (h,), h.attention, h.layer, h.head)
        for h in inventory.heads
        if h.attention in types
    ]


def all_but_one(inventory: HeadInventory, types: list[str]) -> list[WorkUnit]:
    """Michel et al. sec. 3.3: in one layer, every head masked except the kept one."""
    units = []
    for shape in inventory.layers:
        if shape.attention not in types:
            continue
        heads = shape.heads()
        for kept in heads:
            masked = tuple(h for h in heads if h != kept)
            units.append(
                WorkUnit(f"all_but_one/{kept}", "all_but_one", masked, kept.attention, kept.layer, kept.head)
            )
    return units


def custom(inventory: HeadInventory, masks: list[list[str]]) -> list[WorkUnit]:
    """User-given masks, checked against the model's heads."""
    units = []
    for mask in masks:
        heads = tuple(sorted({inventory.check(Head.parse(name)) for name in mask}))
        if not heads:
            raise HeadsweepError("sweep.masks holds an empty mask")
        units.append(WorkUnit("custom/" + ",".join(map(str, heads)), "custom", heads))
    return units


def plan(cfg: Config, inventory: HeadInventory) -> list[WorkUnit]:
    """Every evaluation of a sweep, the baseline first, without duplicates."""
    types = _attention_types(cfg, inventory)
    units = [BASELINE]
    for exp in cfg.sweep.experiments:
        if exp == "single_head":
            units += single_head(inventory, types)
        elif exp == "all_but_one":
            units += all_but_one(inventory, types)
        elif exp == "custom":
            units += custom(inventory, cfg.sweep.masks)
    seen: set[str] = set()
    return [u for u in units if not (u.eval_id in seen or seen.add(u.eval_id))]


def prune_scope_name(attention: list[str] | None) -> str:
    return "+".join(attention) if attention else "global"


def prune_levels(cfg: Config, inventory: HeadInventory, masks: list[tuple[float, tuple[Head, ...]]]) -> list[WorkUnit]:
    """One evaluation per pruning level; ``attention`` holds the restricted type (null: global)."""
    scope = cfg.prune.attention
    if scope:
        _attention_types_named(scope, inventory)
    name = prune_scope_name(scope)
    attention = scope[0] if scope and len(scope) == 1 else None
    return [
        WorkUnit(f"prune_level/{name}/{p:.4f}", "prune_level", mask, attention, level=p) for p, mask in masks
    ]


def _attention_types_named(wanted: list[str], inventory: HeadInventory) -> None:
    have = inventory.attention_types
    for a in wanted:
        if a not in have:
            raise HeadsweepError(f"prune.attention: this model has no {a!r} attention (it has {', '.join(have)})")
