"""Prefix reuse for classifiers against the plain path: the same logits for every head and every all-but-one mask.

The plain path is the independent route here: the whole gated model for one mask at a time
(itself checked against zeroed W_O columns in test_gates_hf.py). Weights are drawn larger than
the families' defaults so that every ablation moves the logits visibly.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_batch, tiny_classifier
from tolerances import assert_routes_agree
from transformers import ElectraConfig, ElectraForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_classifier.adapter import load_classifier
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.families.hf_classifier.reuse import PrefixReuse, classifier_layout
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.memory.batch_budget import CPU_ACTIVATION_BYTES, CPU_PASS_BYTES, masks_per_forward
from headsweep.workers.memory.replay import ReuseUnsupported, first_gated_layer

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS, HEADS = 3, 4
# The summation-order bound's shape: the layers plus one for the pooler and classifier; the feed-forward size.
SHAPE = {"depth": LAYERS + 1, "width": 64}


def visible(model, std: float = 0.3):
    """Redraw every linear layer's weights and biases with ``std`` (seeded)."""
    torch.manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, std)
                module.bias.normal_(0, std)
    return model


def tiny_electra(attn: str):
    # embedding_size < hidden_size: ELECTRA projects its embeddings before the first layer.
    torch.manual_seed(0)
    cfg = ElectraConfig(vocab_size=60, embedding_size=16, hidden_size=32, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64, num_labels=3,
                        attn_implementation=attn)
    return ElectraForSequenceClassification(cfg).eval()


def build(family: str, attn: str):
    model = tiny_electra(attn) if family == "electra" else tiny_classifier(family, attn, layers=LAYERS, heads=HEADS)
    model = visible(model)
    gates = HeadGates(find_sites(model))
    return model, gates, PrefixReuse(model, gates, classifier_layout(model, gates.sites), budget_bytes=1 << 30)


def grid(inventory) -> list[list[Head]]:
    singles = [[h] for h in inventory.heads]
    all_but_one = [[o for o in s.heads() if o != kept] for s in inventory.layers for kept in s.heads()]
    return singles + all_but_one


def plain_logits(model, gates, inputs, mask):
    with gates.masked(mask):
        return model(**inputs).logits


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.inference_mode()
def test_reuse_equals_plain_for_every_head_and_all_but_one(family, attn):
    model, gates, reuse = build(family, attn)
    ids, attention_mask = random_batch()
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    states = reuse.record(inputs)
    baseline = model(**inputs).logits
    torch.testing.assert_close(states.logits, baseline, rtol=0, atol=0)  # exact: the same forward pass, recorded
    masks = grid(gates.inventory)
    by_layer: dict[int, list[list[Head]]] = {}
    for mask in masks:
        expected = plain_logits(model, gates, inputs, mask)
        # exact: one mask per pass is the same arithmetic as the plain path, so the same floats.
        alone = reuse.run(inputs, states, first_gated_layer(mask), [mask])
        torch.testing.assert_close(alone, expected, rtol=0, atol=0, msg=f"{family} {attn} {mask}")
        assert (expected - baseline).abs().max() > 1e-2, f"ablating {mask} should move the logits"  # other
        by_layer.setdefault(first_gated_layer(mask), []).append(mask)
    for layer, group in by_layer.items():
        packed = reuse.run(inputs, states, layer, group).view(len(group), ids.shape[0], -1)
        for mask, got in zip(group, packed, strict=True):
            # summation order: several masks in one pass multiply taller matrices than one mask alone
            assert_routes_agree(got, plain_logits(model, gates, inputs, mask), **SHAPE, what=(family, attn, mask))




@torch.inference_mode()
def test_layers_before_the_first_gated_layer_are_not_computed():
    model, gates, reuse = build("bert", "eager")
    ids, attention_mask = random_batch()
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    queries = [layer.attention.self.query for layer in model.bert.encoder.layer]
    calls = [0] * LAYERS
    handles = [q.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, q in enumerate(queries)]
    states = reuse.states(0, inputs)
    assert calls == [1] * LAYERS and reuse.kept_bytes == states.nbytes > 0
    assert reuse.states(0, inputs) is states, "kept states are not recorded again"
    reuse.run(inputs, states, 2, [[Head("self", 2, 1)], [Head("self", 2, 0)]])
    assert calls == [1] * LAYERS, "layers 0..2 (queries of the gated layer included) must be skipped"
    reuse.run(inputs, states, 1, [[Head("self", 1, 1)]])
    assert calls == [1, 1, 2]
    for h in handles:
        h.remove()


@torch.inference_mode()
def test_states_over_budget_are_recorded_per_call_with_the_same_results():
    model, gates, _ = build("distilbert", "sdpa")
    ids, attention_mask = random_batch()
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    small = PrefixReuse(model, gates, classifier_layout(model, gates.sites), budget_bytes=0)
    states = small.states(0, inputs)
    assert small.kept_bytes == 0 and small.states(0, inputs) is not states
    mask = [Head("self", 1, 2)]
    # exact: one mask per pass, states recorded per call: the plain path's arithmetic
    torch.testing.assert_close(small.run(inputs, states, 1, [mask]), plain_logits(model, gates, inputs, mask),
                               rtol=0, atol=0)


def test_decoder_only_layouts_are_refused_with_a_reason():
    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_labels=2, pad_token_id=0)
    model = LlamaForSequenceClassification(cfg).eval()
    with pytest.raises(ReuseUnsupported, match="neither a BERT-style attention"):
        classifier_layout(model, find_sites(model))


# -- the adapter ----------------------------------------------------------------------------------
def adapter(model_dir, data, **runtime):
    return load_classifier(ClassifierModel(path=str(model_dir)), ClassifierData(path=str(data)),
                           RuntimeOptions(batch_size=16, **runtime))




def test_automatic_masks_per_forward_follows_the_memory_budget(tiny_bert_dir, tiny_dev_tsv):
    task = adapter(tiny_bert_dir, tiny_dev_tsv, masks_per_batch=0)
    per_row = task.bytes_per_row()
    assert per_row > 0
    # a dense pass on a CPU: within CPU_PASS_BYTES, below the memory budget
    assert task.masks_per_forward() == max(1, CPU_PASS_BYTES // (per_row * 16)) > 1
    assert adapter(tiny_bert_dir, tiny_dev_tsv, masks_per_batch=3).masks_per_forward() == 3
    cpu = torch.device("cpu")
    assert masks_per_forward(0, 32, CPU_PASS_BYTES // 64, cpu) == 2
    assert masks_per_forward(0, 32, CPU_PASS_BYTES, cpu) == 1
    # state kept across steps (beam search): the memory budget alone
    assert masks_per_forward(0, 32, CPU_ACTIVATION_BYTES // 64, cpu, dense=False) == 2
    unbounded = masks_per_forward(0, 32, CPU_PASS_BYTES // 64, cpu, dense=False)
    assert unbounded == CPU_ACTIVATION_BYTES // CPU_PASS_BYTES * 2
