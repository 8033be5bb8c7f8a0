"""Mean ablation: the means against a direct computation, the run through the CLI, resume and bad input.

The direct route runs a freshly loaded library model (transformers, fairseq) on **one example at a time**, so no
padding exists on it at all, with a forward pre-hook on each attention module's output projection, and averages in
float64 in the test: no headsweep code computes it. The means the workers take over padded batches must equal it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import error_line, run_cli
from report_pages import parse
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.ablation.values import stored_values
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.run.runs import resumable
from headsweep.workers.ablation.means import reference_means
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.ablation.worker_fill import fill_of
from headsweep.workers.families.registry import model_family

pytestmark = pytest.mark.usefixtures("one_thread")


def load(model: dict, data: dict, **runtime):
    family = model_family(model["kind"])
    return family.load(from_dict(family.model_config, model, "model"), from_dict(family.data_config, data, "data"),
                       family.runtime(**runtime))


class Recorder:
    """Pre-hooks on output projections: every call's input, batch first (B, T, C), by site name."""

    def __init__(self, projections: dict[str, torch.nn.Module], time_first: bool = False):
        self.seen: dict[str, list[torch.Tensor]] = {name: [] for name in projections}
        self.time_first = time_first
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in projections.items()]

    def _hook(self, name: str):
        def hook(_module, args):
            x = args[0].detach().double()
            self.seen[name].append(x.transpose(0, 1) if self.time_first else x)

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def direct_means(recorder: Recorder, skip_first: bool = False) -> dict[str, np.ndarray]:
    """Per site, the mean over every token of every recorded (unpadded, one-example) call."""
    out = {}
    for name, calls in recorder.seen.items():
        rows = torch.cat([c[0, 1:] if skip_first else c[0] for c in calls])
        out[name] = rows.mean(dim=0).numpy()
    return out


def direct_per_position(recorder: Recorder) -> dict[str, np.ndarray]:
    """Per site, the mean at each position over the examples that reach it: (longest, C)."""
    out = {}
    for name, calls in recorder.seen.items():
        longest = max(c.shape[1] for c in calls)
        out[name] = np.stack([torch.stack([c[0, p] for c in calls if c.shape[1] > p]).mean(dim=0).numpy()
                              for p in range(longest)])
    return out


def worker_means(adapter, **spec) -> tuple[dict[str, np.ndarray], Any]:
    means = reference_means(adapter, AblationSpec("mean", **spec), "evaluation data")
    return {f"{a}:{layer}": v.double().cpu().numpy() for (a, layer), v in means.fill.values.items()}, means


# -- the means against the direct route ----------------------------------------------------------------------

def test_classifier_means_exclude_padding(tiny_bert_dir, tiny_dev_tsv):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    adapter = load({"kind": "hf_classifier", "path": str(tiny_bert_dir), "attn_implementation": "eager"},
                   {"path": str(tiny_dev_tsv)}, batch_size=16)
    real = [inputs["attention_mask"] for _, inputs in adapter.batches]
    assert sum(int(m.sum()) for m in real) < sum(m.numel() for m in real)  # the batches are padded (ragged)
    found, means = worker_means(adapter)

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    layers = model.bert.encoder.layer
    recorder = Recorder({f"self:{i}": layer.attention.output.dense for i, layer in enumerate(layers)})
    with torch.no_grad():
        for text in adapter.examples.texts:
            model(**tokenizer(text, return_tensors="pt", truncation=True, max_length=adapter.max_length))
    recorder.close()
    expected = direct_means(recorder)
    for name, value in expected.items():
        # summation order: padded batches of 16 against one sentence at a time (float32, 2 layers, width 64)
        assert_routes_agree(found[name].reshape(-1), value, depth=2, width=64, dtype=torch.float32, what=name)
    assert set(means.tokens.values()) == {sum(int(m.sum()) for m in real)} == {sum(c.shape[1] for c in
                                                                                  recorder.seen["self:0"])}


def test_causal_lm_means_per_position_and_keep_first(tmp_path):
    from tiny_models import lm_text, save_tiny_causal_lm
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_causal_lm(tmp_path / "lm", "llama_8q2kv")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(lm_text(200, seed=7))
    adapter = load({"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "eager"},
                   {"path": str(corpus), "window": 12, "add_bos": True}, batch_size=3)
    found, means = worker_means(adapter)
    per, per_means = worker_means(adapter, per_position=True, keep_first=True)

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    recorder = Recorder({f"self:{i}": layer.self_attn.o_proj for i, layer in enumerate(model.model.layers)})
    with torch.no_grad():
        for row in adapter.inputs:  # every window, one at a time
            model(input_ids=row.unsqueeze(0), use_cache=False)
    recorder.close()
    windows, width = adapter.inputs.shape
    assert set(means.tokens.values()) == {windows * width}  # every token of every window, scored or not
    assert set(per_means.tokens.values()) == {windows * (width - 1)}  # keep_first: position 0 not counted
    assert per_means.positions == width
    pooled = direct_means(recorder, skip_first=True)
    for name, value in direct_means(recorder).items():
        # summation order: batches of 3 windows against one at a time (float32, 2 layers, width 64)
        assert_routes_agree(found[name].reshape(-1), value, depth=2, width=64, dtype=torch.float32, what=name)
        rows = per[name].reshape(width + 1, -1)  # (P + 1, H * d): P positions, then the pooled mean
        expected = direct_per_position(recorder)[name]
        assert_routes_agree(rows[1:width], expected[1:], depth=2, width=64, dtype=torch.float32, what=name)
        assert_routes_agree(rows[width], pooled[name], depth=2, width=64, dtype=torch.float32, what=name)
        assert np.array_equal(rows[0], rows[width])  # position 0 is kept: its row is the pooled one, never applied


def test_translation_means_source_and_teacher_forced_target(trained_tiny_fairseq):
    from tiny_fairseq import collate, fairseq_load

    tiny = trained_tiny_fairseq
    data_bin = str(tiny.data.data_bin)
    adapter = load({"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint), "data_bin": data_bin},
                   {"data_bin": data_bin, "split": "test", "max_examples": 16}, batch_size=6, max_tokens=0)
    found, means = worker_means(adapter)

    model, task = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    for module in model.modules():  # off the fused kernel, which never calls out_proj as a module
        if hasattr(module, "skip_embed_dim_check"):
            module.skip_embed_dim_check = True
    projections = {f"enc_self:{i}": layer.self_attn.out_proj for i, layer in enumerate(model.encoder.layers)}
    projections.update({f"enc_dec:{i}": layer.encoder_attn.out_proj for i, layer in enumerate(model.decoder.layers)})
    recorder = Recorder(projections, time_first=True)
    ex = adapter.examples
    with torch.no_grad():
        for source, target in zip(ex.source, ex.target, strict=True):
            sample = collate([source], [target], task.source_dictionary, task.target_dictionary)
            model(**sample["net_input"])
    recorder.close()
    for name, value in direct_means(recorder).items():
        # summation order: padded batches of 6 against one sentence at a time (float32, 2 + 2x2 layers, width 64)
        assert_routes_agree(found[name].reshape(-1), value, depth=6, width=64, dtype=torch.float32, what=name)
    assert means.tokens[("enc_self", 0)] == sum(len(s) for s in ex.source)  # source tokens, EOS included
    assert means.tokens[("enc_dec", 0)] == means.tokens[("dec_self", 1)] == sum(len(t) for t in ex.target)


def test_positions_from_a_left_padding_tokenizer_are_refused(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    left = shutil.copytree(tiny_bert_dir, tmp_path / "left")
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    adapter = load({"kind": "hf_classifier", "path": str(left)}, {"path": str(tiny_dev_tsv)}, batch_size=16)
    for spec in ({"per_position": True}, {"keep_first": True}):
        with pytest.raises(HeadsweepError, match="padded on the left"):
            reference_means(adapter, AblationSpec("mean", **spec), "evaluation data")
    reference_means(adapter, AblationSpec("mean"), "evaluation data")  # pooled over all tokens: no positions


# -- the CLI ---------------------------------------------------------------------------------------------------

def test_mean_ablation_run_resume_and_compare(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """A partial mean-ablation run stores its means, columns and titles; a changed reference or another method on
    --resume is refused with nothing written; the run then resumes and completes, and compares with a zero run."""
    reference = write_tsv(generate(40, seed=11), tmp_path / "reference.tsv")
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16, "flush_every": 1},
           "significance": {"alpha": 0.5}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = str(tmp_path / "store")
    common = ["--store", store, "--address", ray_address, "--quiet"]
    mean = ["sweep.ablation=mean", f"ablation.reference.path={reference}"]
    first = run_cli("run", str(tmp_path / "c.yaml"), *mean, "sweep.budget.evaluations=3", *common)
    assert first.returncode == 0, first.stderr
    run_id = first.stdout.strip()
    reader = ResultStore(store)
    assert reader.run(run_id)["status"] == "partial" and reader.run(run_id)["ablation"] == "mean"
    values = reader.read("ablation_values", run_id).to_pylist()
    assert len(values) == 8 and {(v["method"], v["positions"], v["n_rows"], v["head_dim"]) for v in values} == {
        ("mean", "all", 1, 8)}
    assert all(len(v["values"]) == 8 and v["mean_norm"] == pytest.approx(np.linalg.norm(v["values"]), rel=1e-6)
               for v in values)  # other: float32 values, their norm taken in float64 by the tool and numpy
    facts = json.loads(reader.run(run_id)["facts"])["ablation"]
    assert facts["reference"]["path"] == str(reference) and facts["positions"] == "all"
    assert facts["tokens"]["self"] == values[0]["n_tokens"] > 40
    assert {e["ablation"] for e in reader.read("evaluations", run_id).to_pylist()} == {"mean"}
    for view in ("heads", "deltas"):
        assert run_query(reader, f"SELECT DISTINCT ablation FROM {view} WHERE run_id = ?",
                         [run_id]).column("ablation").to_pylist() == ["mean"]
    # The stored vectors read back as the workers computed them (what an L0 Tune trial applies): the same means
    # as this process computes on the reference data.
    stored = stored_values(reader, run_id, None)
    here, _ = worker_means(load(cfg["model"], {"path": str(reference)}, batch_size=16))
    assert sorted(stored) == sorted(here) == ["self:0", "self:1"]
    for name, value in stored.items():
        # summation order: the worker's threads against this process's one (float32 means of float64 sums)
        assert_routes_agree(value, here[name], depth=2, width=64, dtype=torch.float32, what=name)
    assert fill_of(AblationSpec("mean"), stored).values[("self", 1)].shape == (4, 8)

    before = snapshot(tmp_path / "store")
    write_tsv(generate(40, seed=12), reference)  # the reference data changed under the unfinished run
    changed = run_cli("run", str(tmp_path / "c.yaml"), *mean, *common)
    assert changed.returncode == 2 and "stored other mean-ablation values" in error_line(changed.stderr)
    assert snapshot(tmp_path / "store") == before  # nothing written
    # --resume of this run with another method (refused before anything is written; workers are started first, so
    # asked here of the function the driver asks)
    with pytest.raises(HeadsweepError, match="made with sweep.ablation mean, this config asks zero"):
        resumable(reader, build_config(cfg), run_id, True)

    write_tsv(generate(40, seed=11), reference)
    resumed = run_cli("run", str(tmp_path / "c.yaml"), *mean, *common)
    assert resumed.returncode == 0 and resumed.stdout.strip() == run_id, resumed.stderr
    assert reader.run(run_id)["status"] == "complete"
    assert len(reader.read("ablation_values", run_id)) == 8  # stored once, checked on resume

    zero = run_cli("run", str(tmp_path / "c.yaml"), *common)
    assert zero.returncode == 0, zero.stderr
    compared = run_cli("compare", zero.stdout.strip(), run_id, "--store", store, "--format", "json")
    assert compared.returncode == 0, compared.stderr
    lines = [json.loads(line) for line in compared.stdout.splitlines()]
    [overlap] = [r for r in lines if "jaccard" in r]
    assert (overlap["ablation_a"], overlap["ablation_b"]) == ("zero", "mean")
    gained = {h for h in overlap["heads_gained"].split(", ") if h}
    assert len(gained) == overlap["significant_b"] - overlap["significant_both"]
    [row] = [r for r in lines if r.get("quantity") == "single_head_delta"]
    assert row["n_heads"] == 8

    report = run_cli("report", run_id, "--store", store, "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    text = " ".join(parse(Path(report.stdout.strip())).text)
    assert "Single-head ablation (mean ablation)" in text and f"means over path: {reference}" in text


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_ablation_settings_refused_before_anything_starts(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    classifier = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)}}
    translation = {"model": {"kind": "fairseq_translation", "checkpoint": str(tmp_path / "c.pt"),
                             "data_bin": str(tmp_path)}, "data": {"data_bin": str(tmp_path), "split": "test"}}
    # What the config alone refuses, asked of the function the CLI asks (its one line is checked below).
    with pytest.raises(HeadsweepError, match=r"^sweep.ablation optimal trains each head's constant on ablation.refe"):
        build_config({**classifier, "sweep": {"ablation": "optimal"}})
    with pytest.raises(HeadsweepError, match="^ablation.keep_first is not available for fairseq_translation models"):
        build_config({**translation, "ablation": {"keep_first": True}})
    empty = tmp_path / "empty.tsv"
    empty.write_text("sentence\tlabel\n")  # a reference without examples: refused by the family's data checks
    cases = [
        (translation, ["sweep.ablation=mean", "ablation.positions=per_position"],
         "ablation.positions: per_position is not available for fairseq_translation models"),
        (classifier, ["sweep.ablation=mean", f"ablation.reference.path={empty}"], f"{empty} has no examples"),
    ]
    for i, (cfg, overrides, message) in enumerate(cases):
        (tmp_path / f"c{i}.yaml").write_text(yaml.safe_dump(cfg))
        proc = run_cli("run", str(tmp_path / f"c{i}.yaml"), *overrides, "--store", str(tmp_path / "store"))
        assert proc.returncode == 2 and message in error_line(proc.stderr), proc.stderr
        assert not (tmp_path / "store").exists()
