"""The family contract: the same checks on every model family, through the family's public contract only
(``ModelFamily`` and the ``EvalAdapter`` its ``load`` returns; ``headsweep export``'s ``export_pruned``).

Each check compares one route with an independent one over the same evaluation (``MaskOutput``: outputs,
per-example statistics, loss):

* gate == weight surgery, for every single head and every all-but-one mask: the gated model against a second
  load of the model with its gate hooks taken off and the heads' output-projection input columns zeroed;
* reuse == plain: ``sweep.reuse`` true (prefix or encoder reuse) against false, one mask per pass;
* packed == one mask per pass: many masks in one forward pass (``sweep.masks_per_batch``), with and without reuse;
* pruned == gated: heads physically removed (``ModelFamily.prune``), with the parameter drop counted from the
  config's head shapes;
* export round trip: ``export_pruned`` writes the pruned model, the family loads it back from the folder, and it
  computes what the pruned model in memory computes;
* training data is held out: importance (and L0) data that is the evaluation set is refused; held-out data is
  accepted and its gradient importance scores every head.
* weight bytes: what the driver's memory check counts per worker (``ModelFamily.weight_bytes``, from the files)
  against the parameters the loaded model holds.

The plain reference is ``sweep.reuse: false``, one mask per pass, ``sweep.fused_attention: false``. Every
numeric comparison is exact (``rtol=0``) where both routes run the same arithmetic, else within the
summation-order bound of tests/tolerances.py (the case's ``bound``), as each comparison's comment says.

The exactness checks (gate == weight surgery, reuse == plain, packed == one mask per pass) and the weight bytes take
``dtype`` and run in every dtype of the case (``FamilyCase.dtypes``: bfloat16 too for the transformers families), the
bound then the one tests/tolerances.py derives for that dtype; the other checks run on the model as built (float32).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import assert_routes_agree, route_bound
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.pruning.export import MANIFEST, export_pruned
from headsweep.workers.analyses.importance import gradient_importance
from headsweep.workers.core.family import EvalAdapter, MaskOutput
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.heads import Head, HeadInventory
from headsweep.workers.families.registry import model_family
from headsweep.workers.pruning.removal import count_parameters

from .cases import Built, FamilyCase, HeadParams, removed_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = {"reuse": False, "masks_per_batch": 1, "fused_attention": False}
# Uneven against every case's batches and mask counts, so chunks of several sizes run.
PACKED = 5

Mask = tuple[Head, ...]


# -- the routes ------------------------------------------------------------------------------------------------

def load_adapter(case: FamilyCase, built: Built, *, model: dict | None = None, data: dict | None = None,
                 **runtime) -> EvalAdapter:
    """The family's evaluation adapter, as a worker loads it from the config's sections."""
    family = model_family(built.model["kind"])
    model_cfg = from_dict(family.model_config, model or built.model, "model")
    data_cfg = from_dict(family.data_config, data or built.data, "data")
    return family.load(model_cfg, data_cfg, family.runtime(**{**case.runtime, **runtime}))


def ungated(adapter: EvalAdapter) -> EvalAdapter:
    """``adapter`` with its gate hooks taken off (and the library's own settings back): it runs the stock model,
    whatever its weights are made to be."""
    adapter.gates.remove()
    assert not any(s.out_proj._forward_pre_hooks for s in adapter.gates.sites)
    return adapter


@contextmanager
def weight_surgery(sites: Sequence[AttentionSite], heads: Sequence[Head]) -> Iterator[None]:
    """The heads' input columns of their output projection set to zero in place (rows of a transposed
    ``Conv1D``, GPT-2's), and put back after."""
    by_key = {s.key: s for s in sites}
    saved = []
    with torch.no_grad():
        for h in heads:
            site = by_key[(h.attention, h.layer)]
            span = slice(h.head * site.head_dim, (h.head + 1) * site.head_dim)
            index = (slice(None), span) if isinstance(site.out_proj, nn.Linear) else (span, slice(None))
            weight = site.out_proj.weight
            saved.append((weight, index, weight[index].clone()))
            weight[index] = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, index, values in reversed(saved):
                weight[index] = values


def grid(inventory: HeadInventory) -> dict[str, list[Mask]]:
    """Every single head, every all-but-one mask, and masks over several layers (and attention types)."""
    layers = inventory.layers
    first, last = layers[0], layers[-1]
    middle = layers[len(layers) // 2]
    spanning = [(first.heads()[0], last.heads()[-1]),
                (*middle.heads()[:2], last.heads()[0])]
    return {
        "single_head": [(h,) for h in inventory.heads],
        "all_but_one": [tuple(h for h in s.heads() if h != kept) for s in layers for kept in s.heads()],
        "spanning": [tuple(sorted(set(m))) for m in spanning],
    }


def pruning_masks(inventory: HeadInventory, params: HeadParams) -> dict[str, Mask]:
    """A random third of the heads with one whole layer, one head left per layer, every head; with grouped
    key/value heads, a whole key/value group of the first layer with one head of another group."""
    rng = random.Random(0)
    heads = inventory.heads
    random_third = {h for h in heads if rng.random() < 0.35}
    masks = {
        "random_and_a_layer": tuple(sorted(random_third | set(inventory.layers[-1].heads()))),
        "one_left_per_layer": tuple(h for s in inventory.layers for h in s.heads() if h.head != s.layer % s.num_heads),
        "every_head": tuple(heads),
    }
    first = inventory.layers[0]
    group = first.num_heads // params.kv_heads
    if group > 1:
        masks["kv_group"] = (*first.heads()[:group], first.heads()[-1])
    return masks


def assert_same(got: MaskOutput, want: MaskOutput, *, exact: bool, bound: dict[str, int], what: object) -> None:
    """One evaluation against another: the same outputs, and statistics and losses equal (``exact``) or
    within the summation-order bound."""
    assert got.outputs == want.outputs, f"{what}: outputs differ"
    assert (got.loss is None) == (want.loss is None), what
    if exact:
        np.testing.assert_array_equal(got.stats, want.stats, err_msg=f"{what}: stats")
        if want.loss is not None:
            np.testing.assert_array_equal(got.loss, want.loss, err_msg=f"{what}: loss")
        assert got.score == want.score, what
    else:
        assert_routes_agree(got.stats, want.stats, **bound, what=f"{what}: stats")
        if want.loss is not None:
            assert_routes_agree(got.loss, want.loss, **bound, what=f"{what}: loss")


def moved(got: MaskOutput, base: MaskOutput, bound: dict[str, Any], exact: bool = False) -> bool:
    """Whether a mask moved some example's loss beyond the summation-order bound (a route can fail); for an
    ``exact`` comparison, whether it moved it at all (any change fails an exact comparison)."""
    if exact:
        return not np.array_equal(got.loss, base.loss)
    return float(np.abs(got.loss - base.loss).max()) > route_bound(base.loss, **bound)


def bound_in(case: FamilyCase, dtype: str) -> dict[str, Any]:
    """The case's summation-order bound for routes computed in ``dtype`` (``route_bound``'s keywords)."""
    return {**case.bound, "dtype": getattr(torch, dtype)}


@dataclass
class Reference:
    """The plain reference path of one case, evaluated once over the grid (more masks on demand)."""

    adapter: EvalAdapter
    masks: dict[str, list[Mask]]
    outputs: dict[Mask, MaskOutput] = field(default_factory=dict)
    widest: int = 0  # the most rows the last attention module saw in one call, one mask per pass

    @property
    def all_masks(self) -> list[Mask]:
        return [(), *(m for group in self.masks.values() for m in group)]

    def __getitem__(self, mask: Sequence[Head]) -> MaskOutput:
        key = tuple(mask)
        if key not in self.outputs:
            self.outputs[key] = self.adapter.evaluate([list(key)])[0]
        return self.outputs[key]


@contextmanager
def rows_seen(site: AttentionSite) -> Iterator[list[int]]:
    """The batch rows of every call of ``site``'s output projection (how many masks one pass carries)."""
    rows: list[int] = []
    handle = site.out_proj.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[site.batch_dim]))
    try:
        yield rows
    finally:
        handle.remove()


def plain_reference(case: FamilyCase, built: Built) -> Reference:
    """The plain path of ``built``'s model evaluated over the grid."""
    adapter = load_adapter(case, built, **PLAIN)
    assert adapter.describe().facts["reuse"].startswith("off")
    ref = Reference(adapter, grid(adapter.gates.inventory))
    with rows_seen(adapter.gates.sites[-1]) as rows:
        outputs = adapter.evaluate([list(m) for m in ref.all_masks])
    ref.outputs = dict(zip(ref.all_masks, outputs, strict=True))
    ref.widest = max(rows)
    return ref


@pytest.fixture(scope="module")
def references(case: FamilyCase, built: Built) -> Callable[[str], Reference]:
    """The case's plain reference in a dtype, evaluated when a check first asks for it."""
    cache: dict[str, Reference] = {}

    def reference(dtype: str) -> Reference:
        if dtype not in cache:
            cache[dtype] = plain_reference(case, built.in_dtype(dtype))
        return cache[dtype]

    return reference


@pytest.fixture(scope="module")
def plain(references) -> Reference:
    """The plain reference of the model as built."""
    return references("float32")


# -- the checks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["single_head", "all_but_one"])
def test_gate_equals_weight_surgery(case, built, references, dtype, kind):
    """The gated model against the stock model (no hooks) with the masked heads' W_O input columns zeroed."""
    built, plain = built.in_dtype(dtype), references(dtype)
    surgery = ungated(load_adapter(case, built, **PLAIN))
    if case.same_path:
        case.same_path(surgery.model)
    (base,) = surgery.evaluate([[]])
    # exact: an ungated module runs the stock arithmetic (a site without a gate set returns from its hook)
    assert_same(plain[()], base, exact=True, bound=case.bound, what="no mask")
    for mask in plain.masks[kind]:
        with weight_surgery(surgery.gates.sites, mask):
            (expected,) = surgery.evaluate([[]])
        # exact: a gate of 0 and zeroed W_O columns feed the same matrix product (same shapes) the same zeros
        assert_same(plain[mask], expected, exact=True, bound=case.bound, what=mask)
        # other: the route can fail: a gate that did not act would leave the loss at the baseline's
        assert not np.array_equal(plain[mask].loss, base.loss), f"{mask} changes nothing"
    (after,) = surgery.evaluate([[]])
    assert_same(after, base, exact=True, bound=case.bound, what="weights put back")  # exact: the same model


def test_reuse_equals_plain(case, built, references, dtype):
    """The family's reuse strategy (``sweep.reuse: true``) against the plain path, one mask per pass."""
    built, plain, bound = built.in_dtype(dtype), references(dtype), bound_in(case, dtype)
    reused = load_adapter(case, built, reuse=True, masks_per_batch=1)
    note = reused.describe().facts["reuse"]
    assert not note.startswith(("off", "plain path")), note  # reuse really runs on this model
    masks = plain.all_masks
    for mask, got in zip(masks, reused.evaluate([list(m) for m in masks]), strict=True):
        # exact where the family replays the plain path's arithmetic on the same shapes (case.exact_reuse); else
        # summation order: cached states reach the rest of the model in other batch shapes
        assert_same(got, plain[mask], exact=case.exact_reuse, bound=bound, what=mask)
    # other: routes can fail: most masks move the loss by more than the comparison lets through
    assert sum(moved(plain[m], plain[()], bound, exact=case.exact_reuse) for m in masks) >= len(masks) // 2


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "reuse"])
def test_packed_equals_one_mask_per_pass(case, built, references, dtype, reuse):
    """Several masks per forward pass (per-example gates on a repeated batch) against one mask per pass."""
    built, plain, bound = built.in_dtype(dtype), references(dtype), bound_in(case, dtype)
    packed = load_adapter(case, built, reuse=reuse, masks_per_batch=PACKED)
    masks = plain.all_masks
    with rows_seen(packed.gates.sites[-1]) as rows:
        outputs = packed.evaluate([list(m) for m in masks])
    assert max(rows) > plain.widest, "no pass carried more than one mask"
    for mask, got in zip(masks, outputs, strict=True):
        # summation order: several masks in one pass multiply taller matrices than one mask alone
        assert_same(got, plain[mask], exact=False, bound=bound, what=mask)


def test_weight_bytes_cover_the_loaded_model(case, built, references, dtype):
    """``ModelFamily.weight_bytes``, what the driver's memory check counts per worker before any loads the model,
    against the parameters a loaded model holds."""
    built, plain = built.in_dtype(dtype), references(dtype)
    family = model_family(built.model["kind"])
    estimate = family.weight_bytes(from_dict(family.model_config, built.model, "model"))
    held = sum(p.numel() * p.element_size() for p in plain.adapter.model.parameters())
    # other: never below them, and above them by what the files add: nothing where the headers are counted
    # (transformers), a checkpoint's pickled options where its size is (fairseq; these carry no optimizer state)
    assert held <= estimate <= held + 64 * 1024, (estimate, held)


def pruned_adapter(case: FamilyCase, built: Built, mask: Sequence[Head]) -> tuple[EvalAdapter, int]:
    """A fresh adapter whose model has ``mask`` physically removed by the family (no hooks); the parameter drop."""
    adapter = ungated(load_adapter(case, built, reuse=False, masks_per_batch=1))
    before = count_parameters(adapter.model)
    model_family(built.model["kind"]).prune(adapter.model, list(mask))
    return adapter, before - count_parameters(adapter.model)


def test_pruned_equals_gated(case, built, plain):
    """Heads removed from the weights against the same heads gated, and the parameter drop the head shapes give."""
    inventory = plain.adapter.gates.inventory
    for name, mask in pruning_masks(inventory, built.params).items():
        pruned, drop = pruned_adapter(case, built, mask)
        assert drop == removed_parameters(built.params, inventory, list(mask)), name
        (got,) = pruned.evaluate([[]])
        # summation order: the pruned model's projections are narrower than the gated model's
        assert_same(got, plain[mask], exact=False, bound=case.bound, what=name)
        assert moved(got, plain[()], case.bound), f"{name}: pruning changed nothing"  # other: the route can fail
    # other: the bound admits rounding, not a head: one head of a mask left in place fails the comparison
    mask = pruning_masks(inventory, built.params)["random_and_a_layer"]
    one_short, _ = pruned_adapter(case, built, mask[1:])
    assert moved(one_short.evaluate([[]])[0], plain[mask], case.bound), f"{mask[0]} left in goes unnoticed"


def test_export_round_trip(case, built, plain, tmp_path):
    """``headsweep export`` of a pruned model, loaded back through the family from the folder it wrote."""
    inventory = plain.adapter.gates.inventory
    mask = pruning_masks(inventory, built.params)["random_and_a_layer"]
    out = export_pruned(build_config({"model": built.model, "data": built.data}), tmp_path / "pruned",
                        mask=[str(h) for h in mask])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["heads_removed"] == [str(h) for h in mask]
    assert manifest["n_params_full"] - manifest["n_params_pruned"] == removed_parameters(built.params, inventory,
                                                                                         list(mask))
    kept = {(s.attention, s.layer): [h.head for h in s.heads() if h not in mask] for s in inventory.layers}
    # every layer, each with its surviving heads' old numbers (a layer left whole lists all of its heads)
    assert manifest["heads_kept"] == {f"{a}:{layer}": heads for (a, layer), heads in kept.items()}

    reloaded = load_adapter(case, built, model=case.exported(built.model, out), reuse=False, masks_per_batch=1)
    swept = {(s.attention, s.layer): s.num_heads for s in reloaded.describe().inventory.layers if s.num_heads}
    assert swept == {key: len(heads) for key, heads in kept.items() if heads}  # only the kept heads are swept
    in_memory, _ = pruned_adapter(case, built, mask)
    (got,) = reloaded.evaluate([[]])
    # exact: the same weights in modules of the same shapes, run by the same kernels
    assert_same(got, in_memory.evaluate([[]])[0], exact=True, bound=case.bound, what="reloaded vs in memory")
    # summation order: the pruned model's narrower projections against the gated full model
    assert_same(got, plain[mask], exact=False, bound=case.bound, what="reloaded vs gated")


@pytest.mark.parametrize("key", ["importance", "l0"])
def test_training_data_must_be_held_out(case, built, key):
    """``<key>.data`` (the data importance is estimated on, or L0 gates trained on) must not be the evaluation set."""
    extra = {"method": "gradient"} if key == "importance" else {}

    def config(data: dict, **more) -> dict:
        return {"model": built.model, "data": built.data, "sweep": {"experiments": [key]},
                key: {**extra, "data": data, **more}}

    build_config(config(built.heldout))  # held-out data: accepted
    for same in (built.data, {**built.data, "name": "heldout"}):  # the evaluation set, under any name
        with pytest.raises(HeadsweepError, match=f"{key}.data is the evaluation set"):
            build_config(config(same))
    with pytest.raises(HeadsweepError, match=f"{key}.data looks like a test split"):
        build_config(config({**built.heldout, "name": "test"}))
    build_config(config(built.data, allow_eval_data=True))  # asked for explicitly: accepted


def test_evaluation_set_by_another_path_is_refused(case, built):
    """The evaluation set's files named by another path (relative to the working directory) are still the
    evaluation set."""
    relative = {k: os.path.relpath(v) if isinstance(v, str) and os.path.exists(v) else v
                for k, v in built.data.items()}
    assert relative != built.data
    for key, extra in (("importance", {"method": "gradient"}), ("l0", {})):
        with pytest.raises(HeadsweepError, match=f"{key}.data is the evaluation set"):
            build_config({"model": built.model, "data": built.data, "sweep": {"experiments": [key]},
                          key: {**extra, "data": relative}})


def test_gradient_importance_on_held_out_data(case, built, plain):
    """Importance estimated through the family's loss batches on held-out data scores every head."""
    heldout = load_adapter(case, built, data=built.heldout)
    result = gradient_importance(heldout, per_token=True, normalize=True)
    heads = plain.adapter.gates.inventory.heads
    assert set(result.scores) == set(heads)
    values = np.array([result.scores[h] for h in heads])
    assert np.isfinite(values).all() and (values >= 0).all()
    for shape in plain.adapter.gates.inventory.layers:  # normalised: each layer's scores have unit length
        layer = np.array([result.scores[h] for h in shape.heads()])
        assert np.linalg.norm(layer) == pytest.approx(1.0)  # other: float64 division by the layer's norm


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "batch_level"])
def test_importance_within_a_backward_budget_equals_whole_batches(case, built, per_token):
    """Gradient importance with its loss batches cut to one row each and the blocks checkpointed (the backward
    pass's memory budget, headsweep.workers.memory.backward_memory) scores every head as plain autograd over whole
    batches does. Batch-level importance takes a whole batch's gradient sum: the pieces of a batch are summed first."""
    whole = load_adapter(case, built, data=built.heldout)
    if not hasattr(whole, "backward_budget"):
        pytest.skip(f"{case.id}: the family keeps whole loss batches (sized by sweep.max_tokens, no backward budget)")
    whole.backward_budget = 1 << 60
    want = gradient_importance(whole, per_token=per_token, checkpoint=False)
    magnitude = want if per_token else gradient_importance(whole, per_token=True, checkpoint=False)
    cut = load_adapter(case, built, data=built.heldout)
    cut.backward_budget = 1
    batches = cut.loss_batches(None, torch.float32).batches
    assert len(batches) == sum(b.n_examples for b in batches)  # one row each
    assert len({b.group for b in batches}) == len(whole.loss_batches(None, torch.float32).batches) < len(batches)
    assert all(b.recompute for b in batches)
    got = gradient_importance(cut, per_token=per_token)
    assert got.tokens == want.tokens and got.n_examples == want.n_examples
    # float32 gradients of the same tokens through products of other row counts, summed in float64: an error of
    # 1e-5 of each token's gradient at most, so of the sum of their absolute values (where signs cancel, batch-level
    # scores are much smaller than that sum)
    for head, value in want.raw.items():
        assert abs(got.raw[head] - value) <= 1e-5 * magnitude.raw[head] + 1e-12, head
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
