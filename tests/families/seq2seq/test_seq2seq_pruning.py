"""Physical pruning and ``export`` of hf_seq2seq models, in process on tiny Marian and T5 models built from their
config classes: the pruned model gives the gated model's teacher-forced logits and beam hypotheses for all three
attention types (a layer emptied of every head, T5's shared relative position bias with different heads kept per
layer); the exported folder reloads to the same logits through the family's own loader (``headsweep.load_pruned``);
T5's stock export (uniform masks) loads with stock ``from_pretrained``; what no stock config states, and FSMT, are
refused in one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from tiny_seq2seq import build_tokenizer, save_tiny_seq2seq, write_pairs

import headsweep
from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.pruning.export import export_pruned
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error
from headsweep.workers.families.registry import model_family

TYPES = ("enc_self", "enc_dec", "dec_self")
# Every attention type loses heads; decoder self-attention layer 0 loses all four (its cache must still count);
# the encoder's layers keep different heads (T5: its layers share one relative bias, a column per head).
MIXED = ["enc_self:0:1", "enc_self:1:0", "enc_self:1:2", "enc_dec:1:3", "enc_dec:0:0", "dec_self:0:0", "dec_self:0:1",
         "dec_self:0:2", "dec_self:0:3", "dec_self:1:1"]
# Heads 1 and 3 of every module: what T5's config states as num_heads 2.
UNIFORM = [f"{a}:{layer}:{h}" for a in TYPES for layer in range(2) for h in (1, 3)]


def heads(names):
    return [Head.parse(n) for n in names]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: (config file, model folder)} for tiny Marian and T5 models and a few test pairs."""
    root = tmp_path_factory.mktemp("seq2seq_pruning")
    source, target = write_pairs(root, 4)
    out = {}
    for kind in ("marian", "t5"):
        model_dir = save_tiny_seq2seq(root / kind, kind)
        cfg = {"model": {"kind": "hf_seq2seq", "path": str(model_dir), "max_new_tokens": 10},
               "data": {"source": str(source), "target": str(target)}}
        (root / f"{kind}.yaml").write_text(yaml.safe_dump(cfg))
        out[kind] = (root / f"{kind}.yaml", model_dir)
    return out


def batch():
    """A padded source batch and its reference labels (teacher forcing)."""
    from headsweep.sweep.demo.translation import synthetic_pairs

    tokenizer = build_tokenizer()
    src, tgt = synthetic_pairs(4, seed=3)
    inputs = tokenizer(src, padding=True, return_tensors="pt")
    labels = tokenizer(text_target=tgt, padding=True, return_tensors="pt")["input_ids"]
    return inputs, labels


def outputs(model, mask=None):
    """Teacher-forced logits and the beam search's sequences of ``model``, gated by ``mask`` (hooks on a copy)."""
    inputs, labels = batch()
    gates = HeadGates(seq2seq_sites_or_error(model)) if mask is not None else None
    with torch.no_grad():
        if gates:
            gates.set_mask(heads(mask))
        logits = model(**inputs, labels=labels).logits
        beams = model.generate(**inputs, num_beams=4, max_new_tokens=10)
    if gates:
        gates.remove()
    return logits, beams


def fresh(model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()


@pytest.mark.parametrize("kind", ["marian", "t5"])
def test_exported_pruned_model_equals_the_gated_model_and_reloads_exactly(kind, folders, tmp_path):
    config, model_dir = folders[kind]
    want_logits, want_beams = outputs(fresh(model_dir), MIXED)
    full_logits, _ = outputs(fresh(model_dir))
    out = export_pruned(load_config(str(config)), tmp_path / "pruned", mask=MIXED)
    manifest = json.loads((out / "headsweep-export.json").read_text())
    assert manifest["format"] == "pruned_heads" and manifest["n_params_pruned"] < manifest["n_params_full"]
    assert manifest["heads_kept"]["dec_self:0"] == [] and manifest["heads_kept"]["enc_self:1"] == [1, 3]
    recorded = json.loads((out / "config.json").read_text())["pruned_heads"]
    assert recorded["dec_self:0"] == [0, 1, 2, 3] and recorded["enc_dec:1"] == [3]
    pruned = headsweep.load_pruned(str(out))  # the family's own rebuild: stock architecture, heads removed, strict
    got_logits, got_beams = outputs(pruned)
    scale = want_logits.abs().max().item()
    assert (got_logits - want_logits).abs().max().item() <= 1e-5 * scale
    assert torch.equal(got_beams, want_beams), kind  # beam for beam, with an emptied decoder layer in the cache
    assert (full_logits - want_logits).abs().max().item() > 1e-2 * scale  # the mask changes the model
    # The pruned folder is a model.kind hf_seq2seq folder: the family's loader gives the same logits, and its
    # sites are the kept heads renumbered (the emptied layer has none).
    loaded = model_family("hf_seq2seq").load_model(load_config(str(config)).model.__class__(
        kind="hf_seq2seq", path=str(out)))
    assert torch.equal(outputs(loaded.model)[0], got_logits)
    shape = {s.key: s.num_heads for s in seq2seq_sites_or_error(loaded.model)}
    assert ("dec_self", 0) not in shape and shape[("enc_self", 1)] == 2 and shape[("enc_dec", 1)] == 3


def test_t5_uniform_mask_exports_a_stock_model(folders, tmp_path):
    from transformers import T5ForConditionalGeneration

    config, model_dir = folders["t5"]
    want_logits, want_beams = outputs(fresh(model_dir), UNIFORM)
    out = export_pruned(load_config(str(config)), tmp_path / "stock", mask=UNIFORM, stock=True)
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_heads"] == 2 and "pruned_heads" not in saved
    assert json.loads((out / "headsweep-export.json").read_text())["stock_sizes"] == {"num_heads": 2}
    stock = T5ForConditionalGeneration.from_pretrained(out).eval()  # stock transformers, no headsweep code
    assert stock.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape[1] == 2
    logits, beams = outputs(stock)
    assert (logits - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max().item()
    assert torch.equal(beams, want_beams)


@pytest.mark.parametrize(("kind", "mask", "reason"), [
    ("marian", UNIFORM, "MarianMTModel's config derives the head size from the hidden size (d_model / attention "
                        "heads)"),
    ("t5", MIXED, "removes every head of an attention module"),
    ("t5", UNIFORM[:-1], "keeps 2 or 3 heads in different attention modules"),
    ("t5", [f"{a}:{layer}:{h}" for a in TYPES for layer in range(2) for h in ((1, 3) if layer else (0, 2))],
     "the enc_self layers keep different heads"),
])
def test_stock_export_refused_with_the_reason_and_nothing_written(kind, mask, reason, folders, tmp_path):
    config, _ = folders[kind]
    with pytest.raises(HeadsweepError) as info:
        export_pruned(load_config(str(config)), tmp_path / "out", mask=mask, stock=True)
    assert reason in str(info.value) and "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_fsmt_pruning_is_refused_in_one_line():
    from tiny_seq2seq import tiny_seq2seq

    model = tiny_seq2seq("fsmt", layers=1, heads=2, vocab_size=16)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(HeadsweepError, match=r"FSMTForConditionalGeneration: physical pruning is not supported "
                                             r"\(its attention reshapes the heads' output to the model's width"):
        model_family("hf_seq2seq").prune(model, [Head("enc_self", 0, 0)])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing changed
