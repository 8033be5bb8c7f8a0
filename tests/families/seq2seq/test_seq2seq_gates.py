"""The hf_seq2seq family's gates, checked against independent routes on tiny Marian, T5 and FSMT (time-first
attention) models built from their config classes: every gated head's beam search equals the search of a model whose
output projection has that head's input columns zeroed (weight surgery on a freshly loaded copy: no hooks, no gate
code), hypothesis for hypothesis; the unmasked BLEU equals a plain ``generate`` + sacrebleu loop; packed masks and
encoder reuse change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import sacrebleu
import torch
from tiny_seq2seq import KINDS, save_tiny_seq2seq, write_pairs, zeroed_head

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import family_of_model, model_family

N_SENTENCES = 6
BATCH = 4


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    """(kind, model folder, source file, target file, adapter with reuse, adapter without)."""
    folder = tmp_path_factory.mktemp(f"seq2seq_{request.param}")
    model_dir = save_tiny_seq2seq(folder / "model", request.param)
    source, target = write_pairs(folder, N_SENTENCES)
    family = model_family("hf_seq2seq")
    model_cfg = family.model_config(path=str(model_dir), max_new_tokens=8)
    data_cfg = family.data_config(source=str(source), target=str(target))
    adapters = {reuse: family.load(model_cfg, data_cfg, RuntimeOptions(batch_size=BATCH, reuse=reuse,
                                                                       masks_per_batch=1))
                for reuse in (True, False)}
    return request.param, model_dir, source, target, adapters


def plain_translations(model, tokenizer, sources: list[str], generation) -> list[str]:
    """The users' loop: one sentence at a time through ``generate``, decoded with ``batch_decode``."""
    out = []
    with torch.no_grad():
        for line in sources:
            ids = model.generate(**tokenizer([line], return_tensors="pt"), generation_config=generation)
            out.extend(tokenizer.batch_decode(ids, skip_special_tokens=True))
    return out


def batch_translations(model, tokenizer, sources: list[str], generation) -> list[str]:
    """All sentences in one padded ``generate`` (file order), decoded with ``batch_decode``."""
    with torch.no_grad():
        ids = model.generate(**tokenizer(sources, padding=True, return_tensors="pt"), generation_config=generation)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def fresh(model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()


def test_sites_name_every_head_as_fairseq_translation_does(tiny):
    _, _, _, _, adapters = tiny
    inventory = adapters[True].describe().inventory
    assert family_of_model(adapters[True].model).name == "hf_seq2seq"
    assert sorted(str(h) for h in inventory.heads) == sorted(
        f"{a}:{layer}:{h}" for a in ("enc_self", "enc_dec", "dec_self") for layer in range(2) for h in range(4))


# The unmasked search is the same adapter code whatever the attention's layout: run on Marian and T5 only (suite
# time); FSMT's time-first gates are proved by the per-head and packed-mask tests.
@pytest.mark.parametrize("tiny", ["marian", "t5"], indirect=True)
def test_unmasked_bleu_equals_plain_generate_and_sacrebleu(tiny):
    _, model_dir, source, target, adapters = tiny
    adapter = adapters[True]
    [baseline] = adapter.evaluate([[]])
    sources = source.read_text().splitlines()
    references = target.read_text().splitlines()
    plain = plain_translations(fresh(model_dir), adapter.tokenizer, sources, adapter.generation)
    assert baseline.outputs == plain
    expected = sacrebleu.corpus_bleu(plain, [references]).score
    assert baseline.score == pytest.approx(expected, abs=1e-9)
    assert [len(h.split()) for h in plain] == baseline.stats[:, 0].tolist()  # hyp_len per sentence


def test_every_gated_head_equals_weight_surgery_with_identical_beams(tiny):
    kind, model_dir, source, _, adapters = tiny
    adapter = adapters[False]  # the plain path: every mask runs the whole model
    heads = list(adapter.describe().inventory.heads)
    adapter.runtime.masks_per_batch = len(heads)  # every mask in one generate per batch (rows gated per mask)
    try:
        results = adapter.evaluate([[]] + [[h] for h in heads])
    finally:
        adapter.runtime.masks_per_batch = 1
    baseline, results = results[0], results[1:]
    sources = source.read_text().splitlines()
    reference = fresh(model_dir)
    changed = 0
    for head, result in zip(heads, results, strict=True):
        with zeroed_head(reference, head):
            expected = batch_translations(reference, adapter.tokenizer, sources, adapter.generation)
        assert result.outputs == expected, f"{kind} {head}"
        changed += result.outputs != baseline.outputs
    # The check can fail: most single heads change some beam of these random-weight models.
    assert changed >= len(heads) // 2, f"{kind}: only {changed} of {len(heads)} heads change any hypothesis"


def test_packed_masks_and_encoder_reuse_change_nothing(tiny):
    _, _, _, _, adapters = tiny
    plain = adapters[False]
    heads = list(plain.describe().inventory.heads)
    masks = [[], heads[:2], [Head("enc_dec", 1, 0), Head("dec_self", 0, 3)], [Head("dec_self", 1, 2)],
             [Head("enc_self", 1, 1), Head("enc_dec", 0, 2)], [h for h in heads if h.attention == "enc_dec"]]
    want = [r.outputs for r in plain.evaluate(masks)]
    for adapter in adapters.values():
        adapter.runtime.masks_per_batch = 3  # three masks per generate: rows gated per mask
        try:
            got = adapter.evaluate(masks)
        finally:
            adapter.runtime.masks_per_batch = 1
        assert [r.outputs for r in got] == want
        assert np.array_equal(np.stack([r.stats for r in got]), np.stack([plain.sentence_stats(w) for w in want]))
    reused = adapters[True]
    assert "encoder" in reused.reuse_note and len(reused._encoded) == len(reused.batches)
