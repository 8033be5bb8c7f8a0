"""Physical head pruning: the pruned model computes what the gated model computes, with fewer weights.

Every check compares a pruned model with two routes that share no code with the pruning: the
gated model (headsweep's gates) and a fresh copy whose W_O columns for the removed heads are
set to zero (no gates, no pruning). Masks are random (seeded, including whole layers) and
pruning levels from real gradient importance.

Pruned and gated models multiply matrices of other shapes, so their float sums run in another order:
those comparisons use the summation-order bound of tolerances.py (or run in float64), and
test_the_bound_catches_one_head_left_unpruned shows that the bound still catches one head too few.
"""

from __future__ import annotations

import copy
import json
import random
import zlib

import pytest
import torch
from tiny_fairseq import BOUND_SHAPE, fairseq_load, plain_beam_search, plain_reference_nll, zero_heads
from tiny_models import random_batch, tiny_classifier, zeroed_copy
from tolerances import assert_routes_agree, max_difference, route_bound

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.pruning.export import export_pruned
from headsweep.sweep.pruning.levels import level_masks
from headsweep.workers.analyses.efficiency import measure_task
from headsweep.workers.analyses.importance import gradient_importance
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.head_slicing import plan_slice
from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.adapter import load_translation
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.pruning import PRUNED_KEY
from headsweep.workers.families.hf_classifier.adapter import load_classifier
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.families.hf_classifier.pruning import EmptyDistilBertAttention, EmptySelfAttention
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.pruning.removal import as_stock, count_parameters, prune_heads, ungated_copy

pytestmark = pytest.mark.usefixtures("one_thread")

BEAM, MAX_LEN_B = 3, 24
LEVELS = [0.25, 0.5, 0.75, 1.0]


def random_mask(heads: list[Head], seed: int, whole_layer: tuple[str, int]) -> list[Head]:
    """About a third of the heads at random, plus every head of ``whole_layer``."""
    rng = random.Random(seed)
    picked = {h for h in heads if rng.random() < 0.35}
    picked |= {h for h in heads if (h.attention, h.layer) == whole_layer}
    return sorted(picked)


def head_parameters(module_in: int, module_out: int, head_dim: int, bias: bool = True) -> int:
    """Weights one head owns: ``head_dim`` rows of W_Q, W_K, W_V (with biases) and columns of W_O."""
    return head_dim * (3 * (module_in + int(bias)) + module_out)


# -- the slicing rule ---------------------------------------------------------------------------
def test_slice_rows_and_columns_of_plain_attention():
    s = plan_slice(num_heads=4, head_dim=2, removed=[0, 2])
    assert s.kept == (1, 3) and s.removed == (0, 2) and s.kept_kv == (1, 3)
    assert s.query_rows.tolist() == [2, 3, 6, 7] and s.kv_rows.tolist() == [2, 3, 6, 7]
    assert plan_slice(4, 2, range(4)).query_rows.numel() == 0


def test_grouped_query_attention_keeps_a_shared_kv_head_while_any_query_head_uses_it():
    # 8 query heads share 2 key/value heads: heads 0-3 read kv 0, heads 4-7 read kv 1.
    s = plan_slice(num_heads=8, head_dim=2, removed=[0, 1, 2, 5], num_kv_heads=2)
    assert s.kept == (3, 4, 6, 7) and s.kept_kv == (0, 1)
    assert s.kv_index == (0, 1, 1, 1)
    s = plan_slice(num_heads=8, head_dim=2, removed=[0, 1, 2, 3, 5], num_kv_heads=2)
    assert s.kept_kv == (1,) and s.kv_rows.tolist() == [2, 3] and s.kv_index == (0, 0, 0)
    with pytest.raises(HeadsweepError, match="out of range"):
        plan_slice(4, 2, [4])


# -- transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_pruned_classifier_equals_gated_and_zeroed_columns(family, attn):
    # float64 for all three routes: equality is the claim, and float64 makes the summation-order bound
    # (same formula, float64's epsilon) about 1e-14 here. The real-ranking test below runs float32.
    model = tiny_classifier(family, attn, layers=3).double()
    ids, mask = random_batch()
    sites = find_sites(model)
    heads = [h for s in sites for h in (Head("self", s.layer, i) for i in range(s.num_heads))]
    removed = random_mask(heads, seed=zlib.crc32(f"{family}-{attn}".encode()), whole_layer=("self", 1))
    gates = HeadGates(sites)
    with torch.no_grad():
        with gates.masked(removed):
            gated = model(input_ids=ids, attention_mask=mask).logits
        zeroed = zeroed_copy(model, removed)(input_ids=ids, attention_mask=mask).logits
        pruned_model = ungated_copy(model, gates)
        n_full = count_parameters(pruned_model)
        prune_heads(pruned_model, removed)
        pruned = pruned_model(input_ids=ids, attention_mask=mask).logits
    # summation order (float64): the pruned model's projections are narrower than the gated/zeroed ones.
    # Depth: 3 layers plus one for the pooler and classifier; width: the feed-forward size.
    assert_routes_agree(pruned, gated, depth=3 + 1, width=64, what="pruned vs gated")
    assert_routes_agree(pruned, zeroed, depth=3 + 1, width=64, what="pruned vs zeroed")
    hidden, d = 32, 8
    assert n_full - count_parameters(pruned_model) == len(removed) * head_parameters(hidden, hidden, d)
    # the emptied layer computes no attention at all
    if family == "distilbert":
        assert isinstance(pruned_model.distilbert.transformer.layer[1].attention, EmptyDistilBertAttention)
    else:
        assert isinstance(getattr(pruned_model, family).encoder.layer[1].attention.self, EmptySelfAttention)

    # A pruned model can be swept in turn: its sites keep their layer numbers (the emptied layer has
    # none), and gating one of its heads equals zeroing that head's W_O columns.
    pruned_sites = find_sites(pruned_model)
    kept = {la: 4 - sum(h.layer == la for h in removed) for la in range(3)}
    assert [(s.layer, s.num_heads) for s in pruned_sites] == [(la, n) for la, n in kept.items() if n]
    target = Head("self", pruned_sites[-1].layer, pruned_sites[-1].num_heads - 1)
    gates = HeadGates(pruned_sites)
    with torch.no_grad():
        with gates.masked([target]):
            gated_pruned = pruned_model(input_ids=ids, attention_mask=mask).logits
        gates.remove()
        zeroed_pruned = zeroed_copy(pruned_model, [target])(input_ids=ids, attention_mask=mask).logits
    # exact: a gate of 0 and zeroed W_O columns feed the same matrix product the same zeros
    assert torch.equal(gated_pruned, zeroed_pruned)
    assert (gated_pruned - pruned).abs().max() > 1e-6  # other: the gate did act (the route can fail)


@pytest.fixture(scope="module")
def classifier(tiny_bert_dir, tiny_dev_tsv, tmp_path_factory):
    """A real classifier task and pruning levels from gradient importance on separate data."""
    train = write_tsv(generate(48, seed=5), tmp_path_factory.mktemp("prune_train") / "train.tsv")
    model_cfg = ClassifierModel(path=str(tiny_bert_dir))
    task = load_classifier(model_cfg, ClassifierData(path=str(tiny_dev_tsv)), RuntimeOptions(batch_size=16))
    scorer = load_classifier(model_cfg, ClassifierData(path=str(train)), RuntimeOptions(batch_size=16))
    scores = gradient_importance(scorer, per_token=True, normalize=True).scores
    return task, level_masks(scores, task.gates.inventory, LEVELS)


@torch.inference_mode()
def pruned_logits(task, model) -> torch.Tensor:
    out = torch.empty(len(task.examples.ids), model.config.num_labels)
    for idx, inputs in task.batches:
        out[idx] = model(**inputs).logits.float()
    return out


def bound_shape(task) -> dict[str, int]:
    """``depth`` and ``width`` of the summation-order bound for a classifier task: its layers plus one for the
    pooler and classifier; the longest of hidden size, feed-forward size and padded sequence length."""
    cfg = task.model.config
    longest = max(inputs["input_ids"].shape[1] for _, inputs in task.batches)
    return {"depth": cfg.num_hidden_layers + 1, "width": max(cfg.hidden_size, cfg.intermediate_size, longest)}




def test_the_bound_catches_one_head_left_unpruned(classifier, record_property):
    """The comparison above, with any one head of a level left in the pruned model, fails the bound by
    orders of magnitude: the bound admits float rounding, not a head."""
    task, levels = classifier
    smallest = None
    for level, mask in levels:
        gated = task.logits([mask])[0]
        bound = route_bound(gated, **bound_shape(task))
        for kept in mask:
            model = ungated_copy(task.model, task.gates)
            prune_heads(model, [h for h in mask if h != kept])
            diff = max_difference(pruned_logits(task, model), gated)
            # other: a real difference must exceed the summation-order bound, with room to spare
            assert diff > 100 * bound, f"level {level}, {kept} kept: {diff:.3g} vs bound {bound:.3g}"
            if smallest is None or diff / bound < smallest[0]:
                smallest = (diff / bound, diff, bound, level, str(kept))
    ratio, diff, bound, level, kept = smallest
    print(f"smallest real difference: level {level} with {kept} kept, max|pruned - gated| = {diff:.3g}, "
          f"bound {bound:.3g} ({ratio:.0f} times it)")
    record_property("smallest_real_difference_vs_bound", smallest)


def test_classifier_efficiency_rows(classifier):
    task, levels = classifier
    mask = dict(levels)[0.5]
    rows = measure_task(task, mask, batch_sizes=[1, 3], warmup=0, repeats=2, max_length=64)
    assert [(r["variant"], r["batch_size"]) for r in rows] == [("full", 1), ("pruned", 1), ("full", 3), ("pruned", 3)]
    full, pruned = rows[0], rows[1]
    assert full["n_heads"] == 8 and pruned["n_heads"] == 4
    assert full["n_params"] - pruned["n_params"] == 4 * head_parameters(32, 32, 8)
    assert full["speedup"] == 1.0 and pruned["speedup"] > 0
    for r in rows:
        assert r["examples"] == r["batch_size"] and r["tokens"] >= r["batch_size"] and r["repeats"] == 2
        assert 0 < r["seconds_min"] <= r["seconds_median"] <= r["seconds_max"]
        assert r["peak_memory_mb"] > r["n_params"] * 4 / 2**20  # weights plus activations
    assert pruned["peak_memory_mb"] < full["peak_memory_mb"]


def test_refusals(classifier, tiny_bert_dir):
    task, levels = classifier
    model = ungated_copy(task.model, task.gates)
    with pytest.raises(HeadsweepError, match="layer 5 out of range"):
        prune_heads(model, [Head("self", 5, 0)])
    prune_heads(model, [Head("self", 0, 1)])
    with pytest.raises(HeadsweepError, match="already pruned"):
        prune_heads(model, [Head("self", 0, 2)])
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    # The classifier family refuses decoder layouts (the hf_causal_lm family prunes them: test_causal_lm_pruning).
    from headsweep.workers.families.registry import model_family

    with pytest.raises(HeadsweepError, match="are pruned by model.kind hf_causal_lm"):
        prune_heads(llama, [Head("self", 0, 0)], family=model_family("hf_classifier"))
    assert llama.model.layers[0].self_attn.q_proj.out_features == 16  # refused before anything changed


# -- fairseq ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny fairseq model (conftest.trained_tiny_fairseq: read, never changed)."""
    return trained_tiny_fairseq


@pytest.fixture(scope="module")
def translation(tiny):
    model_cfg = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=BEAM,
                                 max_len_b=MAX_LEN_B)
    runtime = RuntimeOptions(batch_size=64, masks_per_batch=1)
    task = load_translation(model_cfg, TranslationData(data_bin=str(tiny.data.data_bin), split="test"), runtime)
    scorer = load_translation(model_cfg, TranslationData(data_bin=str(tiny.data.data_bin), split="valid"), runtime)
    scores = gradient_importance(scorer, per_token=True, normalize=True).scores
    return task, level_masks(scores, task.gates.inventory, [0.5, 1.0])


def fairseq_masks(task, levels) -> list[tuple[str, list[Head]]]:
    heads = task.gates.inventory.heads
    return [
        ("random", random_mask(heads, seed=3, whole_layer=("enc_dec", 1))),
        ("random", random_mask(heads, seed=4, whole_layer=("dec_self", 0))),
        *[(f"level {p}", list(mask)) for p, mask in levels],
    ]


def test_pruned_fairseq_model_translates_like_the_gated_one(tiny, translation):
    task, levels = translation
    fresh, ftask = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    sources, targets = task.examples.source, task.examples.target
    n_full = count_parameters(fresh)
    d = fresh.encoder.layers[0].self_attn.head_dim
    embed = fresh.encoder.layers[0].self_attn.q_proj.in_features
    for what, mask in fairseq_masks(task, levels):
        gated = task.translate([mask])[0]
        model = copy.deepcopy(fresh)
        prune_heads(model, mask)
        assert n_full - count_parameters(model) == len(mask) * head_parameters(embed, embed, d), what
        # beam search: incremental decoding with the pruned key/value caches of all three attention types
        decoded = plain_beam_search(model, ftask, sources, BEAM, MAX_LEN_B)
        for i, (hyp, (tokens, score)) in enumerate(zip(gated, decoded, strict=True)):
            assert hyp.tokens.tolist() == tokens, f"{what}: sentence {i}"
            # summation order: narrower pruned projections against the gated model's
            assert_routes_agree(score, hyp.score, **BOUND_SHAPE, what=f"{what}: {i}")
        # teacher forcing against the gate-free route: W_O columns zeroed on a fresh model
        reference = plain_reference_nll(zero_heads(copy.deepcopy(fresh), mask), ftask, sources, targets)
        pruned_nll = plain_reference_nll(model, ftask, sources, targets)
        # summation order: pruned projections against full ones with zero columns (fairseq's fused path)
        assert_routes_agree(pruned_nll, reference, **BOUND_SHAPE, what=what)
    assert len(levels[-1][1]) == 24


def test_pruned_fairseq_logits(tiny, translation):
    task, levels = translation
    mask = dict(levels)[0.5]
    sample = task.batches[0]
    fresh, _ = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    model = copy.deepcopy(fresh)
    prune_heads(model, mask)
    with torch.no_grad():
        pruned = model(**sample["net_input"])[0]
        reference = zero_heads(copy.deepcopy(fresh), mask)(**sample["net_input"])[0]
        task.gates.set_mask(mask)
        try:
            gated = task.model(**sample["net_input"])[0]
        finally:
            task.gates.clear()
    # summation order: the pruned model's narrower projections against full ones (gated; zeroed and fused)
    assert_routes_agree(pruned, gated, **BOUND_SHAPE, what="pruned vs gated")
    assert_routes_agree(pruned, reference, **BOUND_SHAPE, what="pruned vs zeroed")


def test_translation_efficiency_rows(translation):
    task, levels = translation
    rows = measure_task(task, dict(levels)[0.5], batch_sizes=[2], warmup=0, repeats=1)
    full, pruned = rows
    assert (full["variant"], pruned["variant"]) == ("full", "pruned")
    assert full["n_heads"] == 24 and pruned["n_heads"] == 12
    assert full["n_params"] - pruned["n_params"] == 12 * head_parameters(32, 32, 8)
    assert full["tokens"] > 2 and pruned["tokens"] == full["tokens"]


def test_exported_fairseq_checkpoint_reloads_with_headsweeps_loader(tiny, translation, tmp_path):
    """``headsweep export`` of a translation model: a checkpoint that loads with weights_only and translates
    exactly like the gated model (the CLI wiring itself is tested in test_export.py)."""
    task, levels = translation
    mask = fairseq_masks(task, levels)[0][1]
    data_bin = str(tiny.data.data_bin)
    cfg = build_config({
        "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint), "data_bin": data_bin},
        "data": {"data_bin": data_bin, "split": "test"},
    })
    out = export_pruned(cfg, tmp_path / "pruned", mask=[str(h) for h in mask])
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state[PRUNED_KEY] == [str(h) for h in mask] and "last_optimizer_state" not in state
    manifest = json.loads((out / "headsweep-export.json").read_text())
    assert manifest["n_params_full"] - manifest["n_params_pruned"] == len(mask) * head_parameters(32, 32, 8)
    model_cfg = TranslationModel(checkpoint=str(out / "checkpoint.pt"), data_bin=str(out), beam=BEAM,
                                 max_len_b=MAX_LEN_B)
    reloaded = load_translation(model_cfg, TranslationData(data_bin=str(tiny.data.data_bin), split="test"),
                                RuntimeOptions(batch_size=64, masks_per_batch=1))
    kept = {(s.attention, s.layer): s.num_heads for s in reloaded.describe().inventory.layers}
    assert kept[("enc_dec", 1)] == 0 and sum(kept.values()) == 24 - len(mask)
    # summation order: the reloaded pruned model's narrower projections against the gated model's
    for a, b in zip(task.translate([mask])[0], reloaded.translate([()])[0], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert_routes_agree(b.score, a.score, **BOUND_SHAPE, what="score")
    assert_routes_agree(reloaded.reference_loss([()])[0], task.reference_loss([mask])[0], **BOUND_SHAPE, what="loss")


def test_the_stock_model_is_the_gated_model_with_its_gates_off_and_back_after(tiny, translation):
    """The efficiency experiment's full model (workers.pruning.removal.as_stock) computes what a freshly loaded fairseq
    model computes, fused attention path included, whatever gates are set; once it ends, gates act again and
    every module setting is as before (no second copy of the weights is made)."""
    task, levels = translation
    mask = dict(levels)[0.5]
    sample = task.batches[0]
    fresh, _ = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    settings = [dict(vars(s.module)) for s in task.gates.sites]
    with torch.no_grad():
        stock = fresh(**sample["net_input"])[0]
        with task.gates.masked(mask):
            gated = task.model(**sample["net_input"])[0]
            with as_stock(task.model, task.gates) as full:
                assert full is task.model
                inside = full(**sample["net_input"])[0]
            after = task.model(**sample["net_input"])[0]
    assert torch.equal(inside, stock)  # same weights, same (fused) path: bit for bit
    assert torch.equal(after, gated) and not torch.allclose(gated, stock)
    assert [dict(vars(s.module)) for s in task.gates.sites] == settings
