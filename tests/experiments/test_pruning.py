"""Pruning-level masks: cumulative, per-layer minimum, attention-type restriction."""

from __future__ import annotations

import math
import random

import pytest

from headsweep.sweep.pruning.levels import iterative_level_masks, level_masks
from headsweep.workers.core.heads import Head, HeadInventory, LayerShape

LEVELS = [round(0.1 * i, 1) for i in range(11)]


def translation_inventory(layers: int = 2, heads: int = 4) -> HeadInventory:
    return HeadInventory([LayerShape(a, i, heads) for a in ("enc_self", "enc_dec", "dec_self") for i in range(layers)])


def random_scores(inventory: HeadInventory, seed: int = 0) -> dict[Head, float]:
    rng = random.Random(seed)
    return {h: rng.random() for h in inventory.heads}


def test_levels_are_cumulative_and_take_the_least_important():
    inv = translation_inventory()
    scores = random_scores(inv)
    masks = level_masks(scores, inv, LEVELS)
    n = len(inv.heads)
    by_importance = sorted(inv.heads, key=lambda h: scores[h])
    for (p, mask), (_, previous) in zip(masks[1:], masks[:-1], strict=True):
        assert set(previous) <= set(mask)
        assert len(mask) == math.ceil(p * n - 1e-9)
        assert set(mask) == set(by_importance[: len(mask)])
    assert masks[0] == (0.0, ())
    assert masks[-1][1] and len(masks[-1][1]) == n
    # ceil(0.3 * 24) = ceil(7.2) = 8 however the product rounds.
    assert len(dict(level_masks(scores, inv, [0.3]))[0.3]) == 8


def test_per_layer_minimum_is_respected():
    inv = translation_inventory(layers=3, heads=4)
    masks = level_masks(random_scores(inv, 1), inv, LEVELS, min_heads_per_layer=1)
    for _, mask in masks:
        for shape in inv.layers:
            masked = sum(1 for h in mask if (h.attention, h.layer) == (shape.attention, shape.layer))
            assert shape.num_heads - masked >= 1
    assert len(masks[-1][1]) == len(inv.heads) - len(inv.layers)


@pytest.mark.parametrize("attention", ["enc_self", "enc_dec", "dec_self"])
def test_restriction_to_one_attention_type(attention):
    inv = translation_inventory()
    masks = dict(level_masks(random_scores(inv, 2), inv, LEVELS, attention=[attention]))
    assert all(h.attention == attention for mask in masks.values() for h in mask)
    assert set(masks[1.0]) == {h for h in inv.heads if h.attention == attention}
    assert len(masks[0.5]) == 4


def test_reestimation_sees_the_current_mask():
    inv = translation_inventory()
    seen: list[tuple[Head, ...]] = []

    def estimate(mask):
        seen.append(mask)
        # A score that changes with the mask: heads in layers already pruned look less important.
        pruned_layers = {(h.attention, h.layer) for h in mask}
        return {h: (0.0 if (h.attention, h.layer) in pruned_layers else 1.0) + h.head / 10 for h in inv.heads}

    masks = iterative_level_masks(estimate, inv, [0.0, 0.25, 0.5])
    assert seen[0] == () and seen[1] == masks[1][1]
    assert len(seen) == 2  # level 0 needs no estimate
    first = masks[1][1]
    layers_first = {(h.attention, h.layer) for h in first}
    # The second step prefers the layers the first step already pruned.
    assert all((h.attention, h.layer) in layers_first for h in masks[2][1][len(first):][:1])
