"""Importance and pruning levels through the real CLI on a tiny classifier."""

from __future__ import annotations

import math

import pytest
import yaml
from conftest import run_cli

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv


@pytest.fixture(scope="module")
def prune_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    tmp = tmp_path_factory.mktemp("prune")
    train = write_tsv(generate(60, seed=11), tmp / "train.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "importance", "prune_level"], "batch_size": 16},
        "importance": {"data": {"path": str(train)}, "normalize": True},
        "prune": {"min_heads_per_layer": 1},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp / "store"
    proc = run_cli("run", str(tmp / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return ResultStore(str(store)), proc.stdout.strip()


def test_importance_table(prune_run):
    store, run_id = prune_run
    rows = store.read("importance", run_id).to_pylist()
    assert len(rows) == 8 and {r["method"] for r in rows} == {"gradient"}
    assert sorted(r["rank"] for r in rows) == list(range(1, 9))
    for layer in (0, 1):
        norm = math.sqrt(sum(r["score_normalized"] ** 2 for r in rows if r["layer"] == layer))
        # other: a unit-length float64 vector read back from the store, norm recomputed here
        assert norm == pytest.approx(1.0)
    best = min(rows, key=lambda r: r["rank"])
    assert best["score_normalized"] == max(r["score_normalized"] for r in rows)


def test_prune_levels(prune_run):
    store, run_id = prune_run
    evals = store.read("evaluations", run_id).to_pylist()
    base = next(e for e in evals if e["experiment"] == "baseline")
    levels = sorted((e for e in evals if e["experiment"] == "prune_level"), key=lambda e: e["level"])
    assert [e["level"] for e in levels] == [round(0.1 * i, 1) for i in range(11)]
    assert levels[0]["n_masked"] == 0 and levels[0]["score"] == base["score"]  # exactly
    imp = {f"self:{r['layer']}:{r['head']}": r["score_normalized"]
           for r in store.read("importance", run_id).to_pylist()}
    previous: set[str] = set()
    for e in levels:
        masked = set(e["heads_masked"])
        assert previous <= masked and e["n_masked"] == len(masked)
        assert len(masked) == min(math.ceil(e["level"] * 8 - 1e-9), 6)  # one head kept per layer
        kept = set(imp) - masked
        for layer in (0, 1):  # within each layer, the least important heads go first
            lay_masked = [imp[h] for h in masked if h.startswith(f"self:{layer}:")]
            lay_kept = [imp[h] for h in kept if h.startswith(f"self:{layer}:")]
            assert not lay_masked or max(lay_masked) <= min(lay_kept)
        previous = masked
    sig = store.read("significance", run_id).to_pylist()
    assert {s["eval_id"] for s in sig} == {e["eval_id"] for e in levels}


def test_importance_refuses_the_evaluation_set(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["prune_level"]},
        "importance": {"data": {"path": str(tiny_dev_tsv)}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "s"))
    assert proc.returncode == 2 and "importance.data is the evaluation set" in proc.stderr
    test_split = write_tsv(generate(5, seed=1), tmp_path / "test.tsv")
    override = f"importance.data.path={test_split}"
    proc = run_cli("run", str(tmp_path / "c.yaml"), override, "--store", str(tmp_path / "s"))
    assert proc.returncode == 2 and "looks like a test split" in proc.stderr
