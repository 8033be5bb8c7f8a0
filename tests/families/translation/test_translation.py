"""fairseq translation adapter: gates against zeroed W_O columns, BLEU against sacrebleu, loading and errors.

Every check compares the adapter with an independent route: a model freshly loaded by
fairseq's own loader, with the head's output-projection columns set to zero, decoded or
scored by fairseq alone (tests/tiny_fairseq.py).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import warnings

import numpy as np
import pytest
import sacrebleu
import torch
import torch.nn.functional as F
import yaml
from tiny_fairseq import (
    BOUND_SHAPE,
    attention_module,
    fairseq_load,
    plain_beam_search,
    plain_reference_nll,
    zero_heads,
)
from tolerances import assert_routes_agree, max_difference, route_bound

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import load_config
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.core.metrics import BLEU, bleu_from_stats
from headsweep.workers.families.fairseq_translation.adapter import load_translation
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.config import TranslationRuntime as RuntimeOptions
from headsweep.workers.families.fairseq_translation.sites import find_fairseq_sites, gate_fairseq_model
from headsweep.workers.families.registry import model_family

BEAM, MAX_LEN_B, N_TEST = 3, 24, 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny fairseq model (conftest.trained_tiny_fairseq: read, never changed)."""
    return trained_tiny_fairseq


def make_task(tiny, batch_size=64, masks_per_batch=1, **model_overrides):
    model_cfg = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=BEAM,
                                 max_len_b=MAX_LEN_B, **model_overrides)
    data_cfg = TranslationData(data_bin=str(tiny.data.data_bin), split="test")
    return load_translation(model_cfg, data_cfg, RuntimeOptions(batch_size=batch_size, masks_per_batch=masks_per_batch,
                                                                 max_tokens=0))


@pytest.fixture(scope="module")
def task(tiny):
    return make_task(tiny)


@pytest.fixture(scope="module")
def fresh(tiny):
    """A clean model (no hooks, fused path on) from fairseq's loader, never used for generation."""
    return fairseq_load(tiny.checkpoint, tiny.data.data_bin)


@pytest.fixture(scope="module")
def heads(task):
    return task.describe().inventory.heads


@pytest.fixture(scope="module")
def reference_decodes(fresh, task, heads):
    """For each single head: fairseq's beam search of the zeroed-column copy."""
    model, ftask = fresh
    sources = task.examples.source
    out = {(): plain_beam_search(copy.deepcopy(model), ftask, sources, BEAM, MAX_LEN_B)}
    for head in heads:
        out[(head,)] = plain_beam_search(zero_heads(copy.deepcopy(model), [head]), ftask, sources, BEAM, MAX_LEN_B)
    return out


def assert_same_decodes(gated, reference, what):
    assert len(gated) == len(reference)
    for i, (hyp, (tokens, score)) in enumerate(zip(gated, reference, strict=True)):
        assert hyp.tokens.tolist() == tokens, f"{what}: sentence {i} differs"
        # summation order: gated modules take fairseq's non-fused attention, the reference its fused one
        assert_routes_agree(hyp.score, score, **BOUND_SHAPE, what=f"{what}: sentence {i}")


# -- sites and the fused attention path -----------------------------------------------------
def test_sites_cover_every_attention_type(task):
    inv = task.describe().inventory
    assert inv.attention_types == ["enc_self", "enc_dec", "dec_self"]
    assert [(s.attention, s.layer, s.num_heads) for s in inv.layers] == [
        (a, layer, 4) for a in ("enc_self", "enc_dec", "dec_self") for layer in (0, 1)
    ]
    assert all(site.batch_dim == 1 for site in task.gates.sites)


def _count_fused_calls(monkeypatch):
    """Every call of the fused kernel, as the output projection weight it was given (positional arg 11)."""
    calls = []
    original = F.multi_head_attention_forward

    def counting(*args, **kwargs):
        calls.append(args[11])
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "multi_head_attention_forward", counting)
    return calls


def test_plain_hooks_are_silently_skipped_on_the_fused_path_and_ours_are_not(fresh, task, monkeypatch):
    model, _ = fresh
    model = copy.deepcopy(model)
    sample = task.batches[0]
    head = Head("enc_self", 0, 1)

    def encode():
        net = sample["net_input"]
        with torch.no_grad():
            return model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])["encoder_out"][0]

    calls = _count_fused_calls(monkeypatch)
    plain = HeadGates(find_fairseq_sites(model))  # the trap: hooks only
    unmasked = encode()
    with plain.masked([head]):
        ignored = encode()
    plain.remove()
    assert len(calls) > 0, "the encoder should take fairseq's fused path without our fix"
    # exact: the fused path never calls the hooked module, so the same arithmetic
    assert torch.equal(unmasked, ignored), "a plain hook on out_proj has no effect on the fused path"

    calls.clear()
    gates = gate_fairseq_model(model)
    gated_weight = model.encoder.layers[0].self_attn.out_proj.weight
    with gates.masked([head]):
        gated = encode()
    gates.remove()
    assert not any(w is gated_weight for w in calls), "a gated module must not take the fused path"
    assert calls, "the module no gate touches keeps the fused path"
    zeroed = zero_heads(copy.deepcopy(fresh[0]), [head])
    with torch.no_grad():
        net = sample["net_input"]
        expected = zeroed.encoder(net["src_tokens"], src_lengths=net["src_lengths"])["encoder_out"][0]
    assert (gated - unmasked).abs().max() > 1e-3  # other: the route can fail
    # summation order: non-fused (gated) against fused (zeroed) attention, through the 2 encoder layers
    assert_routes_agree(gated, expected, depth=2, width=64, what=head)
    assert all(not s.module.skip_embed_dim_check for s in gates.sites), "remove() restores the fused path"


def test_no_fused_calls_of_gated_modules_during_beam_search_and_scoring(task, monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    task.translate([[Head("dec_self", 1, 2)]])
    task.reference_loss([[Head("dec_self", 1, 2)]])
    gated_weight = task.model.decoder.layers[1].self_attn.out_proj.weight
    assert not any(w is gated_weight for w in calls)


# -- beam search ------------------------------------------------------------------------------
def test_ungated_beam_search_equals_fairseq(task, reference_decodes):
    assert_same_decodes(task.translate([[]])[0], reference_decodes[()], "baseline")


def test_every_head_gated_beam_search_equals_zeroed_columns(task, heads, reference_decodes):
    gated = task.translate([[h] for h in heads])
    changed = 0
    for head, hyps in zip(heads, gated, strict=True):
        assert_same_decodes(hyps, reference_decodes[(head,)], str(head))
        changed += any(h.tokens.tolist() != r[0] for h, r in zip(hyps, reference_decodes[()], strict=True))
    assert changed >= len(heads) // 2, "most single-head ablations should change some translation"


def test_masks_packed_in_one_beam_search_equal_zeroed_columns(tiny, fresh, heads, reference_decodes):
    # Uneven chunks (5 masks per search, batches of 7 sentences): beams shrink and reorder with
    # sentences of different masks side by side.
    packed = make_task(tiny, batch_size=7, masks_per_batch=5)
    masks = [[h] for h in heads] + [[]]
    for mask, hyps in zip(masks, packed.translate(masks), strict=True):
        assert_same_decodes(hyps, reference_decodes[tuple(mask)], f"packed {mask}")
    model, ftask = fresh
    several = [[Head("enc_self", 0, h) for h in (0, 1, 3)], [Head("enc_dec", 1, 0), Head("dec_self", 0, 2)]]
    for mask, hyps in zip(several, packed.translate(several + [[]])[:2], strict=True):
        expected = plain_beam_search(zero_heads(copy.deepcopy(model), mask), ftask, packed.examples.source,
                                     BEAM, MAX_LEN_B)
        assert_same_decodes(hyps, expected, f"packed {mask}")


# -- teacher-forced scoring -------------------------------------------------------------------
def test_reference_loss_equals_zeroed_columns(tiny, task, fresh, heads):
    model, ftask = fresh
    ex = task.examples
    masks = [[]] + [[h] for h in heads]
    # Scoring after a beam search on the same model, unpacked and packed.
    task.translate([[]])
    unpacked = task.reference_loss(masks)
    packed = make_task(tiny, batch_size=9, masks_per_batch=4).reference_loss(masks)
    for mask, a, b in zip(masks, unpacked, packed, strict=True):
        expected = plain_reference_nll(zero_heads(copy.deepcopy(model), mask), ftask, ex.source, ex.target)
        # summation order: non-fused (gated, unpacked or packed) against fused (zeroed) attention
        assert_routes_agree(a, expected, **BOUND_SHAPE, what=mask)
        assert_routes_agree(b, expected, **BOUND_SHAPE, what=f"packed {mask}")
    # other: the route can fail: one head moves the losses beyond the bound
    assert max_difference(unpacked[1], unpacked[0]) > route_bound(unpacked[0], **BOUND_SHAPE)


# -- BLEU -------------------------------------------------------------------------------------
def test_bleu_from_sentence_stats_equals_sacrebleu(task):
    info = task.describe()
    out = task.evaluate([[], [Head("enc_dec", 1, 0), Head("enc_dec", 1, 1), Head("enc_dec", 1, 2)]])
    rng = np.random.default_rng(0)
    for result in out:
        assert result.stats.shape == (N_TEST, 10)
        expected = sacrebleu.corpus_bleu(result.outputs, [info.references])
        assert 0 < expected.score < 100
        # other: float64 in both (sacrebleu's formula and ours from summed stats); 1e-9 on a score <= 100
        assert result.score == pytest.approx(expected.score, abs=1e-9)
        # Resamples (as the bootstrap draws them) scored from summed rows, vectorised.
        idx = rng.integers(0, N_TEST, size=(5, N_TEST))
        scores = bleu_from_stats(result.stats[idx].sum(axis=1))
        for row, score in zip(idx, scores, strict=True):
            ref = sacrebleu.corpus_bleu([result.outputs[i] for i in row], [[info.references[i] for i in row]])
            assert score == pytest.approx(ref.score, abs=1e-9)  # other: float64, as above
    assert out[1].score < out[0].score
    assert info.facts["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    assert BLEU.stat_names[:3] == ("hyp_len", "ref_len", "correct_1")


def test_bleu_edge_cases_match_sacrebleu():
    cases = [
        (["a b c d e"], ["a b c d e"]),
        (["a"], ["a b c"]),
        (["x y z w"], ["a b c d"]),
        (["a b"], ["a b"]),
        ([""], ["a b c"]),
        (["a b c", "d e f g h"], ["a b c d", "d e f x h"]),
    ]
    for hyps, refs in cases:
        ref = sacrebleu.corpus_bleu(hyps, [refs])
        stats = np.array([ref.sys_len, ref.ref_len, *ref.counts, *ref.totals], dtype=float)
        assert float(bleu_from_stats(stats)) == pytest.approx(ref.score, abs=1e-9), hyps  # other: float64, as above


def test_outputs_follow_example_order_across_batches(tiny, task):
    small_batches = make_task(tiny, batch_size=5)
    a, b = task.translate([[]])[0], small_batches.translate([[]])[0]
    assert [h.tokens.tolist() for h in a] == [h.tokens.tolist() for h in b]
    refs = tiny.data.test_target.read_text().splitlines()
    assert task.describe().references == refs
    assert task.describe().example_ids == [str(i) for i in range(N_TEST)]


# -- loading --------------------------------------------------------------------------------------
def test_checkpoint_loads_back_through_the_config(tiny, fresh, tmp_path):
    root = tiny.checkpoint.parent.parent
    config = {
        "model": {"kind": "fairseq_translation", "checkpoint": "checkpoints/checkpoint_last.pt",
                  "data_bin": "data-bin", "beam": BEAM, "max_len_b": MAX_LEN_B},
        "data": {"source": "test.src", "target": "test.tgt", "max_examples": 30},
    }
    path = root / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path)
    loaded = model_family(cfg.model.kind).load(cfg.model, cfg.data, RuntimeOptions())
    reference = fresh[0].state_dict()
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, reference[key]), key
    info = loaded.describe()
    assert info.dataset == "test" and info.n_examples == 30 and info.metric == "bleu"
    assert info.references == tiny.data.test_target.read_text().splitlines()[:30]
    # Raw text encoded through the model's dictionaries equals fairseq-preprocess's binarised split.
    binarised = make_task(tiny).examples
    assert all(torch.equal(a, b) for a, b in zip(loaded.examples.source, binarised.source[:30], strict=True))
    for checkpoint in tiny.epoch_checkpoints:
        fairseq_load(checkpoint, tiny.data.data_bin)
    assert len(tiny.epoch_checkpoints) == 4


def test_gzipped_text_data(tiny, tmp_path):
    for name in ("test.src", "test.tgt"):
        with gzip.open(tmp_path / f"{name}.gz", "wt") as f:
            f.write((tiny.checkpoint.parent.parent / name).read_text())
    loaded = load_translation(
        TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin)),
        TranslationData(source=str(tmp_path / "test.src.gz"), target=str(tmp_path / "test.tgt.gz")),
        RuntimeOptions(),
    )
    assert loaded.describe().n_examples == N_TEST


def _legacy_checkpoint(tiny, path):
    """The same weights in fairseq's legacy layout: options as a pickled argparse.Namespace."""
    from fairseq import checkpoint_utils

    state = torch.load(tiny.checkpoint, weights_only=True)
    flat = {}
    for section in ("common", "task", "dataset", "optimization", "checkpoint", "criterion", "optimizer"):
        flat.update({k: v for k, v in (state["cfg"].get(section) or {}).items() if not k.startswith("_")})
    flat.update({k: v for k, v in state["cfg"]["model"].items() if not k.startswith("_")})
    flat.update(task="translation", criterion="label_smoothed_cross_entropy", optimizer="adam",
                lr_scheduler="inverse_sqrt", data=str(tiny.data.data_bin))
    state["args"], state["cfg"] = argparse.Namespace(**flat), None
    checkpoint_utils.torch_persistent_save(state, str(path))
    return path


def test_pickled_checkpoint_loads_only_when_trusted(tiny, task, tmp_path):
    legacy = _legacy_checkpoint(tiny, tmp_path / "legacy.pt")
    model_cfg = TranslationModel(checkpoint=str(legacy), data_bin=str(tiny.data.data_bin), beam=BEAM,
                                 max_len_b=MAX_LEN_B)
    data_cfg = TranslationData(data_bin=str(tiny.data.data_bin), split="test", max_examples=10)
    with pytest.raises(HeadsweepError, match=r"pickled Python objects \(argparse.Namespace\).*model.trusted=true"):
        load_translation(model_cfg, data_cfg, RuntimeOptions())
    model_cfg.trusted = True
    trusted = load_translation(model_cfg, data_cfg, RuntimeOptions())
    expected = task.translate([[]])[0][:10]
    assert [h.tokens.tolist() for h in trusted.translate([[]])[0]] == [h.tokens.tolist() for h in expected]


# -- bad inputs ---------------------------------------------------------------------------------
def _error(tiny, tmp_path, model=None, data=None) -> str:
    options = {"checkpoint": str(tiny.checkpoint), "data_bin": str(tiny.data.data_bin), **(model or {})}
    model_cfg = TranslationModel(**options)
    data_cfg = TranslationData(**(data or {"data_bin": str(tiny.data.data_bin)}))
    with pytest.raises(HeadsweepError) as err:
        load_translation(model_cfg, data_cfg, RuntimeOptions())
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_and_foreign_checkpoints(tiny, tmp_path):
    assert "checkpoint not found" in _error(tiny, tmp_path, {"checkpoint": str(tmp_path / "nope.pt")})
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    assert "is not a fairseq checkpoint" in _error(tiny, tmp_path, {"checkpoint": str(text)})
    weights = tmp_path / "weights.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, weights)
    assert "no 'model' with 'cfg' or 'args'" in _error(tiny, tmp_path, {"checkpoint": str(weights)})


def test_dictionary_size_mismatch(tiny, tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "dict.src.txt").write_text((tiny.data.data_bin / "dict.src.txt").read_text())
    (folder / "dict.tgt.txt").write_text((tiny.data.data_bin / "dict.tgt.txt").read_text() + "extra 1\n")
    message = _error(tiny, tmp_path, {"data_bin": str(folder)})
    assert "dict.tgt.txt has" in message and "decoder embedding has" in message


def test_beam_must_be_positive(tiny, tmp_path):
    assert "model.beam must be at least 1" in _error(tiny, tmp_path, {"beam": 0})


def test_mostly_unknown_test_data(tiny, tmp_path):
    src, tgt = tmp_path / "x.src", tmp_path / "x.tgt"
    src.write_text("le chien voit un chat .\nun oiseau chante .\n")
    tgt.write_text("le namo un raco .\nun oiseau .\n")
    message = _error(tiny, tmp_path, data={"source": str(src), "target": str(tgt)})
    assert "of the source tokens of 'x' are unknown" in message
    # A few unknown words: a warning with the rate, and the evaluation goes on.
    src.write_text("the dog sees a cat .\nthe zebra sees a giraffe .\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_translation(TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin)),
                         TranslationData(source=str(src), target=str(tgt)), RuntimeOptions())
    assert any("% of the" in str(w.message) and "unknown" in str(w.message) for w in caught)


def test_misaligned_text_and_bad_options(tiny, tmp_path):
    src, tgt = tmp_path / "a.src", tmp_path / "a.tgt"
    src.write_text("the dog .\nthe cat .\n")
    tgt.write_text("le namo .\n")
    assert "must be line-aligned" in _error(tiny, tmp_path, data={"source": str(src), "target": str(tgt)})
    assert "model.detokenize must be one of" in _error(tiny, tmp_path, {"detokenize": "spacy"})
    assert "no binarised split 'dev'" in _error(tiny, tmp_path, data={"data_bin": str(tiny.data.data_bin),
                                                                     "split": "dev"})


def test_attention_module_helper_matches_sites(task):
    # The reference route's module lookup must address the same modules the gates hook.
    for site in task.gates.sites:
        assert attention_module(task.model, Head(site.attention, site.layer, 0)) is site.module


def test_text_pipeline_sentencepiece_and_moses_roundtrip(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("sacremoses")
    from headsweep.workers.families.fairseq_translation.data import TextPipeline
    from headsweep.workers.families.fairseq_translation.train import build_dictionary

    lines = ["Hello, world! This is a test.", "A dog's toy: red & blue.", "Two (small) cats sleep."] * 30
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=40, model_type="bpe", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    d = build_dictionary([" ".join(sp.encode(line, out_type=str)) for line in lines])
    piece = TextPipeline(TranslationModel(), TranslationData(sentencepiece_model=str(tmp_path / "sp.model")),
                         d, d, "en", "fr")
    assert piece.post_process == "sentencepiece"
    for line in lines[:3]:
        ids = piece.encode(line, "target")
        assert int((ids == d.unk()).sum()) == 0
        assert piece.decode(ids) == line

    words = build_dictionary(["Hello , world ! This is a test .", "A dog &apos;s toy : red &amp; blue ."])
    moses = TextPipeline(TranslationModel(detokenize="moses"), TranslationData(), words, words, "en", "en")
    for line in ("Hello, world! This is a test.", "A dog's toy: red & blue."):
        ids = moses.encode(line, "source")
        assert int((ids == words.unk()).sum()) == 0
        assert moses.decode(ids) == line
