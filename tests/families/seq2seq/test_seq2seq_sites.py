"""hf_seq2seq site rows proved on logits alone (no tokenizer, no beam search): PegasusX, whose encoder attends to
local blocks and to global tokens and runs its output projection once on each, and T5Gemma (Gemma's attention,
grouped key/value heads, sliding and full layers, in an encoder-decoder). Every head of every attention type,
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


def tiny_t5gemma():
    import transformers

    # 4 query heads over 2 key/value heads; layer 0 slides over 4 tokens, layer 1 attends to all
    stack = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=8,
                 sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    cfg = transformers.T5GemmaConfig(encoder=stack, decoder=dict(stack, cross_attention_hidden_size=32),
                                     vocab_size=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.T5GemmaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


# model, and the module names of each attention type's output projection (written here: no headsweep code)
MODELS = {
    "pegasus_x": (tiny_pegasus_x, {"enc_self": "model.encoder.layers.{}.self_attn.out_proj",
                                   "enc_dec": "model.decoder.layers.{}.encoder_attn.out_proj",
                                   "dec_self": "model.decoder.layers.{}.self_attn.out_proj"}),
    "t5gemma": (tiny_t5gemma, {"enc_self": "model.encoder.layers.{}.self_attn.o_proj",
                               "enc_dec": "model.decoder.layers.{}.cross_attn.o_proj",
                               "dec_self": "model.decoder.layers.{}.self_attn.o_proj"}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_head_equals_weight_surgery(name):
    build, names = MODELS[name]
    model = build()
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
            proj = reference.get_submodule(names[head.attention].format(head.layer))
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


def test_t5gemma_translates_through_the_family_as_plain_generate(tmp_path):
    """T5Gemma's generation config sets no search (transformers 5 leaves it None and fills generate's defaults): the
    family runs the same search, and its unmasked and gated translations equal a plain ``generate`` per sentence of
    a fresh copy (gated: with the head's output-projection columns zeroed)."""
    import transformers
    from tiny_seq2seq import build_tokenizer, write_pairs

    from headsweep.workers.core.family import RuntimeOptions

    tokenizer = build_tokenizer()
    stack = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                 query_pre_attn_scalar=8)
    cfg = transformers.T5GemmaConfig(encoder=stack, decoder=dict(stack, cross_attention_hidden_size=32),
                                     vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=0,
                                     decoder_start_token_id=0)
    torch.manual_seed(0)
    transformers.T5GemmaForConditionalGeneration(cfg).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    source, target = write_pairs(tmp_path, 6)
    family = model_family("hf_seq2seq")
    adapter = family.load(family.model_config(path=str(tmp_path / "model"), max_new_tokens=6),
                          family.data_config(source=str(source), target=str(target)),
                          RuntimeOptions(batch_size=4, masks_per_batch=1))
    assert adapter.describe().facts["num_beams"] == 1
    head = Head("dec_self", 1, 2)
    baseline, gated = adapter.evaluate([[], [head]])
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "model").eval()

    def plain() -> list[str]:
        with torch.no_grad():
            return [tokenizer.batch_decode(reference.generate(**tokenizer([line], return_tensors="pt"),
                                                              max_new_tokens=6), skip_special_tokens=True)[0]
                    for line in source.read_text().splitlines()]

    assert baseline.outputs == plain() and any(baseline.outputs)
    with torch.no_grad():
        reference.get_submodule("model.decoder.layers.1.self_attn.o_proj").weight[:, 16:24] = 0.0
    assert gated.outputs == plain() and gated.outputs != baseline.outputs
