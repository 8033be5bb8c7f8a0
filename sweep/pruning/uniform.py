"""Uniform pruning levels: the same number of heads, or of key/value groups, removed from every layer.

A model pruned so has one head count for every layer, which a stock Llama-style config can state
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim``): ``headsweep export`` then writes a folder that
stock ``from_pretrained`` loads (NVIDIA's Minitron prunes attention this way for the same reason).

``prune.uniform: heads`` removes at level p the ``r = ceil(p * G)`` least important query heads of every key/value
group (``G`` query heads per group), in every layer: each group keeps ``G - r`` query heads, so
``num_key_value_groups`` stays one integer. ``prune.uniform: kv_groups`` removes the ``r = ceil(p * K)`` least
important whole groups of every layer (``K`` key/value heads per layer): a key/value head with every query head
reading it, a group's importance being the sum of its query heads'. A model without grouped heads (plain multi-head
attention: one query head per key/value head) removes ``ceil(p * H)`` heads of every layer either way.

Masks are cumulative, as global levels are. ``prune.min_heads_per_layer`` caps ``r`` (the levels past the cap
mask what the cap allows, ``n_masked`` says how many); a minimum that allows no removal at all is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.heads import Head, HeadInventory

UNIFORM_UNITS = ("heads", "kv_groups")


@dataclass(frozen=True)
class LayerGroups:
    """One layer in scope and the query heads of each of its key/value groups (in key/value head order)."""

    attention: str
    layer: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def shape(self) -> tuple[int, int]:
        """(key/value groups, query heads per group)."""
        return len(self.groups), len(self.groups[0]) if self.groups else 0


def layers_in_scope(inventory: HeadInventory, groups: Mapping[str, Sequence[Sequence[int]]],
                    attention: Sequence[str] | None) -> list[LayerGroups]:
    """The layers of the scope with their key/value groups (``groups`` by ``attention:layer``; a layer without a
    record has one query head per group)."""
    out = []
    for shape in inventory.layers:
        if attention and shape.attention not in attention:
            continue
        recorded = groups.get(f"{shape.attention}:{shape.layer}")
        found = tuple(tuple(g) for g in recorded) if recorded else tuple((h,) for h in range(shape.num_heads))
        out.append(LayerGroups(shape.attention, shape.layer, found))
    return out


def removable(layers: Sequence[LayerGroups], unit: str, min_heads: int) -> int:
    """How many units (query heads per group, or groups per layer) every layer can lose and keep ``min_heads``;
    refuses a scope whose layers differ in shape and a minimum that allows none."""
    if unit not in UNIFORM_UNITS:
        raise HeadsweepError(f"unknown prune.uniform {unit!r} (known: {', '.join(UNIFORM_UNITS)}, or null)")
    shapes = {layer.shape for layer in layers}
    if len(shapes) > 1 or any(len(set(map(len, layer.groups))) > 1 for layer in layers):
        described = ", ".join(f"{a}:{b} has {k} key/value groups of {g}" for (a, b), (k, g) in
                              sorted({(lay.attention, lay.layer): lay.shape for lay in layers}.items())[:4])
        raise HeadsweepError(f"prune.uniform {unit} removes the same number from every layer, but the layers in "
                             f"scope differ ({described}): restrict prune.attention to layers of one shape, or set "
                             "prune.uniform: null")
    if not layers:
        return 0
    kv, size = _ungrouped_as_one(layers, unit)[0].shape
    if unit == "heads":
        most = size - math.ceil(min_heads / kv)  # each of the kv groups keeps size - r heads
        least_left = kv * (size - 1)
        what = f"removing one query head from each of the {kv} key/value groups"
    else:
        most = kv - math.ceil(min_heads / size)  # each layer keeps (kv - r) groups of size heads
        least_left = (kv - 1) * size
        what = f"removing one of the {kv} key/value groups (of {size} query heads)"
    if most < 1:
        raise HeadsweepError(f"prune.min_heads_per_layer {min_heads} cannot be met by prune.uniform {unit}: "
                             f"{what} leaves {least_left} heads per layer; set prune.min_heads_per_layer to "
                             f"{least_left} or less")
    return most


def uniform_level_masks(estimate: Callable[[tuple[Head, ...]], Mapping[Head, float]], layers: Sequence[LayerGroups],
                        levels: Sequence[float], unit: str, min_heads: int = 0) -> list[tuple[float, tuple[Head, ...]]]:
    """Masks for each level (``estimate`` is asked for scores under the current mask before each step that adds
    heads; with importance estimated once it returns the same scores every time)."""
    layers = _ungrouped_as_one(layers, unit)
    most = removable(layers, unit, min_heads)
    if not layers:
        return [(p, ()) for p in sorted(levels)]
    kv, size = layers[0].shape
    per = kv if unit == "kv_groups" else size
    mask: list[Head] = []
    done = 0
    out = []
    for p in sorted(levels):
        r = min(most, math.ceil(p * per - 1e-9))
        if r > done:
            scores = estimate(tuple(mask))
            for layer in layers:
                mask += _more(layer, scores, set(mask), r - done, unit)
            done = r
        out.append((p, tuple(sorted(mask))))
    return out


def _ungrouped_as_one(layers: Sequence[LayerGroups], unit: str) -> list[LayerGroups]:
    """Layers without grouped heads (one query head per group) as one group each when heads are removed: the
    same number of heads then leaves every layer, wherever they are."""
    if unit == "heads" and all(lay.shape[1] == 1 for lay in layers):
        return [LayerGroups(lay.attention, lay.layer, (tuple(h for g in lay.groups for h in g),)) for lay in layers]
    return list(layers)


def _more(layer: LayerGroups, scores: Mapping[Head, float], taken: set[Head], n: int, unit: str) -> list[Head]:
    """``n`` more units of one layer, least important first (ties: lower numbers first, so levels reproduce)."""
    def head(h: int) -> Head:
        return Head(layer.attention, layer.layer, h)

    if unit == "heads":
        out = []
        for group in layer.groups:
            left = [h for h in group if head(h) not in taken]
            out += [head(h) for h in sorted(left, key=lambda h: (scores[head(h)], h))[:n]]
        return out
    left = [(i, g) for i, g in enumerate(layer.groups) if head(g[0]) not in taken]
    ranked = sorted(left, key=lambda ig: (sum(scores[head(h)] for h in ig[1]), ig[0]))
    return [head(h) for _, g in ranked[:n] for h in g]
