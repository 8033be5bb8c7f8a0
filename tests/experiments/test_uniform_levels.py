"""Uniform pruning levels: every layer loses the same number of query heads per key/value group, or the same number
of whole groups, least important first within the layer; cumulative; capped by prune.min_heads_per_layer."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from headsweep.errors import HeadsweepError
from headsweep.sweep.pruning.uniform import layers_in_scope, uniform_level_masks
from headsweep.workers.core.heads import Head, HeadInventory, LayerShape

LEVELS = [round(0.1 * i, 1) for i in range(11)]


def gqa(layers: int = 3, heads: int = 8, kv: int = 2):
    inventory = HeadInventory([LayerShape("self", i, heads) for i in range(layers)])
    size = heads // kv
    groups = {f"self:{i}": [list(range(g * size, (g + 1) * size)) for g in range(kv)] for i in range(layers)}
    scores = {h: random.Random(str(h)).random() for h in inventory.heads}
    return inventory, layers_in_scope(inventory, groups, None), scores


def per_group(mask, size):
    return Counter((h.layer, h.head // size) for h in mask)


@pytest.mark.parametrize(("heads", "kv"), [(8, 2), (9, 3), (14, 2)])
def test_uniform_heads_remove_the_same_number_from_every_group(heads, kv):
    inventory, layers, scores = gqa(heads=heads, kv=kv)
    size = heads // kv
    masks = uniform_level_masks(lambda _m: scores, layers, LEVELS, "heads")
    for (p, mask), (_, before) in zip(masks[1:], masks[:-1], strict=True):
        assert set(before) <= set(mask)
        r = math.ceil(p * size - 1e-9)
        counts = per_group(mask, size)
        assert all(counts[(layer, g)] == r for layer in range(3) for g in range(kv)), (p, counts)
        for layer in range(3):  # within each group the r least important went
            for g in range(kv):
                group = [Head("self", layer, h) for h in range(g * size, (g + 1) * size)]
                assert {h for h in mask if h in group} == set(sorted(group, key=scores.__getitem__)[:r])
    assert masks[0] == (0.0, ()) and len(masks[-1][1]) == len(inventory.heads)


def test_uniform_kv_groups_remove_the_least_important_groups_by_summed_importance():
    inventory, layers, scores = gqa(heads=8, kv=4)
    masks = dict(uniform_level_masks(lambda _m: scores, layers, [0.0, 0.25, 0.5, 0.6, 1.0], "kv_groups"))
    for p, r in ((0.25, 1), (0.5, 2), (0.6, 3), (1.0, 4)):
        for layer in range(3):
            sums = sorted(range(4), key=lambda g: sum(scores[Head("self", layer, h)] for h in (2 * g, 2 * g + 1)))
            expected = {Head("self", layer, h) for g in sums[:r] for h in (2 * g, 2 * g + 1)}
            assert {h for h in masks[p] if h.layer == layer} == expected, (p, layer)


def test_min_heads_caps_the_levels_and_a_minimum_that_allows_nothing_is_refused():
    _, layers, scores = gqa(heads=8, kv=2)
    masks = dict(uniform_level_masks(lambda _m: scores, layers, LEVELS, "heads", min_heads=3))
    assert len(masks[1.0]) == 3 * 2 * 2  # each group keeps 2 heads: 4 per layer >= 3
    masks = dict(uniform_level_masks(lambda _m: scores, layers, LEVELS, "kv_groups", min_heads=4))
    assert len(masks[1.0]) == 3 * 4  # one group of 4 kept per layer
    with pytest.raises(HeadsweepError, match=r"prune.min_heads_per_layer 5 cannot be met by prune.uniform "
                                             r"kv_groups: .* leaves 4 heads per layer; set .* to 4 or less"):
        uniform_level_masks(lambda _m: scores, layers, LEVELS, "kv_groups", min_heads=5)
    with pytest.raises(HeadsweepError, match="cannot be met by prune.uniform heads"):
        uniform_level_masks(lambda _m: scores, layers, LEVELS, "heads", min_heads=7)


def test_reestimation_and_layers_of_other_shapes():
    inventory, layers, scores = gqa(heads=4, kv=2)
    seen = []

    def estimate(mask):
        seen.append(mask)
        return scores

    uniform_level_masks(estimate, layers, [0.0, 0.5, 0.6, 1.0], "heads")
    assert [len(m) for m in seen] == [0, 6]  # asked before each step that adds heads, under the mask so far
    mixed = HeadInventory([LayerShape("enc_self", 0, 4), LayerShape("dec_self", 0, 2)])
    with pytest.raises(HeadsweepError, match="the layers in scope differ"):
        uniform_level_masks(estimate, layers_in_scope(mixed, {}, None), LEVELS, "heads")
    only = layers_in_scope(mixed, {}, ["dec_self"])
    masks = dict(uniform_level_masks(lambda _m: {h: 0.0 for h in mixed.heads}, only, [0.5, 1.0], "heads"))
    assert masks[0.5] == (Head("dec_self", 0, 0),) and len(masks[1.0]) == 2  # ungrouped: ceil(p * 2) per layer
    masks = dict(uniform_level_masks(lambda _m: {h: 0.0 for h in mixed.heads}, only, [1.0], "heads", min_heads=1))
    assert masks[1.0] == (Head("dec_self", 0, 0),)
