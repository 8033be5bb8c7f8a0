"""Prefix reuse for causal LMs against the plain path (``sweep.reuse: false``): the same per-window NLL sums for every
single-head and every all-but-one mask, eager and SDPA, on grouped-query (8/2, 14/2 with biases), multi-query (4/1),
GPT-2 and GPTBigCode models; skipped layers really not run; states over budget; a layout reuse cannot replay.

The plain path is the independent route: the whole gated model for each mask (itself checked against weight
surgery in test_causal_lm_gates.py and against transformers' own loss in test_causal_lm_perplexity.py).
"""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import LM_SPECIALS, LM_WORDS, build_lm_tokenizer, lm_text, save_tiny_causal_lm
from tolerances import assert_routes_agree

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.reuse.prefix import decoder_layout
from headsweep.workers.families.hf_causal_lm.tasks import perplexity as adapter_module
from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter
from headsweep.workers.families.hf_shared.layout import attention_layout
from headsweep.workers.memory.replay import ReuseUnsupported

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 3
WINDOW = 16
SHAPES = ["llama_8q2kv", "qwen2_14q2kv", "llama_mqa_4q1kv", "gpt2", "gpt_bigcode_mqa"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(lm_text(200, seed=7))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {shape: save_tiny_causal_lm(root / shape, shape, layers=LAYERS) for shape in SHAPES}


def adapter(model_dir, corpus, attn="eager", reuse=True, masks_per_batch=1, **data) -> CausalLMAdapter:
    # 3 windows per batch, 2 batches (the second one short): states are kept per batch
    data = {"window": WINDOW, "max_windows": 5, **data}
    return CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation=attn),
                           CausalLMData(path=str(corpus), **data),
                           RuntimeOptions(batch_size=3, reuse=reuse, masks_per_batch=masks_per_batch))


def grid(inventory) -> list[list[Head]]:
    singles = [[h] for h in inventory.heads]
    all_but_one = [[o for o in s.heads() if o != kept] for s in inventory.layers for kept in s.heads()]
    return singles + all_but_one


def route_shape(a: CausalLMAdapter) -> dict:
    """The summation-order bound's shape: the layers plus the LM head; the longest inner product (the
    feed-forward size, at least the window)."""
    cfg = a.model.config
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    return {"depth": LAYERS + 1, "width": max(int(inner), WINDOW)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_reuse_equals_plain_for_every_head_and_all_but_one(shape, attn, model_dirs, corpus):
    plain = adapter(model_dirs[shape], corpus, attn, reuse=False)
    reused = adapter(model_dirs[shape], corpus, attn)
    assert plain.describe().facts["reuse"].startswith("off")
    assert reused.describe().facts["reuse"].startswith("prefix: masks start at their first gated layer")
    inventory = plain.gates.inventory
    spanning = [[Head("self", 0, 1), Head("self", 2, 0)], [Head("self", 1, 0), Head("self", 1, 2), Head("self", 2, 3)]]
    masks = [[]] + grid(inventory) + spanning
    expected = plain.nll(masks)
    # exact: one mask per pass replays the plain path's arithmetic on the same shapes (the empty mask is the
    # recorded baseline pass itself)
    np.testing.assert_array_equal(reused.nll(masks), expected, err_msg=f"{shape} {attn}")
    assert reused._reuse.kept_bytes > 0 and len(reused._reuse.cache._kept) == len(reused.batches)
    # other: the route can fail: every mask moves some window's NLL
    assert (np.abs(expected[1:] - expected[0]).max(axis=1) > 1e-4).all()
    packed = adapter(model_dirs[shape], corpus, attn, masks_per_batch=0)
    assert packed.masks_per_forward(3) >= len(inventory.heads)  # all masks of a layer share one pass
    got = packed.nll(masks)
    for mask, a, b in zip(masks, got, expected, strict=True):
        # summation order: many masks per pass multiply taller matrices than one mask alone
        assert_routes_agree(a, b, **route_shape(plain), dtype=torch.float32, what=(shape, attn, mask))


def test_layers_before_the_first_gated_layer_are_not_computed(model_dirs, corpus):
    a = adapter(model_dirs["llama_8q2kv"], corpus, masks_per_batch=0)
    a.baseline()  # records (and keeps) both batches' states, and checks one replayed mask
    layers = a._reuse.layout.layers
    queries = [attention_layout(site.module).query for site in a.gates.sites]
    mlps = [layer.mlp for layer in layers]
    calls = {"query": [0] * LAYERS, "mlp": [0] * LAYERS}
    handles = [q.register_forward_hook(lambda *_a, i=i: calls["query"].__setitem__(i, calls["query"][i] + 1))
               for i, q in enumerate(queries)]
    handles += [m.register_forward_hook(lambda *_a, i=i: calls["mlp"].__setitem__(i, calls["mlp"][i] + 1))
                for i, m in enumerate(mlps)]
    try:
        batches = len(a.batches)
        a.nll([[Head("self", 2, 1)], [Head("self", 2, 5)]])  # one pass per batch from layer 2
        assert calls == {"query": [0, 0, 0], "mlp": [0, 0, batches]}, "layers 0, 1 and layer 2's q/k/v are skipped"
        a.nll([[Head("self", 1, 1)], [Head("self", 1, 0), Head("self", 2, 7)], []])
        assert calls == {"query": [0, 0, batches], "mlp": [0, batches, 2 * batches]}
        a.nll([[Head("self", 0, 3)]])
        assert calls == {"query": [0, batches, 2 * batches], "mlp": [batches, 2 * batches, 3 * batches]}
    finally:
        for h in handles:
            h.remove()


def test_states_over_budget_are_recorded_per_call_with_the_same_results(model_dirs, corpus, monkeypatch):
    monkeypatch.setattr(adapter_module, "cache_budget", lambda device: 0)  # no room to keep baseline states
    a = adapter(model_dirs["gpt2"], corpus, "sdpa")
    plain = adapter(model_dirs["gpt2"], corpus, "sdpa", reuse=False)
    masks = [[], [Head("self", 2, 1)], [Head("self", 1, 0)], [Head("self", 0, 1), Head("self", 0, 3)]]
    query = attention_layout(a.gates.sites[0].module).query
    calls = []
    handle = query.register_forward_hook(lambda *_a: calls.append(1))
    try:
        first = a.nll(masks)
        recorded = len(calls)
        second = a.nll(masks)
    finally:
        handle.remove()
    assert a._reuse.kept_bytes == 0
    # layer 0's queries run only to record a batch (the layer-0 mask starts at its cached contexts): once per batch
    # on every call, plus the first call's check on the first window: one whole gated pass, which records the
    # states its replayed mask starts from on the way
    assert len(a.batches[0]) > 2
    assert (recorded, len(calls) - recorded) == (len(a.batches) + 1, len(a.batches))
    expected = plain.nll(masks)
    np.testing.assert_array_equal(first, expected)  # exact: one mask per pass, as above
    np.testing.assert_array_equal(second, expected)  # exact: the same


def save_tiny_jamba(out_dir):
    """A tiny Jamba (attention in every other layer, Mamba in the rest), saved with a tokenizer."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    cfg = JambaConfig(vocab_size=len(LM_SPECIALS) + len(LM_WORDS), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                      attn_layer_offset=1, expert_layer_period=100, expert_layer_offset=99, num_experts=1,
                      mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=2, eos_token_id=3, initializer_range=0.2)
    JambaForCausalLM(cfg).eval().save_pretrained(out_dir)
    build_lm_tokenizer().save_pretrained(out_dir)
    return out_dir


def test_a_hybrid_stack_keeps_its_layer_numbers_and_reuses_prefixes(tmp_path, corpus):
    """Jamba's attention layers are layers 1 and 3 of its stack (Mamba in 0 and 2): its heads are named so, and a
    mask starts at its first gated attention layer, the Mamba layers after it run per mask."""
    model_dir = save_tiny_jamba(tmp_path / "jamba")
    a = adapter(model_dir, corpus)
    assert [(s.layer, s.module_name) for s in a.gates.sites] == [(1, "model.layers.1.self_attn"),
                                                                 (3, "model.layers.3.self_attn")]
    assert a.describe().facts["reuse"].startswith("prefix: "), a.describe().facts["reuse"]
    masks = [[], [Head("self", 1, 1)], [Head("self", 3, 2)], [Head("self", 1, 0), Head("self", 3, 3)]]
    got = a.nll(masks)
    assert a._reuse is not None and a._reuse.verified  # the replay was compared with the whole gated model
    # exact: the replay from a cached layer output computes what the whole model computes
    np.testing.assert_array_equal(got, adapter(model_dir, corpus, reuse=False).nll(masks))


def test_a_replay_that_differs_from_the_whole_model_is_refused(model_dirs, corpus):
    a = adapter(model_dirs["qwen2_14q2kv"], corpus, "sdpa")
    a.baseline()
    assert a._reuse.verified
    states = a._reuse.cache._kept[0]
    with torch.inference_mode(), pytest.raises(ReuseUnsupported, match="does not reproduce the whole model's"):
        states.hidden[1].add_(1.0)  # a cached state changed in place: replays from layer 2 go wrong
        a._reuse.verify(a.inputs[:3], a.scored[:3], states, [Head("self", 2, 0)])
    # The adapter checks its first window's own recording: one whose kept state changes after it was kept (as a
    # layer writing into its input would) is found, and the adapter falls back for good.
    record = a._reuse.record

    def changed_after_kept(inputs, scored, mask=()):
        recorded = record(inputs, scored, mask)
        recorded.hidden[1].add_(1.0)
        return recorded

    a._reuse.record = changed_after_kept
    a._reuse.verified = False
    masks = [[Head("self", 2, 4)], [Head("self", 0, 13)]]
    got = a.nll(masks)
    assert a._reuse is None and "does not reproduce" in a.describe().facts["reuse"]
    np.testing.assert_array_equal(got, adapter(model_dirs["qwen2_14q2kv"], corpus, "sdpa", reuse=False).nll(masks))


def test_layers_run_out_of_their_list_order_are_refused(model_dirs, corpus):
    """The check's recording is a gated pass: the layers below the gated one must be the baseline's, which holds only
    when the stack runs its layers in list order (a layer list reordered after the layout was read does not)."""
    a = adapter(model_dirs["llama_8q2kv"], corpus)
    a.baseline()  # the layout is read and checked in list order
    assert a._reuse is not None and a._reuse.verified
    stack = a.model.model.layers
    stack[0], stack[1] = stack[1], stack[0]
    with torch.inference_mode(), pytest.raises(ReuseUnsupported, match="did not run in the order"):
        a._reuse.record(a.inputs[:3], a.scored[:3])


def test_training_mode_is_refused(model_dirs, corpus):
    a = adapter(model_dirs["llama_8q2kv"], corpus, reuse=False)
    a.model.train()
    with pytest.raises(ReuseUnsupported, match="training mode"):
        decoder_layout(a.model, a.gates.sites)


def test_gradient_importance_and_workload_run_the_whole_model(model_dirs, corpus):
    a = adapter(model_dirs["llama_8q2kv"], corpus)
    a.baseline()
    batch = a.loss_batches(None, torch.float32).batches[0]
    with torch.no_grad():
        loss = float(batch.loss())
    expected = a.baseline().stats[: batch.n_examples, 0].sum()
    # summation order: logits of every position and one float32 sum against per-window float64 sums
    assert_routes_agree(loss, expected, **route_shape(a), what="loss")
    assert a.workload(batch_size=2, max_length=8).run(a.model).logits.shape[:2] == (2, 8)


# -- through the sweep machinery ------------------------------------------------------------------------------

# The sweep end to end with reuse (facts, every single head's stored sums against the plain path), on a grouped-query
# model: test_causal_lm_sweep.py::test_the_run_reuses_prefixes_and_stores_what_the_plain_path_computes, on the run
# that module makes anyway; the multi-query layout's reuse against the plain path: the in-process tests above
@pytest.mark.slow
def test_a_sweep_reports_reuse_and_equals_the_plain_path(tmp_path, model_dirs, corpus, ray_address):
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "name": "lm-reuse",
        "model": {"kind": "hf_causal_lm", "path": str(model_dirs["llama_mqa_4q1kv"]), "attn_implementation": "sdpa"},
        "data": {"path": str(corpus), "window": WINDOW},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 4},
        "significance": {"n_resamples": 20, "seed": 1},
    }))
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    con = duckdb.connect()
    (facts,) = con.sql(f"SELECT facts FROM read_parquet('{store}/runs/*/*.parquet')").fetchall()[0]
    assert json.loads(facts)["reuse"].startswith("prefix: masks start at their first gated layer")
    rows = con.sql(f"SELECT e.heads_masked, x.example_id, x.stats FROM read_parquet('{store}/evaluations/*/*.parquet') "
                   f"e JOIN read_parquet('{store}/examples/*/*.parquet') x USING (eval_id)").fetchall()
    plain = adapter(model_dirs["llama_mqa_4q1kv"], corpus, "sdpa", reuse=False, max_windows=None)
    masks = [[]] + [[h] for h in plain.gates.inventory.heads]
    expected = plain.nll(masks)
    stored = {(tuple(m), ex): s for m, ex, s in rows}
    assert len(stored) == len(masks) * len(plain.windows)
    for mask, row in zip(masks, expected, strict=True):
        got = [stored[(tuple(str(h) for h in mask), f"w{i}")][0] for i in range(len(plain.windows))]
        # summation order: the sweep packs several masks per pass (automatic masks_per_batch), batches of 4
        assert_routes_agree(np.array(got), row, **route_shape(plain), dtype=torch.float32, what=mask)
