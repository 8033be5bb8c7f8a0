"""Head gates of decoder-only LMs against an independent route: the same model with that head's output-projection
input features zeroed by weight surgery (``o_proj`` columns; GPT-2: rows of the transposed ``Conv1D`` ``c_proj``),
for every head and every all-but-one mask, eager and SDPA, on grouped-query (8/2, 14/2 with biases), multi-query
(4/1), plain multi-head (4/4) models, GPT-2, and Mistral, Qwen3 and GPTBigCode shapes."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import CAUSAL_LM_SHAPES, tiny_causal_lm, zeroed_output_columns
from tiny_models import lm_batch as batch
from tiny_models import lm_logits as logits

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.model.sites import find_sites, kv_groups, sites_or_error

ATTN = ["eager", "sdpa"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def all_masks(inventory):
    singles = [[h] for h in inventory.heads]
    all_but_one = [[o for o in shape.heads() if o != kept] for shape in inventory.layers for kept in shape.heads()]
    return singles + all_but_one


@pytest.mark.parametrize("shape", list(CAUSAL_LM_SHAPES))
@pytest.mark.parametrize("attn", ATTN)
def test_gate_equals_zeroed_output_projection(shape, attn):
    model = tiny_causal_lm(shape, attn)
    reference = copy.deepcopy(model)
    gates = HeadGates(find_sites(model))
    _, heads, kv, _ = CAUSAL_LM_SHAPES[shape]
    assert [s.num_heads for s in gates.inventory.layers] == [heads, heads]
    assert [len(g) for g in kv_groups(gates.sites).values()] == [kv, kv]
    ids = batch(model.config.vocab_size)
    base = logits(model, ids)
    torch.testing.assert_close(base, logits(reference, ids), rtol=0, atol=0)  # exact: the same model, copied
    for mask in all_masks(gates.inventory):
        with gates.masked(mask):
            gated = logits(model, ids)
        expected = logits(zeroed_output_columns(reference, mask), ids)
        # exact: a gate of 0 and zeroed projection weights feed the same matrix product (same shapes) the same zeros
        assert torch.equal(gated, expected), (shape, attn, mask)
        # other: the route must be able to fail: ablation changes the logits.
        assert (gated - base).abs().max().item() > 1e-6, mask
    torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=0)  # exact: the gates are off again


def test_surgery_on_the_output_side_is_not_a_head():
    """Zeroing a slice of ``o_proj``'s output (a 'pseudo-head', what generic hooking code often does) is not the
    gate: the test's route would catch a gate placed there."""
    model = tiny_causal_lm("llama_8q2kv", "eager")
    gates = HeadGates(find_sites(model))
    ids = batch(model.config.vocab_size)
    head = Head("self", 0, 3)
    with gates.masked([head]):
        gated = logits(model, ids)
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.model.layers[0].self_attn.o_proj.weight[3 * 4 : 4 * 4, :] = 0.0
    # other: a different function of the input; differences are of the order of the logits
    assert (logits(wrong, ids) - gated).abs().max().item() > 1e-3




def test_gate_gradient_reaches_every_query_head():
    model = tiny_causal_lm("qwen2_14q2kv", "eager")
    gates = HeadGates(find_sites(model))
    values = {s.key: torch.ones(s.num_heads, requires_grad=True) for s in gates.sites}
    gates.set_values(values)
    model(input_ids=batch(model.config.vocab_size), use_cache=False).logits.sum().backward()
    gates.clear()
    for v in values.values():
        assert v.grad is not None and bool((v.grad != 0).all())


def test_model_without_recognisable_attention_is_refused():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert find_sites(model) == []
    with pytest.raises(HeadsweepError,
                       match="no attention modules recognised in MambaForCausalLM: its layers are state-space .*GPT-2"):
        sites_or_error(model)
