"""Cross-domain consistency: two runs of one model on two evaluation sets, compared by the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, sweep_in_process
from scipy import stats

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv


def test_compare_two_domains(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    other = write_tsv(generate(40, seed=99), tmp_path / "other.tsv")
    train = write_tsv(generate(40, seed=5), tmp_path / "train.tsv")
    store = tmp_path / "store"
    runs = []
    for index, data in enumerate((tiny_dev_tsv, other)):
        cfg = {
            "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
            "data": {"path": str(data)},
            "sweep": {"experiments": ["baseline", "single_head", "importance"]},
            "importance": {"data": {"path": str(train)}},
            "significance": {"alpha": 0.5},
        }
        # the runs in this process: the command under test is compare
        runs.append(sweep_in_process(cfg, tmp_path, f"c{index}", store, ray_address))
    proc = run_cli("compare", *runs, "--store", str(store), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr  # one model's weights (fingerprints equal): no two-models warning
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    by_quantity = {r["quantity"]: r for r in lines if "quantity" in r}
    [overlap] = [r for r in lines if "jaccard" in r]

    reader = ResultStore(str(store))
    evals = reader.read("evaluations").to_pylist()
    delta = {run: {(e["layer"], e["head"]): e["delta"] for e in evals
                   if e["run_id"] == run and e["experiment"] == "single_head"} for run in runs}
    heads = sorted(delta[runs[0]])
    a = [delta[runs[0]][h] for h in heads]
    b = [delta[runs[1]][h] for h in heads]
    row = by_quantity["single_head_delta"]
    assert row["n_heads"] == 8
    # other: float64 statistics recomputed with scipy (approx's default rel 1e-6; the tool may sum in another order)
    assert row["spearman"] == pytest.approx(stats.spearmanr(a, b).statistic)
    assert row["pearson"] == pytest.approx(stats.pearsonr(a, b).statistic)
    # Same model, same importance data: the importances agree perfectly.
    # other: a float64 correlation of identical vectors is 1 up to rounding
    assert by_quantity["gradient_importance"]["spearman"] == pytest.approx(1.0)

    sig = reader.read("significance").to_pylist()
    flagged = {run: {s["eval_id"] for s in sig if s["run_id"] == run and s["test"] == "paired_ttest"
                     and s["significant"]} for run in runs}
    assert overlap["significant_a"] == len(flagged[runs[0]])
    assert overlap["significant_b"] == len(flagged[runs[1]])
    assert overlap["significant_both"] == len(flagged[runs[0]] & flagged[runs[1]])


def test_compare_refuses_unknown_runs(tmp_path):
    (tmp_path / "empty").mkdir()  # a store with no runs (where nothing is, compare says "no store at")
    proc = run_cli("compare", "nope-a", "nope-b", "--store", str(tmp_path / "empty"))
    assert proc.returncode == 2 and "no run 'nope-a'" in proc.stderr
