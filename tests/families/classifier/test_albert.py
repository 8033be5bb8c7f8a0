"""ALBERT: one layer module runs at every depth, and each application's heads are gated on their own (``self:L:H``).

The independent route is the unrolled twin: the same ALBERT with ``num_hidden_groups = num_hidden_layers``, each
group's weights copied from the group the shared model calls at that depth, so every application owns its modules.
A head of application L is ablated in the twin by zeroing its input columns of that application's
``attention.dense`` (mean ablation: and adding ``W_O[:, h] @ mean_h`` to its bias), with transformers alone.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import duckdb
import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tiny_models import random_batch, save_tiny_albert, tiny_albert
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_shared.sites import check_sites, find_sites

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP = "albert.encoder.albert_layer_groups."
# (num_hidden_layers, num_hidden_groups, inner_group_num, attention path): the stock layout (one layer shared by
# every depth) on both paths, and two groups of two layers run four times (application L = step * inner + j: eight
# applications of four modules).
SHAPES = [(3, 1, 1, "eager"), (3, 1, 1, "sdpa"), (4, 2, 2, "eager")]


def unrolled(model):
    """The twin whose every application owns its modules, weights copied from the group run at its depth."""
    from transformers import AlbertForSequenceClassification

    cfg = copy.deepcopy(model.config)
    layers, groups = cfg.num_hidden_layers, cfg.num_hidden_groups
    cfg.num_hidden_groups = layers
    twin = AlbertForSequenceClassification(cfg).eval()
    shared = model.state_dict()
    weights = {}
    for key in twin.state_dict():
        if key.startswith(GROUP):
            step, rest = key[len(GROUP):].split(".", 1)
            weights[key] = shared[f"{GROUP}{int(int(step) / (layers / groups))}.{rest}"]
        else:
            weights[key] = shared[key]
    twin.load_state_dict(weights, strict=True)
    return twin


def twin_attention(twin, layer: int):
    """Application ``layer``'s attention module in the twin: layer ``j`` of group ``step``."""
    step, j = divmod(layer, twin.config.inner_group_num)
    return twin.albert.encoder.albert_layer_groups[step].albert_layers[j].attention


@contextmanager
def surgery(twin, heads, means=None):
    """Inside the block, the twin with each head's input columns of its application's ``dense`` zeroed (and, with
    ``means[(layer, head)]``, ``W_O[:, h] @ mean`` added to that ``dense``'s bias); its weights as they were after."""
    saved = {k: v.clone() for k, v in twin.state_dict().items()}
    try:
        with torch.no_grad():
            for h in heads:
                dense = twin_attention(twin, h.layer).dense
                size = dense.in_features // twin.config.num_attention_heads
                columns = slice(h.head * size, (h.head + 1) * size)
                if means is not None:
                    dense.bias += dense.weight[:, columns] @ means[(h.layer, h.head)].to(dense.weight.dtype)
                dense.weight[:, columns] = 0.0
        yield twin
    finally:
        twin.load_state_dict(saved)


def surgery_logits(twin, heads, batch):
    with surgery(twin, heads) as cut:
        return logits(cut, batch)


def logits(model, batch):
    ids, mask = batch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_application_head_equals_the_unrolled_twin(shape):
    layers, groups, inner, attn = shape
    model = tiny_albert(layers=layers, groups=groups, inner=inner, attn=attn)
    twin = unrolled(model)
    sites = find_sites(model)
    check_sites(model, sites, "hf_classifier", "")
    assert [s.layer for s in sites] == list(range(layers * inner))
    modules = [s.module for s in sites]
    assert len({id(m) for m in modules}) == groups * inner  # several sites per module: the applications
    gates = HeadGates(sites)
    batch = random_batch()
    base = logits(model, batch)
    assert torch.equal(logits(twin, batch), base)  # exact: the same kernels on the same weights (the twin is right)
    for head in gates.inventory.heads:
        with gates.masked([head]):
            gated = logits(model, batch)
        # exact: a gate of 0 and zeroed columns feed the same product the same zeros
        assert torch.equal(gated, surgery_logits(twin, [head], batch)), head
        assert (gated - base).abs().max().item() > 1e-5, head  # other: the check can fail: the head matters
    # Several masks packed in one pass (the batch repeated once per mask), heads of several applications each.
    masks = [[Head("self", 0, 1), Head("self", layers - 1, 2)], [], [Head("self", 1, 0), Head("self", 2, 0),
                                                                     Head("self", 2, 3)]]
    rows = batch[0].shape[0]
    packed = (batch[0].repeat(len(masks), 1), batch[1].repeat(len(masks), 1))
    with gates.packed(masks, rows_per_mask=rows):
        together = logits(model, packed)
    for i, mask in enumerate(masks):
        # summation order: a batch three times as tall
        assert_routes_agree(together[i * rows:(i + 1) * rows], surgery_logits(twin, mask, batch),
                            depth=layers * inner, width=32, what=mask)
    assert torch.equal(logits(model, batch), base)  # exact: no gates after the packed pass


def test_attention_maps_and_donor_contexts_are_read_per_application():
    """What roles reads (each application's attention maps) and what resample ablation records (each application's
    contexts on the donor pass), against the twin read with transformers' own outputs and plain hooks."""
    from headsweep.workers.ablation.donors import record_contexts
    from headsweep.workers.families.hf_shared.attention import transformers_attention

    model = tiny_albert()
    twin = unrolled(model)
    gates = HeadGates(find_sites(model))
    ids, mask = random_batch()
    with transformers_attention(model, gates.sites) as captured, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    contexts = record_contexts(gates, lambda: model(input_ids=ids, attention_mask=mask))
    inputs: dict[int, torch.Tensor] = {}
    handles = [twin_attention(twin, n).dense.register_forward_pre_hook(
        lambda _m, args, n=n: inputs.__setitem__(n, args[0])) for n in range(3)]
    with torch.no_grad():
        expected = twin(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    assert sorted(captured) == sorted(contexts) == [("self", n) for n in range(3)]
    for n, maps in enumerate(expected):
        assert torch.equal(captured[("self", n)], maps), n  # exact: the same computation, read at another hook
        assert torch.equal(contexts[("self", n)], inputs[n].view(*inputs[n].shape[:2], 4, 8)), n  # exact: likewise
    assert not torch.equal(contexts[("self", 0)], contexts[("self", 2)])  # other: the applications differ


def test_a_forward_that_calls_the_shared_module_otherwise_stops():
    """The call counts are checked after every forward: a model that runs its shared layer another number of
    times than its applications were numbered for cannot gate the wrong one silently."""
    model = tiny_albert()
    gates = HeadGates(find_sites(model))
    model.config.num_hidden_layers = 2  # AlbertTransformer.forward reads it at each call
    with gates.masked([Head("self", 2, 0)]), pytest.raises(
            HeadsweepError, match=r"^albert.encoder.albert_layer_groups.0.albert_layers.0.attention ran 2 times in one "
                                  r"forward pass of AlbertTransformer, not the 3"):
        logits(model, random_batch())


def test_physical_pruning_is_refused_before_anything_changes():
    from headsweep.workers.families.hf_classifier.pruning import prune_hf_heads

    model = tiny_albert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadsweepError, match=r"^physical pruning \(export, efficiency\) is not supported for a layer "
                                             r"shared across depths: albert.encoder.albert_layer_groups.0.albert_layers"
                                             r".0.attention runs as self:0, self:1, self:2"):
        prune_hf_heads(model, [Head("self", 1, 0)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- a saved ALBERT through the classifier adapter and the CLI ---------------------------------------------------

@pytest.fixture(scope="module")
def albert_dir(tmp_path_factory):
    return save_tiny_albert(tmp_path_factory.mktemp("models") / "tiny-albert")


def classifier(model_dir, data, **runtime):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import ClassifierAdapter
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    return ClassifierAdapter(ClassifierModel(path=str(model_dir), attn_implementation="eager"),
                             ClassifierData(path=str(data)), RuntimeOptions(**runtime))


def test_gradient_importance_equals_the_unrolled_twins(albert_dir, tiny_dev_tsv, tmp_path):
    """Per-token gates of every application (blocks recomputed in the backward pass where the model allows it:
    ALBERT's shared block is not, since recomputing it would count its calls again) against the same estimate on
    the twin, an ordinary model with one module per application."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from headsweep.workers.analyses.importance import gradient_importance

    twin_dir = tmp_path / "twin"
    unrolled(AutoModelForSequenceClassification.from_pretrained(albert_dir).eval()).save_pretrained(twin_dir)
    AutoTokenizer.from_pretrained(albert_dir).save_pretrained(twin_dir)
    shared = gradient_importance(classifier(albert_dir, tiny_dev_tsv, batch_size=16))
    twin = gradient_importance(classifier(twin_dir, tiny_dev_tsv, batch_size=16))
    assert shared.raw.keys() == twin.raw.keys() and len(shared.raw) == 12
    for head, value in twin.raw.items():
        # exact: the same kernels on the same weights; only which hook gates the call differs
        assert shared.raw[head] == value, head
    assert len({round(v, 9) for v in shared.raw.values()}) == 12  # other: every application's heads have their own


def test_mean_ablation_per_application_equals_its_bias_fold(albert_dir, tiny_dev_tsv, tmp_path):
    """The means are recorded per application (not pooled over the shared module's calls) and mean-ablating a
    head equals the twin with that head's columns zeroed and ``W_O[:, h] @ mean_h`` folded into the bias."""
    from transformers import AutoModelForSequenceClassification

    from headsweep.sweep import experiments
    from headsweep.sweep.configuration.config import load_config
    from headsweep.sweep.run.context import Context
    from headsweep.workers.ablation.means import reference_means
    from headsweep.workers.ablation.spec import AblationSpec
    adapter = classifier(albert_dir, tiny_dev_tsv, batch_size=16, masks_per_batch=3)
    assert adapter.reuse_note.startswith("plain path: prefix reuse does not support this model (albert.encoder")
    info = adapter.describe()
    assert info.facts["shared_attention"] == {
        "albert.encoder.albert_layer_groups.0.albert_layers.0.attention": [0, 1, 2]}
    # The driver's checks against the loaded model (run before anything is written) refuse efficiency's removal.
    cfg_file = tmp_path / "efficiency.yaml"
    cfg_file.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(albert_dir)},
                                        "data": {"path": str(tiny_dev_tsv)},
                                        "sweep": {"experiments": ["baseline", "efficiency"]},
                                        "efficiency": {"mask": ["self:1:0"]}}))
    with pytest.raises(HeadsweepError, match=r"^physical removal \(experiment efficiency\) is not supported for a "
                                             r"layer shared across depths: albert.encoder.+; drop efficiency from "
                                             r"sweep.experiments$"):
        experiments.validate(Context(load_config(str(cfg_file)), info, None, None, "run"))  # type: ignore[arg-type]
    means = reference_means(adapter, AblationSpec("mean"), "evaluation data").fill

    twin = unrolled(AutoModelForSequenceClassification.from_pretrained(albert_dir, attn_implementation="eager").eval())
    sums = {n: torch.zeros(32, dtype=torch.float64) for n in range(3)}
    count = 0
    real: list[torch.Tensor] = []

    def record(n):
        def hook(_module, args):
            sums[n] += args[0][real[0].bool()].double().sum(dim=0)
        return hook

    handles = [twin_attention(twin, n).dense.register_forward_pre_hook(record(n)) for n in range(3)]
    try:
        for _, inputs in adapter.batches:
            real[:] = [inputs["attention_mask"]]
            count += int(inputs["attention_mask"].sum())
            with torch.no_grad():
                twin(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    direct = {n: (sums[n] / count).view(4, 8) for n in range(3)}
    assert not torch.allclose(direct[0], direct[2])  # other: the applications' means differ (pooling would show)
    for n in range(3):
        # other: float64 sums against headsweep's float64 sums kept in float32 (one rounding each, 2^-24 relative)
        torch.testing.assert_close(means.values[("self", n)].double(), direct[n], rtol=1e-6, atol=1e-7)

    adapter.gates.set_fill(means)
    masks = [[Head("self", 1, 2)], [Head("self", 0, 0), Head("self", 2, 3)]]
    gated = adapter.logits(masks)  # packed: both masks in one pass
    folds = {(h.layer, h.head): means.values[("self", h.layer)][h.head] for m in masks for h in m}
    for i, mask in enumerate(masks):
        expected = torch.empty_like(gated[i])
        with surgery(twin, mask, folds) as folded, torch.no_grad():
            for idx, inputs in adapter.batches:
                expected[idx] = folded(**inputs).logits
        # summation order: the folded bias is added inside the product, the fill after it; packed rows
        assert_routes_agree(gated[i], expected, depth=3, width=32, what=mask)
        assert (gated[i] - adapter.logits([[]])[0]).abs().max() > 1e-4  # other: the ablation moves the logits


def test_single_head_run_through_the_cli_and_export_refused(albert_dir, tiny_dev_tsv, tmp_path, ray_address):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from headsweep.workers.families.hf_classifier.config import ClassifierData
    from headsweep.workers.families.hf_classifier.data import read_examples

    cfg = {"model": {"kind": "hf_classifier", "path": str(albert_dir)},
           "data": {"path": str(tiny_dev_tsv), "max_examples": 24},
           "sweep": {"experiments": ["baseline", "single_head"]}}
    (tmp_path / "albert.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "albert.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    con = duckdb.connect()
    rows = con.execute(f"SELECT eval_id, score, n_examples FROM read_parquet('{store}/evaluations/**/*.parquet', "
                       "hive_partitioning=true, union_by_name=true) ORDER BY eval_id").fetchall()
    scores = {eval_id: score for eval_id, score, _ in rows}
    assert sorted(scores) == ["baseline", *sorted(f"single_head/self:{n}:{h}" for n in range(3) for h in range(4))]
    assert {n for _, _, n in rows} == {24}
    facts = json.loads(con.execute(f"SELECT facts FROM read_parquet('{store}/runs/**/*.parquet') WHERE run_id = "
                                   f"'{run_id}' LIMIT 1").fetchone()[0])
    assert facts["shared_attention"] == {"albert.encoder.albert_layer_groups.0.albert_layers.0.attention": [0, 1, 2]}

    # Each score against the twin with that application's columns zeroed, run with transformers alone.
    examples = read_examples(ClassifierData(path=str(tiny_dev_tsv), max_examples=24))
    tokenizer = AutoTokenizer.from_pretrained(albert_dir)
    model = AutoModelForSequenceClassification.from_pretrained(albert_dir).eval()
    twin = unrolled(model)
    inputs = tokenizer(list(examples.texts), padding=True, truncation=True, max_length=64, return_tensors="pt")
    labels = torch.tensor([int(x) if x.isdigit() else model.config.label2id[x] for x in examples.labels])

    def accuracy(m):
        with torch.no_grad():
            return float((m(**inputs).logits.argmax(-1) == labels).double().mean())

    assert scores["baseline"] == pytest.approx(accuracy(twin), abs=1e-12)
    moved = 0
    for n in range(3):
        for h in range(4):
            with surgery(twin, [Head("self", n, h)]) as cut:
                expected = accuracy(cut)
            assert scores[f"single_head/self:{n}:{h}"] == pytest.approx(expected, abs=1e-12), (n, h)
            moved += expected != scores["baseline"]
    assert moved  # other: some head changes some prediction, so the comparison could fail

    # Physical pruning cannot be exact for shared weights: one line, exit 2, nothing written.
    out = tmp_path / "pruned"
    proc = run_cli("export", str(tmp_path / "albert.yaml"), "--mask", "self:1:0", "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "physical pruning (export, efficiency) is not supported for a layer shared across depths" in \
        error_line(proc.stderr)
    assert not out.exists()
