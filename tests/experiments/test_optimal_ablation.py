"""Optimal ablation: per-head constants trained on ablation.reference to minimise the loss.

Against independent routes: the loss a trained constant claims is the loss of the stock model under weight surgery
(the head's W_O columns zeroed, ``W_O[:, h] @ c_h`` in the bias: no gate or fill code), and that loss is at most the
mean constant's under the same surgery; the installed constant (as a worker installs it, from values) evaluates as
the surgery does. The CLI run stores the constants, a resume reads them back instead of training, and the
evaluation data as the training data is refused with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from ablation_routes import folded_fill
from conftest import error_line, run_cli
from tolerances import assert_routes_agree, max_difference

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.ablation.values import stored_values
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.pruning.export import MANIFEST, export_pruned
from headsweep.workers.ablation.means import reference_means
from headsweep.workers.ablation.optimal import OptimalSettings, train_head
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.ablation.worker_fill import WorkerFill, fill_of
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import model_family

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 25


def load(model: dict, data: dict, **runtime):
    family = model_family(model["kind"])
    return family.load(from_dict(family.model_config, model, "model"), from_dict(family.data_config, data, "data"),
                       family.runtime(**runtime))


def surgery_loss(adapter, head: Head, constant: torch.Tensor) -> float:
    """The reference loss per example of the stock model (no gates, no fill) with ``constant`` folded into the head's
    output projection: the independent route to what the trained constant claims."""
    site = {s.key: s for s in adapter.gates.sites}[head.site]
    adapter.gates.clear()
    saved = adapter.gates.fill
    adapter.gates.set_fill(None)
    try:
        with folded_fill(site.out_proj, site.head_dim, {head.head: constant}), torch.no_grad():
            batches = adapter.loss_batches(None, torch.float32).batches
            return sum(float(b.loss()) for b in batches) / sum(b.n_examples for b in batches)
    finally:
        adapter.gates.set_fill(saved)


def check_trained(adapter, evaluation, heads: list[Head], depth: int, width: int) -> None:
    """For each head: the constant's claimed loss is the surgery route's, at most the mean's (strictly below for at
    least one head), training again gives the same constant; installed on ``evaluation`` (from values, as a worker
    installs them) its evaluation equals the surgery's."""
    spec = AblationSpec("optimal", settings=OptimalSettings(steps=STEPS, lr=0.05))
    means = reference_means(adapter, AblationSpec("mean"), "reference").fill
    gains = []
    for head in heads:
        constant, record = train_head(adapter, spec, means, head)
        again, _ = train_head(adapter, spec, means, head)
        assert torch.equal(constant, again), f"{head}: training is not deterministic"
        mean = means.values[head.site][head.head]
        at_mean, at_optimal = surgery_loss(adapter, head, mean), surgery_loss(adapter, head, constant)
        # summation order: the gate route against the folded projection (float32 loss over the layers)
        assert_routes_agree(record["loss_mean"], at_mean, depth=depth, width=width, what=(head, "mean loss"))
        assert_routes_agree(record["loss_optimal"], at_optimal, depth=depth, width=width, what=(head, "loss"))
        assert at_optimal <= at_mean, (head, at_optimal, at_mean)
        assert 0 < record["updates"] <= STEPS
        gains.append(at_mean - at_optimal)

        values = {f"{a}:{layer}": v.detach().cpu().numpy().copy() for (a, layer), v in means.values.items()}
        values[f"{head.attention}:{head.layer}"][head.head] = constant.numpy()
        evaluation.gates.set_fill(fill_of(spec, values))
        try:
            (got,) = evaluation.evaluate([[head]])
        finally:
            evaluation.gates.set_fill(None)
        site = {s.key: s for s in evaluation.gates.sites}[head.site]
        with folded_fill(site.out_proj, site.head_dim, {head.head: constant}):
            (expected,) = evaluation.evaluate([[]])
        # per-example losses (a 0/1 accuracy may flip on a near tie within the same rounding)
        assert_routes_agree(got.loss, expected.loss, depth=depth, width=width, what=(head, "installed loss"))
    assert max(gains) > 1e-4, gains  # training moved at least one constant below the mean's loss


def test_classifier_constants_beat_the_mean_and_equal_surgery(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    reference = write_tsv(generate(40, seed=11), tmp_path / "reference.tsv")
    model = {"kind": "hf_classifier", "path": str(tiny_bert_dir), "attn_implementation": "eager"}
    adapter = load(model, {"path": str(reference)}, batch_size=16)
    evaluation = load(model, {"path": str(tiny_dev_tsv)}, batch_size=16, reuse=False)
    heads = [Head("self", 0, 0), Head("self", 1, 2), Head("self", 1, 3)]
    check_trained(adapter, evaluation, heads, depth=2, width=64)
    # A worker before the constants are installed (or restarted, before they come back): a gated head refuses to run
    # rather than evaluate zero ablation under the name optimal; the unmasked model runs.
    evaluation.gates.set_fill(WorkerFill(AblationSpec("optimal")).fill)
    try:
        evaluation.evaluate([[]])
        with pytest.raises(HeadsweepError, match="^optimal ablation's constants are not installed on this worker"):
            evaluation.evaluate([[heads[0]]])
    finally:
        evaluation.gates.set_fill(None)


def test_causal_lm_constants_beat_the_mean_and_equal_surgery(tmp_path):
    from tiny_models import lm_text, save_tiny_causal_lm

    model_dir = save_tiny_causal_lm(tmp_path / "lm", "llama_8q2kv")
    model = {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "eager"}
    (tmp_path / "reference.txt").write_text(lm_text(150, seed=7))
    (tmp_path / "eval.txt").write_text(lm_text(100, seed=8))
    data = {"window": 12, "add_bos": True}
    adapter = load(model, {"path": str(tmp_path / "reference.txt"), **data}, batch_size=4)
    evaluation = load(model, {"path": str(tmp_path / "eval.txt"), **data}, batch_size=4, reuse=False)
    check_trained(adapter, evaluation, [Head("self", 0, 1), Head("self", 1, 6)], depth=2, width=64)


def _lm_eval_task(folder: Path, name: str, seed: int) -> None:
    """A local lm-eval multiple-choice task of 12 questions over the tiny models' words."""
    from tiny_models import lm_text

    rng = np.random.default_rng(seed)
    words = lm_text(400, seed=seed).split()
    lines = []
    for q in range(12):
        start = int(rng.integers(0, len(words) - 20))
        choices = [" ".join(words[start + 8 + 3 * c : start + 9 + 3 * c + c % 2]) for c in range(3)]
        lines.append(json.dumps({"q": " ".join(words[start : start + 6 + q % 3]), "opts": choices,
                                 "label": int(rng.integers(0, 3))}))
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{opts}}",
        "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}))


def test_lm_eval_task_constants_beat_the_mean_and_equal_surgery(tmp_path):
    """Mean and optimal ablation on an lm-eval task: the means and constants over the reference task's gold
    continuations, installed on the evaluation task's adapter (plain path, and the context cache) equal to the
    stock model with the constant folded into the head's output projection."""
    from tiny_models import save_tiny_causal_lm

    model_dir = save_tiny_causal_lm(tmp_path / "lm", "llama_8q2kv")
    model = {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "eager"}
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _lm_eval_task(tasks, "ref_mc", seed=7)
    _lm_eval_task(tasks, "eval_mc", seed=8)
    lm_eval = {"task": "lm_eval", "include_path": str(tasks)}
    adapter = load(model, {**lm_eval, "tasks": ["ref_mc"]}, batch_size=4)
    for context_cache in (False, True):
        evaluation = load(model, {**lm_eval, "tasks": ["eval_mc"]}, batch_size=4, reuse=context_cache,
                          context_cache=context_cache)
        assert evaluation.reuse_note.startswith("context cache" if context_cache else "off")
        check_trained(adapter, evaluation, [Head("self", 0, 1), Head("self", 1, 6)], depth=2, width=64)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_optimal_run_stores_constants_and_resume_reads_them_back(tmp_path, tiny_bert_dir, tiny_dev_tsv,
                                                                   ray_address):
    reference = write_tsv(generate(40, seed=11), tmp_path / "reference.tsv")
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16, "flush_every": 1, "workers": 2,
                     "threads_per_worker": 1},
           "significance": {"alpha": 0.5}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = str(tmp_path / "store")
    common = ["--store", store, "--address", ray_address]
    optimal = ["sweep.ablation=optimal", f"ablation.reference.path={reference}", f"ablation.steps={STEPS}",
               "ablation.lr=0.05"]

    # The evaluation data as the constants' training data: one line, exit 2, nothing written.
    refused = run_cli("run", str(tmp_path / "c.yaml"), "sweep.ablation=optimal",
                      f"ablation.reference.path={tiny_dev_tsv}", *common)
    assert refused.returncode == 2, refused.stderr
    assert "ablation.reference is the evaluation set" in error_line(refused.stderr)
    assert not Path(store).exists()

    first = run_cli("run", str(tmp_path / "c.yaml"), *optimal, "sweep.budget.evaluations=3", *common)
    assert first.returncode == 0, first.stderr
    assert "optimal ablation: training 8 head constants on 2 workers" in first.stderr
    run_id = first.stdout.strip()
    reader = ResultStore(store)
    assert reader.run(run_id)["status"] == "partial" and reader.run(run_id)["ablation"] == "optimal"
    rows = reader.read("ablation_values", run_id).to_pylist()
    assert len(rows) == 8 and {(r["method"], r["positions"], r["n_rows"], r["head_dim"]) for r in rows} == {
        ("optimal", "all", 1, 8)}
    assert {e["ablation"] for e in reader.read("evaluations", run_id).to_pylist()} == {"optimal"}, first.stderr
    stored = stored_values(reader, run_id, None)

    # The workers trained what this process trains (deterministic; another process and thread count only).
    adapter = load(cfg["model"], {"path": str(reference)}, batch_size=16)
    spec = AblationSpec("optimal", settings=OptimalSettings(steps=STEPS, lr=0.05))
    means = reference_means(adapter, AblationSpec("mean"), "reference").fill
    for head in (Head("self", 0, 1), Head("self", 1, 3)):
        here, _ = train_head(adapter, spec, means, head)
        there = stored[f"self:{head.layer}"][head.head]
        assert np.allclose(there, here.numpy(), rtol=1e-4, atol=1e-5), (head, there, here)
        assert not np.allclose(there, means.values[head.site][head.head].numpy(), rtol=1e-4, atol=1e-5)

    before = snapshot(tmp_path / "store" / "ablation_values")
    resumed = run_cli("run", str(tmp_path / "c.yaml"), *optimal, *common)
    assert resumed.returncode == 0 and resumed.stdout.strip() == run_id, resumed.stderr
    assert "are reused, not trained again" in resumed.stderr and "training 8 head" not in resumed.stderr
    assert reader.run(run_id)["status"] == "complete"
    assert snapshot(tmp_path / "store" / "ablation_values") == before  # stored once, read back
    assert len(reader.read("evaluations", run_id)) == 9  # the baseline and the 8 heads

    # headsweep export of a head of this run folds W_O[:, h] @ c_h into the bias: the pruned model is the ablated one.
    head = Head("self", 1, 3)
    [eval_id] = [e["eval_id"] for e in reader.read("evaluations", run_id).to_pylist()
                 if e["heads_masked"] == [str(head)]]
    out = export_pruned(build_config(cfg), tmp_path / "pruned", store=reader, from_run=run_id, eval_id=eval_id)
    assert json.loads((out / MANIFEST).read_text())["ablation"] == "optimal"
    model = {**cfg["model"], "attn_implementation": "eager"}
    exported = load({**model, "path": str(out)}, cfg["data"], batch_size=16, reuse=False)
    (got,) = exported.evaluate([[]])
    gated = load(model, cfg["data"], batch_size=16, reuse=False)
    gated.gates.set_fill(fill_of(spec, stored))
    (expected,) = gated.evaluate([[head]])
    gated.gates.set_fill(None)
    (zero,) = gated.evaluate([[head]])
    # summation order: the pruned model's narrower projection and folded bias against the gated full model
    assert_routes_agree(got.loss, expected.loss, depth=3, width=64, what="exported vs optimal-ablated")
    assert max_difference(got.loss, zero.loss) > 1e-3  # other: the fold changes the exported model


def test_optimal_settings_refused_by_the_config(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    base = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
            "sweep": {"ablation": "optimal"}}
    with pytest.raises(HeadsweepError, match="^sweep.ablation optimal trains each head's constant on "
                                             "ablation.reference: set it"):
        build_config(base)
    test_split = write_tsv(generate(10, seed=3), tmp_path / "test.tsv")
    with pytest.raises(HeadsweepError, match="^ablation.reference looks like a test split"):
        build_config({**base, "ablation": {"reference": {"path": str(test_split)}}})
    allowed = build_config({**base, "ablation": {"reference": {"path": str(tiny_dev_tsv)}, "allow_eval_data": True}})
    assert allowed.ablation.allow_eval_data
    with pytest.raises(HeadsweepError, match="^ablation.steps is set but sweep.ablation is mean"):
        build_config({**base, "sweep": {"ablation": "mean"}, "ablation": {"steps": 5}})
    with pytest.raises(HeadsweepError, match="^ablation.lr must be positive"):
        build_config({**base, "ablation": {"reference": {"path": str(test_split)}, "lr": 0.0}})


def test_export_refuses_what_a_bias_cannot_hold(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    from tiny_models import tiny_causal_lm

    from headsweep.sweep.ablation.fold import constants_to_fold, fold

    base = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)}}
    reference = write_tsv(generate(10, seed=3), tmp_path / "reference.tsv")
    mean = build_config({**base, "sweep": {"ablation": "mean"}, "ablation": {"reference": {"path": str(reference)}}})
    with pytest.raises(HeadsweepError, match="^export under sweep.ablation mean folds the constants a run stored"):
        constants_to_fold(mean, None, None, None)
    with pytest.raises(HeadsweepError, match="^this config ablates heads with sweep.ablation resample"):
        constants_to_fold(build_config({**base, "sweep": {"ablation": "resample"}}), None, None, None)
    assert constants_to_fold(build_config(base), None, None, None) == ("zero", {})

    llama = tiny_causal_lm("llama_8q2kv")
    sites = model_family("hf_causal_lm").find_sites(llama)
    values = {f"{s.key[0]}:{s.key[1]}": np.zeros((s.num_heads, s.head_dim), dtype=np.float32) for s in sites}
    with pytest.raises(HeadsweepError, match=r"^llama: the output projection of model.layers.0.self_attn has no bias"):
        fold(sites, [Head("self", 0, 1)], values, "optimal", "llama")


def test_fold_into_gpt2_conv1d_bias_equals_the_gated_fill(tmp_path):
    """GPT-2's output projection is a Conv1D (weight ``(in, out)``): the fold there, with the head's weight rows
    zeroed as pruning removes them, against the gate route with the same constants as fill."""
    from tiny_models import lm_text, save_tiny_causal_lm

    from headsweep.sweep.ablation.fold import fold

    model_dir = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    (tmp_path / "eval.txt").write_text(lm_text(100, seed=8))
    model = {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "eager"}
    data = {"path": str(tmp_path / "eval.txt"), "window": 12}
    gated = load(model, data, batch_size=4, reuse=False)
    means = reference_means(gated, AblationSpec("mean"), "evaluation data").fill
    values = {f"{a}:{layer}": v.cpu().numpy() for (a, layer), v in means.values.items()}
    heads = [Head("self", 0, 1), Head("self", 1, 2), Head("self", 1, 3)]
    gated.gates.set_fill(means)
    (expected,) = gated.evaluate([heads])
    gated.gates.set_fill(None)
    (zero,) = gated.evaluate([heads])

    folded = load(model, data, batch_size=4, reuse=False)
    sites = folded.gates.sites
    assert type(sites[0].out_proj).__name__ == "Conv1D"
    fold(sites, heads, values, "mean", "gpt2")
    with torch.no_grad():
        for head in heads:
            site = {s.key: s for s in sites}[head.site]
            site.out_proj.weight[head.head * site.head_dim:(head.head + 1) * site.head_dim] = 0.0
    (got,) = folded.evaluate([[]])
    # summation order: the folded bias against the gate's W_O c_h (float32, 2 layers, width 64)
    assert_routes_agree(got.stats, expected.stats, depth=3, width=64, what="gpt2 fold vs gated mean")
    assert max_difference(got.stats, zero.stats) > 1e-3  # other: the fold is not zero ablation
