"""Importance, pruning levels and the efficiency of one level through the real CLI on a tiny classifier: one
pruning run (importance, every level, the efficiency of level 0.5) whose tables the tests read back with DuckDB,
and an export of the timed level that matches it."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config, load_config
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.pruning.export import export_pruned
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_classifier.pruning import load_pruned
from headsweep.workers.families.hf_shared.sites import find_sites

HEAD_PARAMS = 8 * (3 * 33 + 32)  # tiny BERT: hidden 32, head size 8; W_Q, W_K, W_V rows with biases, W_O columns


@pytest.fixture(scope="module")
def prune_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """One run for every test below that reads a pruning store (one CLI run instead of one per test module): the
    importance table, the 11 levels with their significance, and the efficiency experiment timing level 0.5."""
    tmp = tmp_path_factory.mktemp("prune")
    train = write_tsv(generate(60, seed=11), tmp / "train.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "importance", "prune_level", "efficiency"], "batch_size": 16},
        "importance": {"data": {"path": str(train)}, "normalize": True},
        "prune": {"min_heads_per_layer": 1},
        "efficiency": {"level": 0.5, "batch_sizes": [1, 2], "warmup": 1, "repeats": 2},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp / "store"
    proc = run_cli("run", str(tmp / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return tmp / "c.yaml", ResultStore(str(store)), proc.stdout.strip()


def test_importance_table(prune_run):
    _, store, run_id = prune_run
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
    _, store, run_id = prune_run
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


# -- the efficiency of level 0.5, timed by the same run ----------------------------------------------------
def test_efficiency_rows(prune_run):
    _, store, run_id = prune_run
    rows = run_query(store, f"SELECT * FROM efficiency WHERE run_id = '{run_id}' "
                            "ORDER BY batch_size, variant").to_pylist()
    level = run_query(store, f"SELECT eval_id, heads_masked FROM evaluations WHERE run_id = '{run_id}' "
                             "AND experiment = 'prune_level' AND level = 0.5").to_pylist()[0]
    assert [(r["batch_size"], r["variant"]) for r in rows] == [(1, "full"), (1, "pruned"), (2, "full"), (2, "pruned")]
    for r in rows:
        assert r["mask_source"] == level["eval_id"] and r["source_run"] == run_id and r["level"] == 0.5
        assert set(r["heads_masked"]) == set(level["heads_masked"]) and r["n_masked"] == 4
        assert r["heads_removed"] == 0.5
        assert r["repeats"] == 2 and r["warmup"] == 1 and r["examples"] == r["batch_size"]
        assert 0 < r["seconds_min"] <= r["seconds_median"] <= r["seconds_max"]
        assert r["examples_per_s"] > 0 and r["tokens_per_s"] >= r["examples_per_s"]
        assert r["examples_per_s_iqr"] >= 0 and r["peak_memory_mb"] > 0
        assert r["device"].startswith("cpu") and r["finished_at"] is not None
    full, pruned = rows[0], rows[1]
    assert full["n_heads"] == 8 and pruned["n_heads"] == 4
    assert full["n_params"] - pruned["n_params"] == 4 * HEAD_PARAMS
    assert full["speedup"] == 1.0
    # exact: the same float64 division of the same medians, stored as float64
    assert pruned["speedup"] == full["seconds_median"] / pruned["seconds_median"]


def test_export_of_the_timed_level(prune_run, tmp_path, tiny_bert_dir, tiny_dev_tsv):
    config, store, run_id = prune_run
    out = export_pruned(load_config(config), tmp_path / "pruned", store, from_run=run_id, level=0.5)
    pruned = load_pruned(out)
    row = run_query(store, f"SELECT n_params, heads_masked FROM efficiency WHERE run_id = '{run_id}' "
                           "AND variant = 'pruned' LIMIT 1").to_pylist()[0]
    assert sum(p.numel() for p in pruned.parameters()) == row["n_params"]

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    full = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    inputs = tokenizer(["not a good film", "the plot was dull but the cast was fine"], padding=True,
                       return_tensors="pt")
    gates = HeadGates(find_sites(full))
    with torch.no_grad(), gates.masked([Head.parse(h) for h in row["heads_masked"]]):
        gated = full(**inputs).logits
    with torch.no_grad():
        # summation order: the exported model's narrower projections; 2 layers plus the pooler and classifier
        assert_routes_agree(pruned(**inputs).logits, gated, depth=2 + 1, width=64)


@pytest.mark.parametrize("section, message", [
    ({}, "needs exactly one of efficiency.mask"),
    ({"mask": ["self:0:1"], "level": 0.5}, "got mask, level"),
    ({"level": 0.5}, "efficiency.level needs prune_level in sweep.experiments"),
    ({"mask": ["self:0:1"], "from_run": "r"}, "not with a mask"),
    ({"mask": ["selff:0:1"]}, "bad head name 'selff:0:1'"),
    ({"eval_id": "baseline", "batch_sizes": [0]}, "each value of efficiency.batch_sizes must be at least 1, got 0"),
    ({"eval_id": "baseline", "repeats": 0}, "efficiency.repeats must be at least 1, got 0"),
])
def test_efficiency_config_errors(section, message):
    cfg = {"model": {"kind": "hf_classifier", "path": "m"}, "sweep": {"experiments": ["baseline", "efficiency"]},
           "efficiency": section}
    with pytest.raises(HeadsweepError, match=message):
        build_config(cfg)


def test_efficiency_head_out_of_range_fails_before_anything_is_written(tmp_path, ray_address, tiny_bert_dir,
                                                                       tiny_dev_tsv):
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline", "single_head", "efficiency"]},
           "efficiency": {"mask": ["self:0:1", "self:5:0"]}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address)
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert "self:5:0" in line
    assert not (store / "runs").exists() and not (store / "evaluations").exists()
