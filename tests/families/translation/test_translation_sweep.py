"""A fairseq translation sweep through the real CLI and Ray: BLEU and significance vs sacrebleu."""

from __future__ import annotations

import numpy as np
import pytest
import sacrebleu
import yaml
from conftest import run_cli
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest
from tiny_fairseq import TINY_SETTINGS, TinyFairseq

from headsweep.results.store import ResultStore


def config(tiny, **sweep):
    return {
        "name": "tiny-translation",
        "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint),
                  "data_bin": str(tiny.data.data_bin), "beam": 3},
        "data": {"source": str(tiny.data.test_source), "target": str(tiny.data.test_target)},
        "sweep": {"batch_size": 20, **sweep},
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model trained long enough (BLEU about 40) that ablations visibly change BLEU."""
    import dataclasses
    import logging

    from headsweep.sweep.demo.translation import prepare_synthetic
    from headsweep.workers.families.fairseq_translation.train import train_translation

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    dest = tmp_path_factory.mktemp("tiny_fairseq_sweep")
    data = prepare_synthetic(dest, n_train=1200, n_valid=40, n_test=40, seed=3)
    settings = dataclasses.replace(TINY_SETTINGS, max_epochs=12, save_every_epoch=False)
    result = train_translation(data.data_bin, dest / "checkpoints", "src", "tgt", settings)
    return TinyFairseq(data, result.checkpoint, [])


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, tiny, ray_address):
    tmp = tmp_path_factory.mktemp("translation_sweep")
    (tmp / "c.yaml").write_text(yaml.safe_dump(config(tiny, experiments=["baseline", "single_head", "all_but_one"],
                                                      workers=2)))
    proc = run_cli("run", str(tmp / "c.yaml"), "--store", str(tmp / "store"), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return ResultStore(str(tmp / "store")), proc.stdout.strip()


def outputs_by_eval(store, run_id):
    rows = store.read("examples", run_id).to_pylist()
    out: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: (r["eval_id"], int(r["example_id"]))):
        out.setdefault(r["eval_id"], []).append(r)
    return out


def test_every_head_of_every_attention_type(sweep_run):
    store, run_id = sweep_run
    evals = store.read("evaluations", run_id).to_pylist()
    single = [e for e in evals if e["experiment"] == "single_head"]
    assert sorted((e["attention"], e["layer"], e["head"]) for e in single) == sorted(
        (a, layer, h) for a in ("enc_self", "enc_dec", "dec_self") for layer in range(2) for h in range(4)
    )
    assert sum(e["experiment"] == "all_but_one" for e in evals) == 24
    [run] = store.read("runs", run_id).to_pylist()
    assert run["status"] == "complete" and run["metric"] == "bleu"
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in run["facts"]


def test_stored_bleu_equals_sacrebleu_on_stored_hypotheses(sweep_run):
    store, run_id = sweep_run
    scores = {e["eval_id"]: e["score"] for e in store.read("evaluations", run_id).to_pylist()}
    examples = outputs_by_eval(store, run_id)
    spread = []
    for eval_id, rows in examples.items():
        hyps = [r["output"] for r in rows]
        refs = [r["reference"] for r in rows]
        expected = sacrebleu.corpus_bleu(hyps, [refs]).score
        # other: float64 in both (sacrebleu, and ours from summed stats); 1e-9 on a score <= 100
        assert scores[eval_id] == pytest.approx(expected, abs=1e-9), eval_id
        stats = BLEU(references=[refs])._extract_corpus_statistics(hyps, None)
        np.testing.assert_array_equal(np.array([r["stats"] for r in rows]), np.array(stats, dtype=float))
        spread.append(expected)
    assert max(spread) - min(spread) > 5  # ablations really change the translations


def test_bootstrap_p_values_agree_with_sacrebleu(sweep_run, monkeypatch):
    """Same seed, same resamples: sacrebleu's PairedTest gives the same p-values on the same outputs.

    Agreement is exact except where sacrebleu's float32 scores break a near-tie the other way
    (one resample, 1/1001), and for systems identical to the baseline, where we report p = 1.
    """
    store, run_id = sweep_run
    examples = outputs_by_eval(store, run_id)
    sig = {s["eval_id"]: s for s in store.read("significance", run_id).to_pylist() if s["test"] == "paired_bootstrap"}
    single = sorted(e for e in sig if e.startswith("single_head/"))
    assert len(single) == 24 and all(sig[e]["seed"] == 12345 and sig[e]["n_resamples"] == 1000 for e in single)
    refs = [r["reference"] for r in examples["baseline"]]
    base = [r["output"] for r in examples["baseline"]]
    named = [("baseline", base)] + [(e, [r["output"] for r in examples[e]]) for e in single]
    monkeypatch.setenv("SACREBLEU_SEED", "12345")
    _, result = PairedTest(named, {"BLEU": BLEU(references=[refs])}, None, test_type="bs", n_samples=1000)()
    theirs = {e: r.p_value for e, r in zip(single, result["BLEU"][1:], strict=True)}
    compared = 0
    for e in single:
        if named[single.index(e) + 1][1] == base:
            assert sig[e]["p_value"] == 1.0
            continue
        assert abs(sig[e]["p_value"] - theirs[e]) <= 1 / 1001 + 1e-12, e
        compared += 1
    assert compared >= 12


# sweep.attention through the CLI (only those heads stored, the baseline with single_head alone, significance off
# on the command line): test_translation_resample.py::test_a_resample_run_through_the_cli, on the same run it makes
@pytest.mark.slow
def test_restricting_attention_types(tmp_path, tiny, ray_address):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(tiny, experiments=["single_head"], attention=["enc_dec"])))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "s"), "--address", ray_address,
                   "--quiet", "significance.enabled=false")
    assert proc.returncode == 0, proc.stderr
    evals = ResultStore(str(tmp_path / "s")).read("evaluations").to_pylist()
    assert {e["attention"] for e in evals if e["experiment"] == "single_head"} == {"enc_dec"}
    assert len(evals) == 1 + 8


def test_the_run_keeps_the_checkpoints_fingerprint_and_export_refuses_other_weights(sweep_run, tiny, tmp_path):
    """``facts.weights``: the SHA-256 of the checkpoint file (hashlib here); once the file holds other bytes,
    ``export --from-run`` of the run is refused in one line and writes nothing (the file is put back after)."""
    import hashlib
    import json
    from pathlib import Path

    from conftest import error_line

    store, run_id = sweep_run
    [weights] = json.loads(store.run(run_id)["facts"])["weights"]
    original = tiny.checkpoint.read_bytes()
    file_hash = hashlib.sha256(original).hexdigest()
    assert weights == {"model": str(tiny.checkpoint), "bytes": len(original),
                       "sha256": hashlib.sha256(f"{tiny.checkpoint.name}\0{file_hash}\n".encode()).hexdigest()}
    out = tmp_path / "pruned"
    try:
        tiny.checkpoint.write_bytes(original + b"\0")  # another file under the run's checkpoint name
        proc = run_cli("export", str(Path(store.root).parent / "c.yaml"), "--from-run", run_id, "--eval-id",
                       "single_head/enc_self:0:1", "--out", str(out), "--store", store.root)
    finally:
        tiny.checkpoint.write_bytes(original)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    assert error_line(proc.stderr).startswith(f"headsweep: error: run {run_id} was made with other weights than "
                                              f"{tiny.checkpoint} holds now (weights sha256 {weights['sha256'][:12]}")
    assert not out.exists()
