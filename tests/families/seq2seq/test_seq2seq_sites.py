"""hf_seq2seq site rows proved on logits alone (no tokenizer, no beam search): PegasusX, whose encoder attends to
local blocks and to global tokens and runs its output projection once on each. Every head of every attention type,
gated by the family's own sites and hooks, gives the teacher-forced logits of a fresh copy whose output projection
has that head's input columns zeroed (the module names written here, no headsweep code); per-example gate rows gate
their own rows only; physical pruning of the layout is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error
from headsweep.workers.families.registry import model_family

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_pegasus_x():
    import transformers

    # blocks of 4 tokens and 4 global tokens: a 9-token input runs both the local and the global path
    cfg = transformers.PegasusXConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=64, block_size=4,
                                      num_global_tokens=4, dropout=0.0, attention_dropout=0.0, init_std=0.2)
    torch.manual_seed(0)
    model = transformers.PegasusXForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1, so a wrong split would show
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def projection(model, head: Head):
    stack = model.model.encoder if head.attention == "enc_self" else model.model.decoder
    layer = stack.layers[head.layer]
    return (layer.encoder_attn if head.attention == "enc_dec" else layer.self_attn).out_proj


def test_pegasus_x_every_head_equals_weight_surgery():
    model = tiny_pegasus_x()
    reference = copy.deepcopy(model)
    ids = torch.randint(4, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    gates = HeadGates(seq2seq_sites_or_error(model))
    heads = list(gates.inventory.heads)
    assert len(heads) == 24 and {h.attention for h in heads} == {"enc_self", "enc_dec", "dec_self"}
    with torch.no_grad():
        base = model(**batch).logits
        scale = base.abs().max().item()
        for head in heads:
            gates.set_mask([head])
            gated = model(**batch).logits
            proj = projection(reference, head)
            saved = proj.weight.detach().clone()
            proj.weight[:, head.head * 8:(head.head + 1) * 8] = 0.0
            expected = reference(**batch).logits
            proj.weight.copy_(saved)
            assert (gated - expected).abs().max().item() <= 1e-5 * scale, head
            assert (gated - base).abs().max().item() > 1e-4 * scale, head  # the gate does something
        # one mask per example row: row 0 unmasked, row 1 without enc_self:1:2
        gates.set_values({("enc_self", 1): torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 1]])})
        rows = model(**batch).logits
        gates.set_mask([Head("enc_self", 1, 2)])
        masked = model(**batch).logits
    gates.clear()
    assert torch.equal(rows[0], base[0]) and (rows[1] - masked[1]).abs().max().item() <= 1e-5 * scale


def test_pegasus_x_pruning_and_lrp_refused_in_one_line():
    model = tiny_pegasus_x()
    family = model_family("hf_seq2seq")
    with pytest.raises(HeadsweepError, match=r"PegasusXForConditionalGeneration: physical pruning is not supported "
                                             r"\(attention layout 'pegasus_x' is not one headsweep prunes\)"):
        family.prune(model, [Head("enc_self", 0, 0)])
    # local / global blocks: the LRP rules are not written for them (the attention path LRP enters refuses)
    with pytest.raises(HeadsweepError, match=r"rules are written for BART-style .* not for "
                                             r"PegasusXForConditionalGeneration \(model_type 'pegasus_x'\)$"):
        family.attention_weights(model, family.find_sites(model), lambda _key, _weights: None)
