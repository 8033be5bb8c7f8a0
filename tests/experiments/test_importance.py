"""Gradient head importance against independent routes.

- Gate gradients against central finite differences of the loss through plain ``(H,)`` gates.
- Per-token gate gradients against the reference code's route: ``<ctx_h, dL/dctx_h>`` from the
  output projection's input and its gradient (``retain_grad``), with no gates at all.
- Masked importance against that route on a copy whose masked heads' W_O columns are zeroed.

Masked heads are reported with importance 0.0 (not left out).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_float64_bert, zeroed_copy

from headsweep.workers.analyses.importance import gate_gradients, gradient_importance, normalize_by_layer, rank_heads
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_classifier.training_loss import classifier_loss_batches, cut_batches
from headsweep.workers.families.hf_shared.sites import find_sites

# Ragged sentences of token ids (BERT's pad id is 0, never used here).
SENTENCES = [
    [2, 17, 33, 5, 41, 3],
    [2, 9, 12, 3],
    [2, 50, 7, 28, 19, 44, 8, 3],
    [2, 23, 3],
    [2, 31, 14, 55, 6, 3],
    [2, 11, 47, 22, 38, 3],
    [2, 40, 26, 3],
]
LABELS = [0, 2, 1, 1, 0, 2, 1]


pytestmark = pytest.mark.usefixtures("one_thread")


def central_difference(task, head: Head, eps: float) -> float:
    """dL/dxi_h by central differences of the loss through a plain (H,) gate: no per-token gates."""
    values = []
    for sign in (1, -1):
        gate = torch.ones(4, dtype=torch.float64)
        gate[head.head] += sign * eps
        task.gates.set_values({(head.attention, head.layer): gate})
        values.append(total_loss(task))
    task.gates.clear()
    return (values[0] - values[1]) / (2 * eps)


def make_task(model, sentences=SENTENCES, labels=LABELS, batch_size=4, extra_pad=0):
    """A ClassifierAdapter-like object: right-padded batches of (example indices, inputs), and their loss."""
    batches = []
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start : start + batch_size]
        width = max(len(s) for s in chunk) + extra_pad
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        batches.append((torch.arange(start, start + len(chunk)), {"input_ids": ids, "attention_mask": mask}))
    gates, labels = HeadGates(find_sites(model)), torch.tensor(labels)

    def loss_batches(label_smoothing, dtype):
        return classifier_loss_batches(model, gates, cut_batches(batches), labels, dtype)

    return SimpleNamespace(model=model, gates=gates, batches=batches, labels=labels, loss_batches=loss_batches)


def total_loss(task) -> float:
    with torch.no_grad():
        return sum(
            F.cross_entropy(task.model(**inputs).logits, task.labels[idx], reduction="sum").item()
            for idx, inputs in task.batches
        )


def reference_token_grads(model, batches, labels) -> list[dict[tuple[str, int], torch.Tensor]]:
    """Per batch and site, (B, T, H) ``<ctx_h, dL/dctx_h>`` from the projection input and its gradient."""
    model = copy.deepcopy(model)
    sites = find_sites(model)
    out = []
    for idx, inputs in batches:
        captured = {}

        def keep(site, captured):
            def hook(module, args):
                args[0].retain_grad()
                captured[site.key] = (site, args[0])
            return hook

        handles = [s.out_proj.register_forward_pre_hook(keep(s, captured)) for s in sites]
        loss = F.cross_entropy(model(**inputs).logits, labels[idx], reduction="sum")
        model.zero_grad()
        loss.backward()
        for h in handles:
            h.remove()
        grads = {}
        for key, (site, x) in captured.items():
            dot = (x * x.grad).reshape(*x.shape[:-1], site.num_heads, site.head_dim).sum(-1)
            grads[key] = dot * inputs["attention_mask"].unsqueeze(-1)
        out.append(grads)
    return out


def importance_from_grads(per_batch, heads, n_tokens, per_token=True) -> dict[Head, float]:
    scores = {}
    for h in heads:
        key = (h.attention, h.layer)
        if per_token:
            total = sum(g[key][..., h.head].abs().sum().item() for g in per_batch)
        else:
            total = sum(abs(g[key][..., h.head].sum().item()) for g in per_batch)
        scores[h] = total / n_tokens
    return scores


def assert_scores_close(got: dict, expected: dict, rel=1e-9):
    assert got.keys() == expected.keys()
    for h in expected:
        # summation order, float64 routes (per-token and per-batch sums, batches of other sizes): rel 1e-9 is ~5e6
        # float64 eps, far above rounding and far below any real difference
        assert got[h] == pytest.approx(expected[h], rel=rel, abs=1e-15), h


# -- per-token gates ----------------------------------------------------------------------------------
def test_per_token_gates_act_per_token_and_check_their_shape():
    model = tiny_float64_bert()
    task = make_task(model, batch_size=len(SENTENCES))
    _, inputs = task.batches[0]
    b, t = inputs["input_ids"].shape
    head = Head("self", 1, 2)

    def logits():
        with torch.no_grad():
            return model(**inputs).logits

    with task.gates.masked([head]):
        expected = logits()
    gate = torch.ones(b, t, 4, dtype=torch.float64)
    gate[:, :, head.head] = 0.0
    task.gates.set_values({("self", 1): gate})
    # other: float64 per-token gates of 1 and 0 against the plain mask: the same products (1 and 0 round nothing),
    # so equal in fact; atol 1e-12 as float64 rounding
    torch.testing.assert_close(logits(), expected, rtol=0, atol=1e-12)
    # Last layer: only [CLS] reaches the classifier, so gating every other token changes nothing.
    gate = torch.ones(b, t, 4, dtype=torch.float64)
    gate[:, 1:, :] = 0.0
    task.gates.set_values({("self", 1): gate})
    task.gates.clear()
    plain = logits()
    task.gates.set_values({("self", 1): gate})
    # other: float64, as above: gates on tokens the classifier never reads change nothing
    torch.testing.assert_close(logits(), plain, rtol=0, atol=1e-12)
    gate[:, 0, head.head] = 0.0
    assert (logits() - plain).abs().max() > 1e-6
    task.gates.set_values({("self", 1): torch.ones(b, t + 1, 4)})
    with pytest.raises(ValueError, match="per-token gate has shape"):
        logits()
    task.gates.clear()


# -- (1) gate gradients against finite differences --------------------------------------------------
def test_gate_gradients_equal_finite_differences():
    model = tiny_float64_bert()
    task = make_task(model)
    summed = {}
    for batch in gate_gradients(task):
        for key, g in batch.grads.items():
            summed[key] = summed.get(key, 0) + g.sum(dim=(0, 1))
    eps = 1e-5
    checked = 0
    for head in [Head("self", 0, 0), Head("self", 0, 3), Head("self", 1, 1), Head("self", 1, 2)]:
        key = (head.attention, head.layer)
        fd = central_difference(task, head, eps)
        assert abs(fd) > 1e-4, "the head must matter, or the check proves nothing"
        # other: autograd against a float64 central difference with step 1e-5 (truncation ~1e-10 relative)
        assert summed[key][head.head].item() == pytest.approx(fd, rel=1e-6), head
        checked += 1
    assert checked == 4


def test_batch_level_importance_of_one_batch_is_abs_finite_difference_over_tokens():
    model = tiny_float64_bert(seed=3)
    task = make_task(model, batch_size=len(SENTENCES))
    result = gradient_importance(task, per_token=False)
    n_tokens = sum(len(s) for s in SENTENCES)
    assert result.tokens == {("self", 0): n_tokens, ("self", 1): n_tokens}
    eps = 1e-5
    for head in task.gates.inventory.heads:
        fd = central_difference(task, head, eps)
        # other: autograd against a float64 central difference, as above
        assert result.raw[head] == pytest.approx(abs(fd) / n_tokens, rel=1e-6), head
    # summation order, float64 routes: the same losses summed per batch here; rel 1e-12
    assert result.loss == pytest.approx(total_loss(task), rel=1e-12)


# -- (2) per-token absolute value against the batch-level one ------------------------------------------
def test_per_token_gradients_equal_ctx_dot_grad():
    model = tiny_float64_bert()
    task = make_task(model)
    reference = reference_token_grads(model, task.batches, task.labels)
    got = list(gate_gradients(task))
    assert len(got) == len(reference) == 2
    for mine, ref in zip(got, reference, strict=True):
        for key in ref:
            assert mine.grads[key].shape == ref[key].shape
            # summation order, float64 routes: autograd against the context-times-gradient product; rtol 1e-9
            torch.testing.assert_close(mine.grads[key], ref[key], rtol=1e-9, atol=1e-13)


def test_per_token_abs_differs_from_batch_level_exactly_where_signs_cancel():
    model = tiny_float64_bert(num_labels=2)
    x = SENTENCES[2]
    heads = None
    cases = {"same sentence, same label": [0, 0], "same sentence, opposite labels": [0, 1]}
    for name, labels in cases.items():
        task = make_task(model, [x, x], labels, batch_size=2)
        heads = task.gates.inventory.heads
        grads = reference_token_grads(model, task.batches, task.labels)
        n = 2 * len(x)
        per_token = gradient_importance(task, per_token=True).raw
        batch = gradient_importance(task, per_token=False).raw
        assert_scores_close(per_token, importance_from_grads(grads, heads, n, per_token=True))
        assert_scores_close(batch, importance_from_grads(grads, heads, n, per_token=False))
        kinds = set()
        for h in heads:
            g = grads[0][(h.attention, h.layer)][..., h.head]
            g = g[g.abs() > 1e-14]
            one_sign = bool((g > 0).all() or (g < 0).all())
            kinds.add(one_sign)
            if one_sign:
                # summation order, float64 routes: one sign per head makes the two sums equal in exact arithmetic
                assert per_token[h] == pytest.approx(batch[h], rel=1e-9), (name, h)
            else:
                # other: mixed signs make the per-token sum larger by far more than float64 rounding
                assert per_token[h] > batch[h] * (1 + 1e-3), (name, h)
        if labels == [0, 0]:
            # Only [CLS] reaches the classifier from the last layer, and both rows are the same
            # example: one sign per head there; layer 0 mixes signs over tokens.
            assert kinds == {True, False}, name
            # summation order, float64 routes, as above
            assert all(per_token[h] == pytest.approx(batch[h], rel=1e-9) for h in heads if h.layer == 1)
        else:
            # With two labels, the second row's gradients are the first's times -p0/p1.
            assert kinds == {False}, name


# -- (3) padding ----------------------------------------------------------------------------------------
def test_padding_and_batching_do_not_change_importance():
    model = tiny_float64_bert(seed=1)
    base = gradient_importance(make_task(model, batch_size=4))
    padded = gradient_importance(make_task(model, batch_size=4, extra_pad=7))
    unbatched = gradient_importance(make_task(model, batch_size=1))
    n_tokens = sum(len(s) for s in SENTENCES)
    assert base.tokens == padded.tokens == unbatched.tokens == {("self", 0): n_tokens, ("self", 1): n_tokens}
    assert_scores_close(padded.raw, base.raw)
    assert_scores_close(unbatched.raw, base.raw)
    assert padded.n_examples == unbatched.n_examples == len(SENTENCES)
    # Batch-level sums depend on the batching by design, but not on padding.
    base_b = gradient_importance(make_task(model, batch_size=4), per_token=False)
    padded_b = gradient_importance(make_task(model, batch_size=4, extra_pad=7), per_token=False)
    assert_scores_close(padded_b.raw, base_b.raw)
    assert any(base_b.raw[h] < base.raw[h] * (1 - 1e-3) for h in base.raw)


def test_real_classifier_task_padding_and_batching(tiny_bert_dir, tiny_dev_tsv):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import ClassifierAdapter
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    def task(batch_size):
        return ClassifierAdapter(ClassifierModel(path=str(tiny_bert_dir), dtype="float64", attn_implementation="eager"),
                              ClassifierData(path=str(tiny_dev_tsv)), RuntimeOptions(batch_size=batch_size))

    small, whole = task(3), task(64)
    assert any(inputs["attention_mask"].eq(0).any() for _, inputs in whole.batches), "padding must occur"
    a, b = gradient_importance(small), gradient_importance(whole)
    assert a.tokens == b.tokens == {k: int(whole.batches[0][1]["attention_mask"].sum()) for k in b.tokens}
    assert_scores_close(a.raw, b.raw)
    # summation order, float64 routes: batches of 3 against one of 64; rel 1e-12
    assert a.loss == pytest.approx(b.loss, rel=1e-12)
    # Same loss as the task's own evaluation route.
    # other: evaluate() keeps logits in a float32 buffer (~6e-8 relative each); rel 1e-6 covers that
    assert b.loss == pytest.approx(float(whole.evaluate([[]])[0].loss.sum()), rel=1e-6)
    assert all(p.requires_grad and p.grad is None for p in whole.model.parameters())
    assert not whole.model.training


# -- (4) normalisation ------------------------------------------------------------------------------------
def test_normalisation_makes_each_layer_unit_length():
    model = tiny_float64_bert(layers=3, seed=2)
    result = gradient_importance(make_task(model), normalize=True)
    assert result.scores == result.normalized and result.normalize
    for layer in result_layers(result):
        vector = [result.scores[h] for h in layer]
        raw = [result.raw[h] for h in layer]
        # other: float64 normalisation, recomputed here; rel 1e-12 (and the raw norm differs from 1 by > 1e-3)
        assert math.sqrt(sum(v * v for v in vector)) == pytest.approx(1.0, rel=1e-12)
        norm = math.sqrt(sum(v * v for v in raw))
        # other: the route can fail: the raw scores are far from unit length
        assert norm != pytest.approx(1.0, rel=1e-3), "raw scores are not unit length already"
        for v, r in zip(vector, raw, strict=True):
            # other: the same float64 division recomputed; rel 1e-12
            assert v == pytest.approx(r / norm, rel=1e-12)
    plain = gradient_importance(make_task(model))
    assert plain.scores == plain.raw
    assert_scores_close(plain.raw, result.raw)


def result_layers(result):
    layers: dict = {}
    for h in result.raw:
        layers.setdefault((h.attention, h.layer), []).append(h)
    return list(layers.values())


def test_normalize_by_layer_keeps_an_all_zero_layer_at_zero():
    scores = {Head("self", 0, 0): 0.0, Head("self", 0, 1): 0.0, Head("self", 1, 0): 3.0, Head("self", 1, 1): 4.0}
    assert normalize_by_layer(scores) == {Head("self", 0, 0): 0.0, Head("self", 0, 1): 0.0,
                                          Head("self", 1, 0): 0.6, Head("self", 1, 1): 0.8}


# -- (5) mask ---------------------------------------------------------------------------------------------
def test_mask_keeps_masked_heads_off_and_reports_them_as_zero():
    model = tiny_float64_bert(seed=4)
    task = make_task(model)
    masked = [Head("self", 0, 1), Head("self", 1, 3), Head("self", 1, 0)]
    result = gradient_importance(task, mask=masked, normalize=True)
    assert set(result.masked) == set(masked)
    for h in masked:
        assert result.raw[h] == 0.0 and result.normalized[h] == 0.0
    # The loss was computed with the masked gates at 0 ...
    with task.gates.masked(masked):
        masked_loss = total_loss(task)
    unmasked_loss = total_loss(task)
    # summation order, float64 routes: the same masked losses summed per batch here; rel 1e-12
    assert result.loss == pytest.approx(masked_loss, rel=1e-12)
    assert abs(masked_loss - unmasked_loss) > 1e-3
    # ... and the other heads' scores equal the gate-free route on a copy with those heads' W_O zeroed.
    zeroed = zeroed_copy(model, masked)
    grads = reference_token_grads(zeroed, task.batches, task.labels)
    n_tokens = sum(len(s) for s in SENTENCES)
    expected = importance_from_grads(grads, [h for h in result.raw if h not in masked], n_tokens)
    assert_scores_close({h: v for h, v in result.raw.items() if h not in masked}, expected)
    unmasked = gradient_importance(task)
    assert any(abs(unmasked.raw[h] - expected[h]) > 1e-3 * expected[h] for h in expected)
    assert all(unmasked.raw[h] > 0 for h in masked)
    # Masked heads come first in the ranking; the gates are off afterwards.
    assert set(rank_heads(result.scores)[:3]) == set(masked)
    assert total_loss(task) == unmasked_loss


# -- ranking ----------------------------------------------------------------------------------------------
def test_rank_heads_ascending_with_ties_in_head_order():
    scores = {
        Head("dec_self", 0, 1): 0.5,
        Head("enc_self", 1, 0): 0.5,
        Head("enc_dec", 0, 2): 0.1,
        Head("enc_self", 0, 3): 0.5,
        Head("enc_self", 0, 2): 0.9,
        Head("enc_dec", 0, 0): 0.5,
    }
    assert [str(h) for h in rank_heads(scores)] == [
        "enc_dec:0:2", "enc_self:0:3", "enc_self:1:0", "enc_dec:0:0", "dec_self:0:1", "enc_self:0:2",
    ]
    with pytest.raises(ValueError, match="NaN"):
        rank_heads({Head("self", 0, 0): float("nan")})


# -- fairseq translation ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def translation_task(request):
    pytest.importorskip("fairseq")
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    tiny = request.getfixturevalue("trained_tiny_fairseq")  # after the skip: it needs fairseq to train

    def make(batch_size):
        task = load_translation(
            TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=2, max_len_b=24),
            TranslationData(data_bin=str(tiny.data.data_bin), split="valid"),
            RuntimeOptions(batch_size=batch_size),
        )
        task.model.double()
        return task

    return make


def translation_loss(task, epsilon) -> float:
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    total = 0.0
    with torch.no_grad():
        for sample in task.batches:
            logits = task.model(**sample["net_input"])[0]
            lprobs = torch.log_softmax(logits, -1)
            loss, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), sample["target"].view(-1), epsilon,
                                              ignore_index=task.tgt_dict.pad())
            total += loss.item()
    return total


@pytest.fixture
def softmax_in_model_dtype(monkeypatch):
    import fairseq.utils

    # fairseq computes attention softmax in float32 whatever the model's dtype; its rounding
    # steps swamp float64 finite differences and comparisons, so keep the model's dtype here.
    monkeypatch.setattr(fairseq.utils, "softmax", lambda x, dim, onnx_trace=False: F.softmax(x, dim=dim))


def test_translation_gate_gradients_equal_finite_differences(translation_task, softmax_in_model_dtype):
    task = translation_task(16)
    summed = {}
    for batch in gate_gradients(task, label_smoothing=0.1):
        for key, g in batch.grads.items():
            assert g.shape[1] == batch.tokens[key].shape[1] == batch.grads[("enc_self", 0)].shape[1]  # time first
            summed[key] = summed.get(key, 0) + g.sum(dim=(0, 1))
    eps = 1e-5
    for head in [Head("enc_self", 0, 1), Head("enc_dec", 1, 2), Head("dec_self", 0, 3), Head("dec_self", 1, 0)]:
        key = (head.attention, head.layer)
        values = []
        for sign in (1, -1):
            gate = torch.ones(4, dtype=torch.float64)
            gate[head.head] += sign * eps
            task.gates.set_values({key: gate})
            values.append(translation_loss(task, 0.1))
        task.gates.clear()
        fd = (values[0] - values[1]) / (2 * eps)
        assert abs(fd) > 1e-4, head
        # other: autograd against a float64 central difference with step 1e-5 (softmax in float64 via the fixture)
        assert summed[key][head.head].item() == pytest.approx(fd, rel=1e-6), head


def test_translation_importance_ignores_padding_and_matches_the_task_loss(translation_task, softmax_in_model_dtype):
    whole, single = translation_task(64), translation_task(1)
    a = gradient_importance(whole, label_smoothing=0.1)
    b = gradient_importance(single, label_smoothing=0.1)
    src = sum(int(s["net_input"]["src_lengths"].sum()) for s in single.batches)
    tgt = sum(int(s["target"].ne(single.tgt_dict.pad()).sum()) for s in single.batches)
    assert a.tokens == b.tokens == {k: src if k[0] == "enc_self" else tgt for k in a.tokens}
    assert any(s["net_input"]["src_tokens"].eq(whole.src_dict.pad()).any() for s in whole.batches)
    assert_scores_close(a.raw, b.raw)
    assert "epsilon 0.1" in a.loss_name
    # Without smoothing, the loss is the task's own teacher-forced loss (mean per token) times the lengths.
    plain = gradient_importance(whole, label_smoothing=0.0)
    lengths = torch.zeros(len(whole.examples.ids), dtype=torch.float64)
    for s in whole.batches:
        lengths[s["id"]] = s["target"].ne(whole.tgt_dict.pad()).sum(1).double()
    expected = float((torch.from_numpy(whole.reference_loss([[]])[0]) * lengths).sum())
    # other: the task's reference loss rounds float64 log-probabilities to float32 (~6e-8 relative each); rel 1e-5
    # covers the sums, and smoothing (below) moves the loss by more than 1e-3
    assert plain.loss == pytest.approx(expected, rel=1e-5)
    assert plain.loss != pytest.approx(a.loss, rel=1e-3)
