"""LRP head relevance (headsweep.workers.analyses.lrp) against independent routes.

- Conservation: with every bias zero, the rules make each cut through the network (a layer's input, plus the
  encoder output for a decoder layer) hold exactly the explained logit sum, for a BERT classifier, a
  Llama-style LM (gated MLP: uniform rule; RMSNorm), a fairseq translation model and transformers' Marian and
  FSMT (BART-style; FSMT time-first, its weights returned only when asked) and T5 v1.1 (RMSNorm, relative-position
  bias, gated-GELU feed-forward) through the hf_seq2seq adapter's teacher-forced reference tokens; and plain
  Gradient x Input does not (so the check can fail). The rules leave the logits as they are.
- By hand: one BERT layer, relevance of each head propagated from the top logit by the explicit z-rule
  (``R_i = sum_j x_i w_ji / z_j R_j``) in numpy, layer by layer, against :func:`lrp_relevance`.
- Through the CLI: ``importance.method: lrp`` writes the ``importance`` table, shares summing to 1 per layer.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import tiny_causal_lm, tiny_float64_bert
from tiny_seq2seq import save_tiny_seq2seq, write_pairs

from headsweep.workers.analyses.lrp import lrp_relevance, lrp_rules, top_logit_batch
from headsweep.workers.core.family import LossBatch, LossBatches, RuntimeOptions
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.families.fairseq_translation.adapter import load_translation
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel, TranslationRuntime
from headsweep.workers.families.hf_causal_lm.model.sites import find_sites as causal_sites
from headsweep.workers.families.hf_classifier.training_loss import classifier_loss_batches, cut_batches
from headsweep.workers.families.hf_shared.sites import find_sites as classifier_sites
from headsweep.workers.families.registry import model_family

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = [[2, 17, 33, 5, 41, 3], [2, 9, 12, 3], [2, 50, 7, 28, 19, 44, 8, 3], [2, 23, 31, 3]]


def zero_biases(model: torch.nn.Module) -> None:
    """Every bias (linear and normalisation) to zero: relevance is then conserved exactly."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()


def bert_task(model, sentences=SENTENCES):
    batches = []
    width = max(len(s) for s in sentences)
    ids = torch.zeros(len(sentences), width, dtype=torch.long)
    mask = torch.zeros(len(sentences), width, dtype=torch.long)
    for i, s in enumerate(sentences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    batches.append((torch.arange(len(sentences)), {"input_ids": ids, "attention_mask": mask}))
    gates, labels = HeadGates(classifier_sites(model)), torch.zeros(len(sentences), dtype=torch.long)

    def loss_batches(_label_smoothing, dtype):
        return classifier_loss_batches(model, gates, cut_batches(batches), labels, dtype)

    return SimpleNamespace(model=model, gates=gates, loss_batches=loss_batches)


def lm_task(model, rows=3, length=9):
    ids = torch.randint(4, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(3))
    gates = HeadGates(causal_sites(model))
    real = torch.ones(ids.shape, dtype=torch.bool)

    def loss_batches(_label_smoothing, _dtype):
        def outputs():
            return model(input_ids=ids, use_cache=False).logits[:, :-1], torch.ones(rows, length - 1, dtype=torch.bool)

        return LossBatches([LossBatch({s.key: real for s in gates.sites}, rows, lambda: None, outputs)], "test")

    return SimpleNamespace(model=model, gates=gates, loss_batches=loss_batches)


@pytest.fixture(scope="module")
def tiny_translation(trained_tiny_fairseq, one_thread):
    tiny = trained_tiny_fairseq
    model_cfg = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=2,
                                 max_len_b=10)
    data_cfg = TranslationData(data_bin=str(tiny.data.data_bin), split="valid", max_examples=12)
    return load_translation(model_cfg, data_cfg, TranslationRuntime(batch_size=6, max_tokens=0))


def encoder_decoder_layers(model) -> tuple[list, list, list, tuple[str, ...]] | None:
    """(encoder layers, decoder layers, each decoder layer's cross-attention module, the keywords that hand it the
    encoder output) of a fairseq or transformers encoder-decoder model, by the architecture's own names; None for
    other models."""
    if hasattr(model, "encoder") and hasattr(model.encoder, "layers"):  # fairseq: as key and as value
        dec = list(model.decoder.layers)
        return list(model.encoder.layers), dec, [m.encoder_attn for m in dec], ("key", "value")
    if hasattr(model, "model") and hasattr(model.model, "encoder"):  # Marian / BART / MVP; FSMT; NLLB-MoE
        dec = list(model.model.decoder.layers)
        keywords = ("key",) if model.config.model_type == "fsmt" else ("key_value_states",)
        cross = [m.cross_attention if model.config.model_type == "nllb-moe" else m.encoder_attn for m in dec]
        return list(model.model.encoder.layers), dec, cross, keywords
    if hasattr(model, "encoder") and hasattr(model.encoder, "block"):  # T5, Switch Transformers
        dec = list(model.decoder.block)
        return list(model.encoder.block), dec, [b.layer[1].EncDecAttention for b in dec], ("key_value_states",)
    return None


def cut_points(model) -> tuple[dict[str, tuple[torch.nn.Module, str]], list[list[str]]]:
    """Named tensors (a module's input, or the encoder output as one decoder layer's encoder attention reads
    it) and the cuts they form: sets every path from the input to the logits crosses exactly once."""
    layers = encoder_decoder_layers(model)
    if layers is not None:
        enc, dec, cross, keywords = layers
        points = {f"enc{i}": (m, "input") for i, m in enumerate(enc)}
        points |= {f"dec{i}": (m, "input") for i, m in enumerate(dec)}
        points |= {f"kv{i}": (m, keywords) for i, m in enumerate(cross)}
        # The decoder's layer l and the encoder output as layers l, l+1, ... read it.
        cuts = [[f"enc{e}", "dec0"] for e in range(len(enc))]
        cuts += [[f"dec{d}", *(f"kv{j}" for j in range(d, len(dec)))] for d in range(len(dec))]
        return points, cuts
    layers = model.bert.encoder.layer if hasattr(model, "bert") else model.model.layers
    return {f"layer{i}": (m, "input") for i, m in enumerate(layers)}, [[f"layer{i}"] for i in range(len(layers))]


def cut_relevance(task, rules: bool) -> tuple[float, list[float]]:
    """The explained logit sum and, per cut, the summed Gradient x Input of the tensors crossing it."""
    prepared = task.loss_batches(None, torch.float64)
    points, cuts = cut_points(task.model)
    explained, sums = 0.0, [0.0] * len(cuts)
    captured: dict[str, torch.Tensor] = {}

    def take_input(name):
        return lambda _m, args: captured.__setitem__(name, args[0])

    def own_key(name, keywords):
        # A fresh node per layer (same values), so each layer's reading of the encoder output has its own
        # gradient; fairseq passes the encoder output as key and value, FSMT as key, transformers as key_value_states.
        def hook(_m, args, kwargs):
            key = kwargs[keywords[0]].view_as(kwargs[keywords[0]])
            captured[name] = key
            return args, {**kwargs, **dict.fromkeys(keywords, key)}
        return hook

    for batch in prepared.batches:
        objective = top_logit_batch(batch, [])
        captured.clear()
        handles = [module.register_forward_pre_hook(take_input(name)) if what == "input"
                   else module.register_forward_pre_hook(own_key(name, what), with_kwargs=True)
                   for name, (module, what) in points.items()]
        try:
            with torch.enable_grad(), (lrp_rules(task) if rules else torch.enable_grad()):
                y = objective.loss()
                names = list(captured)
                grads = dict(zip(names, torch.autograd.grad(y, [captured[n] for n in names]), strict=True))
        finally:
            for h in handles:
                h.remove()
        for i, cut in enumerate(cuts):
            sums[i] += sum(float((captured[n] * grads[n]).detach().sum()) for n in cut)
        explained += float(y.detach())
    return explained, sums


def seq2seq_adapter(folder, kind: str, dtype: str = "float32"):
    """A real hf_seq2seq adapter on a tiny ``kind`` model saved in ``folder`` and 6 synthetic pairs (3 a batch)."""
    model_dir = save_tiny_seq2seq(folder / kind, kind)
    source, target = write_pairs(folder, 6, split=f"valid_{kind}")
    family = model_family("hf_seq2seq")
    return family.load(family.model_config(path=str(model_dir), dtype=dtype),
                       family.data_config(source=str(source), target=str(target)), RuntimeOptions(batch_size=3))


@pytest.fixture(scope="module", params=["bert", "llama", "fairseq", "marian", "fsmt", "mvp", "nllb_moe", "t5_v1_1",
                                        "switch"])
def conserving_task(request, tmp_path_factory):
    if request.param == "bert":
        model = tiny_float64_bert(layers=3)
        zero_biases(model)
        return bert_task(model), 1e-9  # float64: summation order only
    if request.param == "llama":
        model = tiny_causal_lm("llama_8q2kv", layers=3).double()
        zero_biases(model)
        # Llama's RMSNorm normalises in float32 even in a float64 model: float32 rounding of the hidden states
        return lm_task(model), 1e-6
    if request.param == "fsmt":  # FSMT's causal mask overflows in float64 (transformers fills it via float32)
        task = seq2seq_adapter(tmp_path_factory.mktemp("lrp_seq2seq"), request.param)
        zero_biases(task.model)
        return task, 1e-4  # float32, as the fairseq model below
    if request.param != "fairseq":  # transformers' BART-style and T5-style blocks, float64
        task = seq2seq_adapter(tmp_path_factory.mktemp("lrp_seq2seq"), request.param, "float64")
        zero_biases(task.model)
        # float64: summation order only (T5's RMSNorm takes its variance in float32, but the rules hold it constant)
        return task, 1e-9
    task = request.getfixturevalue("tiny_translation")
    zero_biases(task.model)
    return task, 1e-4  # float32 model: rounding of a few hundred summed products


def test_rules_conserve_relevance_at_every_cut(conserving_task):
    task, rel = conserving_task
    explained, sums = cut_relevance(task, rules=True)
    assert abs(explained) > 1.0
    for total in sums:
        assert total == pytest.approx(explained, rel=rel)
    # The same cuts by plain Gradient x Input (softmax, normalisation and activations differentiated as they
    # are) do not conserve: the rules, not the cut choice, make the sums equal.
    _plain, plain_sums = cut_relevance(task, rules=False)
    assert max(abs(s - explained) / abs(explained) for s in plain_sums) > 1e-3


def test_rules_leave_forward_values_unchanged(conserving_task):
    """Only the backward pass changes: the logits under the rules (eager attention, normalisations and activations
    rewritten) are the model's own."""
    task, rel = conserving_task
    for batch in task.loss_batches(None, torch.float64).batches:
        with torch.no_grad():
            plain, keep = batch.outputs()
            with lrp_rules(task):
                ruled, _ = batch.outputs()
        assert keep.any() and plain.abs().max() > 1.0
        # the same weights; the rewritten normalisations round differently (float32 fairseq: a few ulps)
        torch.testing.assert_close(ruled, plain, rtol=rel, atol=rel * float(plain.abs().max()))


def z_rule(x: np.ndarray, w: np.ndarray, relevance_out: np.ndarray) -> np.ndarray:
    """LRP-0 through ``z = w @ x``: ``R_x[i] = sum_j x_i w[j, i] / z_j R_z[j]``."""
    z = w @ x
    return x * (w.T @ (relevance_out / z))


def layer_norm_matrix(u: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm with its standard deviation held fixed, as the linear map it then is."""
    d = u.shape[0]
    sigma = math.sqrt(((u - u.mean()) ** 2).mean() + eps)
    return np.diag(gamma / sigma) @ (np.eye(d) - np.ones((d, d)) / d)


def test_one_bert_layer_equals_the_explicit_z_rule():
    """A one-layer BERT with zero biases: each head's relevance for one sentence's top logit, propagated by hand
    (explicit relevance messages, no autograd) from the logit to the heads' contexts at [CLS]."""
    model = tiny_float64_bert(layers=1, heads=4)
    zero_biases(model)
    sentence = [SENTENCES[0]]
    task = bert_task(model, sentence)
    captured = {}
    layer = model.bert.encoder.layer[0]
    hooks = [
        layer.attention.output.dense.register_forward_pre_hook(lambda _m, a: captured.__setitem__("ctx", a[0])),
        layer.attention.output.LayerNorm.register_forward_pre_hook(lambda _m, a: captured.__setitem__("v", a[0])),
        layer.output.LayerNorm.register_forward_pre_hook(lambda _m, a: captured.__setitem__("u", a[0])),
        layer.intermediate.dense.register_forward_pre_hook(lambda _m, a: captured.__setitem__("a", a[0])),
        layer.output.dense.register_forward_pre_hook(lambda _m, a: captured.__setitem__("g", a[0])),
        model.bert.pooler.dense.register_forward_hook(lambda _m, _a, out: captured.__setitem__("pre", out)),
    ]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(sentence)).logits[0].numpy()
    for h in hooks:
        h.remove()
    cls = {k: v[0, 0].numpy() for k, v in captured.items() if k != "pre"}
    top = int(logits.argmax())
    wc = model.classifier.weight.detach().numpy()
    wp = model.bert.pooler.dense.weight.detach().numpy()
    w1, w2 = layer.intermediate.dense.weight.detach().numpy(), layer.output.dense.weight.detach().numpy()
    wo = layer.attention.output.dense.weight.detach().numpy()
    eps = model.config.layer_norm_eps

    r_top = np.zeros_like(logits)
    r_top[top] = logits[top]
    p = np.tanh(captured["pre"][0].numpy())
    r_pre = z_rule(p, wc, r_top)  # R(p), and tanh passes it on unchanged (identity rule): R(pre) = R(p)
    ln2 = layer_norm_matrix(cls["u"], layer.output.LayerNorm.weight.detach().numpy(), eps)
    h1_cls = ln2 @ cls["u"]
    r_h1 = z_rule(h1_cls, wp, r_pre)
    r_u = z_rule(cls["u"], ln2, r_h1)
    f = w2 @ cls["g"]
    r_f, r_a = f / cls["u"] * r_u, cls["a"] / cls["u"] * r_u  # the residual sum u = f + a
    r_g = z_rule(cls["g"], w2, r_f)  # GELU: identity rule, R(W1 a) = R(g)
    r_a = r_a + z_rule(cls["a"], w1, r_g)
    ln1 = layer_norm_matrix(cls["v"], layer.attention.output.LayerNorm.weight.detach().numpy(), eps)
    r_v = z_rule(cls["v"], ln1, r_a)
    o = wo @ cls["ctx"]
    r_o = o / cls["v"] * r_v
    r_ctx = z_rule(cls["ctx"], wo, r_o)
    by_hand = r_ctx.reshape(4, -1).sum(axis=1)

    result = lrp_relevance(task, normalize=False)
    ours = np.array([result.raw[h] for h in task.gates.inventory.heads])
    # float64 on both routes, different summation orders (and LayerNorm rewritten): a few ulps of the logit
    np.testing.assert_allclose(ours, by_hand, rtol=1e-7, atol=1e-10 * abs(logits[top]))
    assert np.abs(by_hand).max() > 1e-3  # the heads carry relevance: the comparison is not 0 == 0


# LRP importance through the CLI: test_head_roles.py::test_lrp_importance_through_the_cli (the roles run's
# importance is LRP's, one run for both).


def test_lrp_needs_importance_data(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["importance"]}, "importance": {"method": "lrp"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "s"))
    assert proc.returncode == 2 and "lrp importance needs importance.data" in proc.stderr
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("*.parquet"))
