"""The head gate against an independent route: the same model with W_O columns zeroed."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import random_batch, tiny_classifier, zeroed_copy

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_shared.sites import find_sites

FAMILIES = ["bert", "roberta", "distilbert"]
ATTN = ["eager", "sdpa"]


def logits(model, batch):
    ids, mask = batch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def all_masks(inventory):
    singles = [[h] for h in inventory.heads]
    all_but_one = [[o for o in shape.heads() if o != kept] for shape in inventory.layers for kept in shape.heads()]
    return singles + all_but_one


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ATTN)
def test_gate_equals_zeroed_output_projection(family, attn):
    model = tiny_classifier(family, attn)
    reference = copy.deepcopy(model)
    gates = HeadGates(find_sites(model))
    assert len(gates.inventory.heads) == 8
    batch = random_batch()
    base = logits(model, batch)
    torch.testing.assert_close(base, logits(reference, batch), rtol=0, atol=0)  # exact: the same model, copied
    for mask in all_masks(gates.inventory):
        with gates.masked(mask):
            gated = logits(model, batch)
        expected = logits(zeroed_copy(reference, mask), batch)
        # exact: a gate of 0 and zeroed W_O columns feed the same matrix product (same shapes) the same zeros
        assert torch.equal(gated, expected), (family, attn, mask)
        # other: the route must be able to fail: ablation changes the logits.
        assert (gated - base).abs().max().item() > 1e-6, mask
    torch.testing.assert_close(logits(model, batch), base, rtol=0, atol=0)  # exact: the gates are off again




def test_gate_gradient_reaches_gate_values():
    model = tiny_classifier("bert", "eager")
    gates = HeadGates(find_sites(model))
    values = {s.key: torch.ones(s.num_heads, requires_grad=True) for s in gates.sites}
    gates.set_values(values)
    ids, mask = random_batch()
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    for v in values.values():
        assert v.grad is not None and v.grad.abs().sum() > 0


def test_heads_come_from_the_model_and_are_checked():
    model = tiny_classifier("distilbert", "eager", layers=3, heads=2)
    gates = HeadGates(find_sites(model))
    assert [str(h) for h in gates.inventory.heads][:3] == ["self:0:0", "self:0:1", "self:1:0"]
    with pytest.raises(HeadsweepError, match="head 2 out of range"):
        gates.set_mask([Head("self", 0, 2)])
    with pytest.raises(HeadsweepError, match="layer 3 out of range"):
        gates.set_mask([Head("self", 3, 0)])
    with pytest.raises(HeadsweepError, match="no 'enc_self' attention"):
        gates.set_mask([Head("enc_self", 0, 0)])


def test_model_without_attention_is_refused():
    from transformers import FNetConfig, FNetForSequenceClassification

    model = FNetForSequenceClassification(FNetConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1,
                                                     intermediate_size=32, num_labels=2))
    assert find_sites(model) == []
    with pytest.raises(HeadsweepError, match="no attention modules"):
        HeadGates(find_sites(model))
