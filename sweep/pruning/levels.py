"""Pruning levels (Michel et al. sec. 4.2): which heads are masked at each level.

Heads are sorted by importance, least important first; level p masks the ceil(p * N) least
important heads of the N heads in scope (one attention type, or all). Masks are cumulative:
every level's mask contains the previous level's. A per-layer minimum keeps at least k heads
in every layer in scope: a head whose removal would break it is skipped, so the highest
levels may mask fewer than ceil(p * N) heads (``n_masked`` says how many were).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from headsweep.workers.core.heads import Head, HeadInventory


def heads_in_scope(inventory: HeadInventory, attention: Sequence[str] | None) -> list[Head]:
    return [h for h in inventory.heads if not attention or h.attention in attention]


def rank_ascending(scores: Mapping[Head, float], heads: Sequence[Head]) -> list[Head]:
    """Least important first; ties broken by head order so that levels are reproducible."""
    return sorted(heads, key=lambda h: (scores[h], h))


def _extend(mask: list[Head], order: Sequence[Head], target: int, inventory: HeadInventory, min_keep: int) -> None:
    masked_per_layer = Counter((h.attention, h.layer) for h in mask)
    taken = set(mask)
    for head in order:
        if len(mask) >= target:
            return
        if head in taken:
            continue
        key = (head.attention, head.layer)
        if inventory.layer(*key).num_heads - masked_per_layer[key] - 1 < min_keep:
            continue
        mask.append(head)
        taken.add(head)
        masked_per_layer[key] += 1


def level_masks(
    scores: Mapping[Head, float],
    inventory: HeadInventory,
    levels: Sequence[float],
    attention: Sequence[str] | None = None,
    min_heads_per_layer: int = 0,
) -> list[tuple[float, tuple[Head, ...]]]:
    """Masks for each level from one importance estimate (importance estimated once)."""
    return iterative_level_masks(lambda _mask: scores, inventory, levels, attention, min_heads_per_layer)


def iterative_level_masks(
    estimate: Callable[[tuple[Head, ...]], Mapping[Head, float]],
    inventory: HeadInventory,
    levels: Sequence[float],
    attention: Sequence[str] | None = None,
    min_heads_per_layer: int = 0,
) -> list[tuple[float, tuple[Head, ...]]]:
    """Masks for each level, re-estimating importance under the current mask before each step."""
    scope = heads_in_scope(inventory, attention)
    mask: list[Head] = []
    out = []
    for p in sorted(levels):
        target = math.ceil(p * len(scope) - 1e-9)
        if target > len(mask):
            scores = estimate(tuple(mask))
            _extend(mask, rank_ascending(scores, scope), target, inventory, min_heads_per_layer)
        out.append((p, tuple(mask)))
    return out
