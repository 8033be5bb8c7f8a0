"""Attention sites described as data (workers/families/hf_shared/site_table.py): GPT-NeoX (Pythia), OPT, GPT-J,
Falcon (multi-query and grouped), Bloom (ALiBi), DeepSeek-V3 (latent attention, heads of ``v_head_dim``) and
ModernBERT, each built tiny from its own config class, gated by the family's own sites and hooks, against weight
surgery on the output projection that the test names itself (``...attention.dense`` and so on: an independent route,
no headsweep code finds it); hybrid layer numbers and the refusals (state-space models, a mask naming a Mamba layer,
an attention module no row describes, pruning a layout headsweep does not slice). Physical pruning of the fused and
latent layouts equals the gated model and reloads through load_pruned; stock export is refused with the reason, or
(DeepSeek-V3, Phi-3) loads with stock from_pretrained and computes the gated model.

bench/coverage.py walks every model type of transformers' auto mappings the same way (``--smoke`` runs in
tests/project/test_bench_smoke.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.model.sites import sites_or_error

pytestmark = pytest.mark.usefixtures("one_thread")


def _build(name: str) -> tuple[nn.Module, str, int]:
    """A tiny seeded model, the format of its output projections' names (by layer) and its heads per layer."""
    import transformers as tf

    small = {"vocab_size": 96, "hidden_size": 32}
    if name == "gpt_neox":
        cfg, cls, proj = tf.GPTNeoXConfig(**small, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64), tf.GPTNeoXForCausalLM, \
            "gpt_neox.layers.{}.attention.dense"
    elif name == "opt":
        cfg, cls, proj = tf.OPTConfig(**small, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                      word_embed_proj_dim=32, pad_token_id=1), tf.OPTForCausalLM, \
            "model.decoder.layers.{}.self_attn.out_proj"
    elif name == "gptj":
        cfg, cls, proj = tf.GPTJConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                       n_positions=64), tf.GPTJForCausalLM, "transformer.h.{}.attn.out_proj"
    elif name in ("falcon_mqa", "falcon_grouped", "falcon_alibi"):
        grouped, alibi = name == "falcon_grouped", name == "falcon_alibi"
        cfg, cls, proj = tf.FalconConfig(**small, num_hidden_layers=2, num_attention_heads=4,
                                         new_decoder_architecture=grouped, num_kv_heads=2 if grouped else None,
                                         multi_query=name == "falcon_mqa", alibi=alibi, bias=True), \
            tf.FalconForCausalLM, "transformer.h.{}.self_attention.dense"
    elif name == "phi3":
        cfg, cls, proj = tf.Phi3Config(**small, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, pad_token_id=0), tf.Phi3ForCausalLM, \
            "model.layers.{}.self_attn.o_proj"
    elif name == "bloom":
        cfg, cls, proj = tf.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4), tf.BloomForCausalLM, \
            "transformer.h.{}.self_attention.dense"
    elif name == "deepseek_v3":
        cfg, cls, proj = tf.DeepseekV3Config(**small, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
                                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                             qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6), \
            tf.DeepseekV3ForCausalLM, "model.layers.{}.self_attn.o_proj"
    else:
        assert name == "modernbert"
        cfg, cls, proj = tf.ModernBertConfig(**small, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, num_labels=3, pad_token_id=0,
                                             global_attn_every_n_layers=2, local_attention=8), \
            tf.ModernBertForSequenceClassification, "model.layers.{}.attn.Wo"
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1, so a wrong split or a lost bias would show
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model, proj, 4


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _zeroed(model: nn.Module, proj: str, heads: list[Head], head_dim: int, fills=None) -> nn.Module:
    """The independent route: a copy whose named projection has each head's input columns zeroed (and, with
    ``fills``, ``W_O[:, h] @ fill_h`` added to its bias)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for h in heads:
            linear = ref.get_submodule(proj.format(h.layer))
            span = slice(h.head * head_dim, (h.head + 1) * head_dim)
            if fills is not None:
                add = linear.weight[:, span].double() @ fills[h].double()
                if linear.bias is None:
                    linear.bias = nn.Parameter(add.to(linear.weight.dtype))
                else:
                    linear.bias += add.to(linear.weight.dtype)
            linear.weight[:, span] = 0.0
    return ref


ARCHS = ["gpt_neox", "opt", "gptj", "falcon_mqa", "falcon_grouped", "bloom", "deepseek_v3", "modernbert"]


@pytest.mark.parametrize("name", ARCHS)
def test_gate_equals_zeroed_output_columns(name):
    model, proj, heads_per_layer = _build(name)
    reference = copy.deepcopy(model)
    if name == "modernbert":
        from headsweep.workers.families.hf_classifier.adapter import _sites_or_error as sites_of
    else:
        sites_of = sites_or_error
    sites = sites_of(model)
    assert [(s.layer, s.num_heads) for s in sites] == [(0, heads_per_layer), (1, heads_per_layer)]
    assert [s.module_name for s in sites] == [proj.format(i).rsplit(".", 1)[0] for i in (0, 1)]
    gates = HeadGates(sites)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    base = _logits(model, ids)
    head_dim = sites[0].head_dim
    masks = [[h] for h in gates.inventory.heads] + [[Head("self", 1, h) for h in range(heads_per_layer) if h != 2]]
    for mask in masks:
        with gates.masked(mask):
            gated = _logits(model, ids)
        expected = _zeroed(reference, proj, mask, head_dim)
        torch.testing.assert_close(gated, _logits(expected, ids), rtol=1e-5, atol=1e-6)
        assert (gated - base).abs().max().item() > 1e-4, mask  # the route can fail: the head mattered
    # Mean ablation equals its bias fold, for one head per layer.
    contexts = {}
    hooks = [s.out_proj.register_forward_pre_hook(
        lambda m, a, key=s.key, s=s: contexts.__setitem__(key, a[0].reshape(-1, s.num_heads, s.head_dim)))
        for s in sites]
    _logits(model, ids)
    for h in hooks:
        h.remove()
    from headsweep.workers.core.head_fill import HeadFill

    means = {s.key: contexts[s.key].mean(dim=0) for s in sites}
    heads = [Head("self", 0, 1), Head("self", 1, 3)]
    gates.set_fill(HeadFill(means))
    with gates.masked(heads):
        filled = _logits(model, ids)
    gates.set_fill(None)
    folded = _zeroed(reference, proj, heads, head_dim, {h: means[h.site][h.head] for h in heads})
    torch.testing.assert_close(filled, _logits(folded, ids), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)  # gates off again: the stock model


def test_latent_attention_heads_are_v_head_dim_wide():
    model, _, _ = _build("deepseek_v3")
    assert {s.head_dim for s in sites_or_error(model)} == {6}  # v_head_dim, not hidden_size / heads (8)


def _jamba():
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_expand=2,
                      mamba_dt_rank=4, use_mamba_kernels=False, pad_token_id=0)
    torch.manual_seed(0)
    return JambaForCausalLM(cfg).eval()


def test_hybrid_keeps_its_layer_numbers_and_refuses_a_mamba_layer():
    from headsweep.workers.families.hf_shared.sites import headless_layers

    model = _jamba()
    sites = sites_or_error(model)
    assert [(s.layer, s.module_name) for s in sites] == [(1, "model.layers.1.self_attn"),
                                                         (3, "model.layers.3.self_attn")]
    assert headless_layers(model, sites) == [0, 2]
    gates = HeadGates(sites)
    with pytest.raises(HeadsweepError, match=r"^head self:2:0: layer 2 has no self attention heads \(this model's "
                                             r"self attention is in layers 1, 3\)$"):
        gates.set_mask([Head("self", 2, 0)])
    gates.set_mask([Head("self", 3, 1)])  # an attention layer's head is taken


def test_models_without_heads_or_with_undescribed_attention_are_refused():
    from transformers import MambaConfig, MambaForCausalLM, RwkvConfig, RwkvForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(HeadsweepError, match=r"^no attention modules recognised in MambaForCausalLM: its layers are "
                                             r"state-space \(Mamba\) layers, without attention heads \(model.kind "
                                             r"hf_causal_lm takes .*\)$"):
        sites_or_error(mamba)
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                                      intermediate_size=32))
    with pytest.raises(HeadsweepError, match="RwkvForCausalLM: its layers are recurrent \\(RWKV\\) layers"):
        sites_or_error(rwkv)
    # An attention module no row describes (a Llama attention renamed, its head size attribute gone): refused,
    # never gated by a guess.
    model, _, _ = _build("gpt_neox")
    attention = model.gpt_neox.layers[1].attention
    attention.__class__ = type("RenamedAttention", (nn.Module,), {"forward": type(attention).forward})
    with pytest.raises(HeadsweepError, match=r"^GPTNeoXForCausalLM has attention modules RenamedAttention \(an "
                                             r"attention layout headsweep has no description of\): refused"):
        sites_or_error(model)


def test_pruning_a_described_layout_is_refused_in_one_line():
    """CodeGen's qkv_proj interleaves its heads in blocks of model-parallel shards: no slicing rule describes it."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    from headsweep.workers.families.hf_causal_lm.model.pruning import prune_causal_lm_heads

    torch.manual_seed(0)
    model = CodeGenForCausalLM(CodeGenConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                             n_positions=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadsweepError, match=r"^transformer.h.0.attn \(CodeGenAttention\): no separate q_proj, "
                                             r"k_proj and v_proj; gate its heads without pruning$"):
        prune_causal_lm_heads(model, [Head("self", 0, 1)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed


# Physical pruning of the fused and latent layouts (workers/families/hf_causal_lm/fused_pruning.py): one mask leaves
# uneven key/value groups in layer 0 and empties layer 1, the other removes two heads of layer 0 and one of layer 1.
PRUNED = ["gpt_neox", "falcon_mqa", "falcon_grouped", "falcon_alibi", "bloom", "deepseek_v3", "phi3", "opt", "gptj"]
PRUNE_MASKS = [[Head("self", 0, 0), *(Head("self", 1, h) for h in range(4))],
               [Head("self", 0, 1), Head("self", 0, 2), Head("self", 1, 3)]]


@pytest.mark.parametrize("name", PRUNED)
def test_pruned_fused_and_latent_layouts_equal_the_gated_model(name, tmp_path):
    from tolerances import assert_routes_agree

    from headsweep.workers.families.hf_causal_lm.model.pruning import load_pruned, prune_causal_lm_heads
    from headsweep.workers.families.hf_shared.pruning import save_pruned

    model, _, _ = _build(name)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    gates = HeadGates(sites_or_error(model))
    full = sum(p.numel() for p in model.parameters())
    for i, mask in enumerate(PRUNE_MASKS):
        with gates.masked(mask):
            gated = _logits(model, ids)
        pruned, _, _ = _build(name)  # the same seeded weights, without gates
        prune_causal_lm_heads(pruned, mask)
        got = _logits(pruned, ids)
        # summation order: the pruned projections are narrower; 2 layers and the LM head, width 64 at most
        assert_routes_agree(got, gated, depth=3, width=64, what=f"{name} mask {i}")
        assert sum(p.numel() for p in pruned.parameters()) < full
        save_pruned(pruned, tmp_path / f"m{i}")
        reloaded = load_pruned(tmp_path / f"m{i}", attn_implementation="eager")
        torch.testing.assert_close(_logits(reloaded, ids), got, rtol=0, atol=0)  # exact: the same model rebuilt


@pytest.mark.parametrize(("name", "reason"), [
    ("gpt_neox", r"GPTNeoXForCausalLM's config derives the head size from the hidden size \(hidden_size / "
                 r"num_attention_heads\)"),
    ("falcon_grouped", r"FalconForCausalLM's config derives the head size from the hidden size \(hidden_size / "
                       r"num_attention_heads\)"),
    ("bloom", r"BloomForCausalLM's config derives the head size from hidden_size / n_head and its ALiBi slopes from "
              r"n_head: a stock config with fewer heads would give the kept heads other slopes"),
])
def test_stock_export_of_a_fused_layout_is_refused_with_the_reason(name, reason):
    from headsweep.workers.families.hf_causal_lm.model.stock import stock_sizes

    model, _, _ = _build(name)
    with pytest.raises(HeadsweepError, match=f"^{reason}.*export without --stock"):
        stock_sizes(model, [Head("self", 0, 0), Head("self", 1, 0)])


@pytest.mark.parametrize(("name", "sizes"), [("deepseek_v3", {"num_attention_heads": 2, "num_key_value_heads": 2}),
                                           ("phi3", {"num_attention_heads": 2, "num_key_value_heads": 2,
                                                     "head_dim": 8})])
def test_latent_attention_and_phi3_export_a_stock_model(name, sizes, tmp_path):
    """DeepSeek-V3 states its head count apart from its head sizes, Phi-3 its head_dim: the pruned model, saved
    with the pruned counts in config.json, is what stock from_pretrained builds and loads, and it computes the gated
    model's logits."""
    from tolerances import assert_routes_agree
    from transformers import AutoModelForCausalLM

    from headsweep.workers.families.hf_causal_lm.model.pruning import prune_causal_lm_heads
    from headsweep.workers.families.hf_causal_lm.model.stock import stock_sizes
    from headsweep.workers.families.hf_shared.pruning import save_pruned
    from headsweep.workers.families.hf_shared.stock import stock_config

    model, _, _ = _build(name)
    mask = [Head("self", 0, 0), Head("self", 0, 2), Head("self", 1, 0), Head("self", 1, 2)]  # one per kv group
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    with HeadGates(sites_or_error(model)).masked(mask):
        gated = _logits(model, ids)
    pruned, _, _ = _build(name)
    assert stock_sizes(pruned, mask) == sizes
    prune_causal_lm_heads(pruned, mask)
    stock_config(pruned, sizes)
    save_pruned(pruned, tmp_path / "stock")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", attn_implementation="eager").eval()
    assert loaded.config.num_attention_heads == 2
    # summation order: the stock model's narrower projections against the gated full model
    assert_routes_agree(_logits(loaded, ids), gated, depth=3, width=64, what=f"stock {name}")
