"""Encoder reuse for fairseq translation against the plain path: identical hypotheses, scores and losses.

The plain path (``reuse: false``, one mask per beam search) is the independent route; it is
itself checked against fairseq alone with zeroed W_O columns in test_translation.py. Masks:
every head of every attention type, every all-but-one mask, masks over several layers and
types, and the empty mask, unpacked and packed (uneven chunks, batches of 7 sentences).
"""

from __future__ import annotations

import pytest

from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.adapter import load_translation
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.config import TranslationRuntime as RuntimeOptions
from headsweep.workers.families.fairseq_translation.reuse import EncoderReuse
from headsweep.workers.memory.batch_budget import CPU_ACTIVATION_BYTES

BEAM, MAX_LEN_B = 3, 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny fairseq model (conftest.trained_tiny_fairseq: read, never changed)."""
    return trained_tiny_fairseq


def make_task(tiny, batch_size=64, **runtime):
    model_cfg = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=BEAM,
                                 max_len_b=MAX_LEN_B)
    data_cfg = TranslationData(data_bin=str(tiny.data.data_bin), split="test")
    return load_translation(model_cfg, data_cfg, RuntimeOptions(batch_size=batch_size, max_tokens=0, **runtime))


@pytest.fixture(scope="module")
def masks(tiny):
    inventory = make_task(tiny, reuse=False).describe().inventory
    singles = [[h] for h in inventory.heads]
    all_but_one = [[o for o in s.heads() if o != kept] for s in inventory.layers for kept in s.heads()]
    mixed = [[Head("enc_self", 1, 0), Head("dec_self", 0, 2)], [Head("enc_self", 0, 3), Head("enc_self", 1, 1)],
             [Head("enc_dec", 0, 1), Head("dec_self", 1, 3)]]
    return [[]] + singles + all_but_one + mixed


@pytest.fixture(scope="module")
def plain(tiny, masks):
    task = make_task(tiny, reuse=False, masks_per_batch=1)
    assert task.describe().facts["reuse"].startswith("off")
    return task.translate(masks), task.reference_loss(masks)




def test_encoder_runs_only_where_a_mask_changes_it(tiny):
    task = make_task(tiny, reuse=True, masks_per_batch=4)
    calls = [0, 0]
    layers = task.model.encoder.layers
    handles = [layer.self_attn.k_proj.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(layers)]
    try:
        task.translate([[]])
        batches = len(task.batches)
        assert calls == [batches, batches], "the baseline encoder runs once per sentence batch"
        task.translate([[Head("enc_dec", 0, 1)], [Head("dec_self", 1, 2)]])
        task.reference_loss([[Head("enc_dec", 1, 0)]])
        assert calls == [batches, batches], "decoder masks read the kept encoder output"
        task.translate([[Head("enc_self", 1, 2)]])
        assert calls == [batches, batches], "an enc_self:1 mask starts from layer 1's cached contexts"
        task.translate([[Head("enc_self", 0, 2)], [Head("enc_self", 0, 3)]])
        assert calls == [batches, 2 * batches], "enc_self:0 masks share one pass of layer 1"
    finally:
        for h in handles:
            h.remove()


def test_states_over_budget_are_recorded_per_call(tiny, masks, plain):
    task = make_task(tiny, reuse=True, masks_per_batch=3)
    task._reuse = EncoderReuse(task.model, task.gates, budget_bytes=0)
    picked = [0, 1, 30, len(masks) - 2]
    hyps = task.translate([masks[i] for i in picked])
    assert task._reuse.kept_bytes == 0
    for i, got in zip(picked, hyps, strict=True):
        assert [h.tokens.tolist() for h in got] == [h.tokens.tolist() for h in plain[0][i]], masks[i]


def test_automatic_masks_per_forward_follows_the_memory_budget(tiny):
    task = make_task(tiny, masks_per_batch=0, batch_size=8)
    per_sentence = task.bytes_per_sentence()
    assert task.masks_per_forward() == max(1, CPU_ACTIVATION_BYTES // per_sentence // 8)
    assert make_task(tiny, masks_per_batch=2).masks_per_forward() == 2
