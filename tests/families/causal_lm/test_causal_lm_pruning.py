"""Physical head removal from decoder-only LMs with the grouped-query rule: pruned logits equal gated logits
(eager and SDPA) on 8 query / 2 key-value heads, 14 / 2 with q/k/v biases (Qwen2), multi-query 4 / 1 (Llama and
GPTBigCode) and GPT-2, for random masks, masks that empty a key/value group and masks that empty a layer; the
parameter drop counted by hand; the cache still works; pruned folders reload strictly, through ``headsweep export``
and as ``model.path`` of a sweep."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import CAUSAL_LM_SHAPES, lm_text, save_tiny_causal_lm, tiny_causal_lm
from tiny_models import lm_batch as batch
from tiny_models import lm_logits as logits
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.model.pruning import (
    GroupedKVProjection,
    load_pruned,
    prune_causal_lm_heads,
)
from headsweep.workers.families.hf_causal_lm.model.sites import find_sites, kv_groups
from headsweep.workers.families.hf_shared.pruning import save_pruned
from headsweep.workers.families.registry import model_family
from headsweep.workers.pruning.removal import count_parameters, prune_heads

SHAPES = ["llama_8q2kv", "qwen2_14q2kv", "llama_mqa_4q1kv", "gpt2", "gpt_bigcode_mqa"]
HEAD_DIM = 4  # tiny_causal_lm's default
LAYERS = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def agree(actual, reference, shape, what):
    """summation order: the pruned model's narrower projections; LAYERS layers and the LM head, the longest
    product the feed-forward's (2 x width)."""
    width = 2 * CAUSAL_LM_SHAPES[shape][1] * HEAD_DIM
    return assert_routes_agree(actual, reference, depth=LAYERS + 1, width=width, what=what)


def masks_for(shape: str) -> dict[str, list[Head]]:
    """Random masks, one that empties key/value group 0 of layer 0 (and leaves a group partly used), one that
    empties layer 1, and one that leaves one head per layer."""
    _, heads, kv, _ = CAUSAL_LM_SHAPES[shape]
    group = heads // kv
    rng = random.Random(f"{shape}-masks")
    everything = [Head("self", layer, h) for layer in range(LAYERS) for h in range(heads)]
    masks = {f"random{i}": sorted(rng.sample(everything, rng.randint(1, len(everything) - 1))) for i in range(3)}
    masks["kv_group"] = [Head("self", 0, h) for h in range(group)] + [Head("self", 0, heads - 1)]
    masks["layer"] = [Head("self", 1, h) for h in range(heads)] + [Head("self", 0, 0)]
    masks["one_left"] = [Head("self", layer, h) for layer in range(LAYERS) for h in range(heads) if h != layer]
    return masks


def removed_parameters(shape: str, mask: list[Head]) -> int:
    """The parameter drop counted by hand: per removed query head, its q_proj rows (d_model x d weights, d biases
    where q has a bias) and its o_proj columns (d x d_model); per removed key/value head (all of its query heads
    removed), its k_proj and v_proj rows (2 x (d_model x d [+ d]))."""
    name, heads, kv, _ = CAUSAL_LM_SHAPES[shape]
    d, d_model = HEAD_DIM, heads * HEAD_DIM
    qkv_bias = d if name in ("Qwen2Config", "GPT2Config", "GPTBigCodeConfig") else 0
    group = heads // kv
    total = 0
    for layer in range(LAYERS):
        gone = {h.head for h in mask if h.layer == layer}
        total += len(gone) * (d_model * d + qkv_bias + d * d_model)
        gone_kv = [g for g in range(kv) if all(q in gone for q in range(g * group, (g + 1) * group))]
        total += len(gone_kv) * 2 * (d_model * d + qkv_bias)
    return total


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_pruned_equals_gated_and_drops_the_counted_parameters(shape, attn):
    full = tiny_causal_lm(shape, attn)
    gates = HeadGates(find_sites(full))
    ids = batch(full.config.vocab_size)
    base = logits(full, ids)
    n_full = count_parameters(full)
    for what, mask in masks_for(shape).items():
        with gates.masked(mask):
            gated = logits(full, ids)
        pruned_model = tiny_causal_lm(shape, attn)
        slices = prune_heads(pruned_model, mask, family=model_family("hf_causal_lm"))
        pruned = logits(pruned_model, ids)
        _, bound = agree(pruned, gated, shape, f"{shape} {attn} {what}")
        # other: the route must be able to fail: removing heads changes the logits by far more than the bound
        assert (pruned - base).abs().max().item() > 100 * bound, what
        assert n_full - count_parameters(pruned_model) == removed_parameters(shape, mask), what
        assert pruned_model.config.pruned_heads == {str(layer): list(s.removed) for (_, layer), s in slices.items()}
        # The renumbered heads of each surviving layer still read their original key/value heads.
        _, heads, kv, _ = CAUSAL_LM_SHAPES[shape]
        for layer, groups in kv_groups(find_sites(pruned_model)).items():
            kept = [h for h in range(heads) if Head("self", int(layer.split(":")[1]), h) not in mask]
            original = [[q for q in kept if q // (heads // kv) == g] for g in range(kv)]
            assert [[kept[i] for i in g] for g in groups] == [g for g in original if g], (what, layer)


def test_key_value_rows_follow_the_grouped_query_rule():
    """8 query / 2 key-value heads of size 4: a key/value head's rows go only with its whole group; uneven groups
    read their key/value heads through GroupedKVProjection, even ones through the stock repeat."""
    full = tiny_causal_lm("llama_8q2kv")
    model = copy.deepcopy(full)
    prune_causal_lm_heads(model, [Head("self", 0, h) for h in range(4)] + [Head("self", 1, h) for h in (0, 1, 2)])
    first, second = (layer.self_attn for layer in model.model.layers)
    old_first, old_second = (layer.self_attn for layer in full.model.layers)
    # exact: rows copied, not computed
    assert torch.equal(first.k_proj.weight, old_first.k_proj.weight[4:8])
    assert torch.equal(first.v_proj.weight, old_first.v_proj.weight[4:8])
    assert torch.equal(first.q_proj.weight, old_first.q_proj.weight[16:32])
    assert torch.equal(first.o_proj.weight, old_first.o_proj.weight[:, 16:32])
    assert type(first.k_proj) is torch.nn.Linear and first.num_key_value_groups == 4
    assert torch.equal(second.k_proj.weight, old_second.k_proj.weight)  # both groups still read
    assert isinstance(second.k_proj, GroupedKVProjection) and second.num_key_value_groups == 1
    assert second.k_proj.kv_index.tolist() == [0, 1, 1, 1, 1]
    assert kv_groups(find_sites(model)) == {"self:0": [[0, 1, 2, 3]], "self:1": [[0], [1, 2, 3, 4]]}


@pytest.mark.parametrize("shape", ["llama_8q2kv", "gpt2", "gpt_bigcode_mqa"])
def test_a_pruned_model_decodes_with_its_cache(shape):
    """Incremental decoding (the default dynamic cache) equals the full forward, layer 0 emptied included: the
    emptied layer still records its (empty) keys, so the cache's length stays right."""
    model = tiny_causal_lm(shape, "sdpa")
    heads = CAUSAL_LM_SHAPES[shape][1]
    prune_causal_lm_heads(model, [Head("self", 0, h) for h in range(heads)] + [Head("self", 1, 1)])
    assert [s.layer for s in find_sites(model)] == [1]  # the emptied layer 0 keeps its place in the numbering
    ids = batch(model.config.vocab_size, length=12)
    whole = logits(model, ids)
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :7], use_cache=True)
        rest = model(input_ids=ids[:, 7:], past_key_values=prefix.past_key_values, use_cache=True).logits
    agree(torch.cat([prefix.logits, rest], dim=1), whole, shape, "cached decoding")


def test_refusals(tmp_path):
    model = tiny_causal_lm("llama_8q2kv")
    with pytest.raises(HeadsweepError, match=r"head 8 out of range \(self layer 0 has 8 heads, 0..7\)"):
        prune_causal_lm_heads(model, [Head("self", 0, 8)])
    assert count_parameters(model) == count_parameters(tiny_causal_lm("llama_8q2kv"))  # nothing changed
    prune_causal_lm_heads(model, [Head("self", 0, 1)])
    with pytest.raises(HeadsweepError, match="already pruned"):
        prune_causal_lm_heads(model, [Head("self", 0, 2)])
    # A folder whose weights do not fit its pruned_heads: one clear line.
    full = tiny_causal_lm("llama_8q2kv")
    full.config.pruned_heads = {"0": [1]}
    full.save_pretrained(tmp_path / "bad")
    with pytest.raises(HeadsweepError, match="do not fit its pruned config"):
        load_pruned(tmp_path / "bad")


@pytest.mark.parametrize("shape", SHAPES)
def test_save_and_load_pruned(shape, tmp_path):
    """The saved folder is stock save_pretrained output plus config.pruned_heads; the loader rebuilds the stock
    architecture, removes the same heads and loads every weight strictly (GPT-2's tied LM head included)."""
    mask = masks_for(shape)["kv_group"] + masks_for(shape)["layer"]
    model = tiny_causal_lm(shape, "sdpa")
    prune_causal_lm_heads(model, mask)
    save_pruned(model, tmp_path / "pruned")
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert config["pruned_heads"] == {str(layer): sorted({h.head for h in mask if h.layer == layer})
                                      for layer in range(LAYERS)}
    reloaded = load_pruned(tmp_path / "pruned", attn_implementation="sdpa")
    assert count_parameters(reloaded) == count_parameters(model)
    ids = batch(model.config.vocab_size)
    # exact: the same weights in modules of the same shapes, run by the same kernels
    assert torch.equal(logits(reloaded, ids), logits(model, ids))
    if shape == "gpt2":
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm-export")
    model_dir = save_tiny_causal_lm(tmp / "tiny-llama-gqa", "llama_8q2kv")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(300, seed=11))
    return tmp, model_dir, corpus


# Key/value group 0 of layer 0 and one head of group 1; all of layer 1.
REMOVED = ",".join(["self:0:0", "self:0:1", "self:0:2", "self:0:3", "self:0:5"] + [f"self:1:{h}" for h in range(8)])


@pytest.fixture(scope="module")
def exported(lm_folder):
    """``headsweep export --mask REMOVED`` of the full model through the real CLI, once for the module (the tests
    read the folder): the full model's config, the export's folder and the finished process."""
    tmp, model_dir, corpus = lm_folder
    cfg = {"model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa"},
           "data": {"path": str(corpus), "window": 16}}
    (tmp / "full.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "pruned"
    return cfg, out, run_cli("export", str(tmp / "full.yaml"), "--mask", REMOVED, "--out", str(out))


def test_export_cli_of_a_causal_lm(lm_folder, exported):
    """``headsweep export`` of a causal LM through the real CLI: the folder reloads (with the family's loader and
    through the config's model.path) and computes what the gated full model computes."""
    tmp, model_dir, corpus = lm_folder
    _, out, proc = exported
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    manifest = json.loads((out / "headsweep-export.json").read_text())
    mask = [Head.parse(h) for h in REMOVED.split(",")]
    assert manifest["heads_kept"] == {"self:0": [4, 6, 7], "self:1": []}  # layer 1 lost every head
    assert manifest["n_params_full"] - manifest["n_params_pruned"] == removed_parameters("llama_8q2kv", mask)

    family = model_family("hf_causal_lm")
    full = family.load_model(family.model_config(path=str(model_dir), attn_implementation="sdpa")).model
    ids = batch(full.config.vocab_size)
    gates = HeadGates(find_sites(full))
    with gates.masked(mask):
        gated = logits(full, ids)
    agree(logits(load_pruned(out, attn_implementation="sdpa"), ids), gated, "llama_8q2kv", "exported")
    via_config = family.load_model(family.model_config(path=str(out), attn_implementation="sdpa"))
    agree(logits(via_config.model, ids), gated, "llama_8q2kv", "exported, via model.path")
    assert via_config.tokenizer("the cat")["input_ids"]  # the tokenizer travels with the model


def test_an_exported_lm_is_swept(lm_folder, exported, tmp_path, ray_address):
    """``headsweep run`` with the exported folder as model.path: its baseline perplexity is the full model's
    under the removed mask (the full model's own adapter, gated), and only the kept heads are swept."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    tmp, model_dir, corpus = lm_folder
    cfg, out, proc = exported
    assert proc.returncode == 0, proc.stderr
    pruned_cfg = {**cfg, "model": {**cfg["model"], "path": str(out)},
                  "sweep": {"experiments": ["baseline", "single_head", "kv_group"], "batch_size": 8}}
    (tmp_path / "pruned.yaml").write_text(yaml.safe_dump(pruned_cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "pruned.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    from headsweep.results.store import ResultStore

    evals = {e["eval_id"]: e for e in ResultStore(str(store)).read("evaluations").to_pylist()}
    assert sorted(e for e in evals if e.startswith("single_head/")) == [f"single_head/self:0:{h}" for h in range(3)]
    family = model_family("hf_causal_lm")
    full = CausalLMAdapter(family.model_config(path=str(model_dir), attn_implementation="sdpa"),
                           family.data_config(path=str(corpus), window=16), RuntimeOptions(batch_size=8))
    expected = full.evaluate([[Head.parse(h) for h in REMOVED.split(",")]])[0].score
    # summation order: perplexity = exp(mean NLL); the NLL's error is at most the logits' bound (logits ~ 10)
    assert evals["baseline"]["score"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt_bigcode_without_multi_query(attn):
    """GPTBigCode's multi-head layout keeps each head's q, k and v side by side in c_attn's output."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTBigCodeConfig(n_embd=16, n_layer=LAYERS, n_head=4, n_inner=32, n_positions=64,
                                        vocab_size=30, initializer_range=0.2, multi_query=False,
                                        attn_implementation=attn)
    full = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gates = HeadGates(find_sites(full))
    ids = batch(30)
    for mask in ([Head("self", 0, 1), Head("self", 1, 0), Head("self", 1, 3)],
                 [Head("self", 0, h) for h in range(4)] + [Head("self", 1, 2)]):
        with gates.masked(mask):
            gated = logits(full, ids)
        model = copy.deepcopy(full)
        prune_causal_lm_heads(model, mask)
        # summation order: narrower projections; 2 layers and the LM head, feed-forward width 32
        assert_routes_agree(logits(model, ids), gated, depth=LAYERS + 1, width=32, what=mask)
        d, d_model = 4, 16
        assert count_parameters(full) - count_parameters(model) == len(mask) * (3 * (d_model * d + d) + d * d_model)


def test_efficiency_rows_of_a_causal_lm(lm_folder):
    """The efficiency experiment's worker step on a causal LM: the full and the pruned model side by side, the
    pruned one removed through the family (``measure_task(..., family=...)`` as ``efficiency_on_worker`` calls it)."""
    from headsweep.workers.analyses.efficiency import measure_task
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    _, model_dir, corpus = lm_folder
    family = model_family("hf_causal_lm")
    adapter = CausalLMAdapter(family.model_config(path=str(model_dir), attn_implementation="sdpa"),
                              family.data_config(path=str(corpus), window=16), RuntimeOptions(batch_size=8))
    mask = [Head.parse(h) for h in REMOVED.split(",")]
    rows = measure_task(adapter, mask, batch_sizes=[2], warmup=0, repeats=1, max_length=16, family=family)
    full, pruned = rows
    assert (full["variant"], pruned["variant"]) == ("full", "pruned")
    assert full["n_heads"] == 16 and pruned["n_heads"] == 3
    assert full["n_params"] - pruned["n_params"] == removed_parameters("llama_8q2kv", mask)
    assert full["tokens"] == pruned["tokens"] == 2 * 16


@pytest.mark.parametrize("shape", ["llama_8q2kv", "gpt2"])
def test_bare_models_find_their_family(shape, tmp_path):
    """``prune_heads`` without a family and ``headsweep.load_pruned`` pick the causal-LM family for an LM
    (the transformers layouts are recognised by both transformers families), and the classifier one for BERT."""
    from tiny_models import tiny_classifier

    import headsweep
    from headsweep.workers.families.hf_shared.pruning import save_pruned as save_classifier
    from headsweep.workers.pruning.removal import family_of_model

    model = tiny_causal_lm(shape, "sdpa")
    assert family_of_model(model).name == "hf_causal_lm"
    mask = [Head("self", 0, 1), Head("self", 1, 0)]
    prune_heads(model, mask)  # no family given
    save_pruned(model, tmp_path / "lm")
    reloaded = headsweep.load_pruned(str(tmp_path / "lm"))
    ids = batch(model.config.vocab_size)
    assert torch.equal(logits(reloaded, ids), logits(model, ids))  # exact: same weights, same kernels
    bert = tiny_classifier("bert", "sdpa")
    assert family_of_model(bert).name == "hf_classifier"
    prune_heads(bert, [Head("self", 0, 1)])
    save_classifier(bert, tmp_path / "bert")
    assert type(headsweep.load_pruned(str(tmp_path / "bert"))).__name__ == type(bert).__name__


def test_a_module_that_reshapes_by_its_stored_head_count_is_pruned_exactly():
    """StableLM's attention reshapes by the ``num_heads`` it stores: pruning sets the pruned counts, so the pruned
    model computes the model whose removed heads' W_O columns are zeroed (an independent route); its config derives
    the head size from ``hidden_size / num_attention_heads``, so a stock export is refused in one line."""
    from tiny_models import zeroed_copy
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(0)
    model = StableLmForCausalLM(StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=4)).eval()
    mask = [Head("self", layer, h) for layer in (0, 1) for h in (0, 1)]
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want = zeroed_copy(model, mask)(input_ids=ids).logits
        pruned = copy.deepcopy(model)
        model_family("hf_causal_lm").prune(pruned, mask)
        got = pruned(input_ids=ids).logits
    assert_routes_agree(got, want, depth=2, width=32, what="pruned StableLM against zeroed W_O columns")
    with pytest.raises(HeadsweepError, match="StableLmConfig does not state the pruned head size"):
        model_family("hf_causal_lm").stock_sizes(model, mask)
