"""The efficiency experiment through the real CLI: a pruning run that times its own level 0.5,
the efficiency table read back with DuckDB, and an export of that level that matches it."""

from __future__ import annotations

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
def efficiency_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    tmp = tmp_path_factory.mktemp("efficiency")
    train = write_tsv(generate(40, seed=11), tmp / "train.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "importance", "prune_level", "efficiency"], "batch_size": 16},
        "importance": {"data": {"path": str(train)}},
        "prune": {"levels": [0.5]},
        "significance": {"enabled": False},
        "efficiency": {"level": 0.5, "batch_sizes": [1, 2], "warmup": 1, "repeats": 2},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp / "store"
    proc = run_cli("run", str(tmp / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return tmp / "c.yaml", ResultStore(str(store)), proc.stdout.strip()


def test_efficiency_rows(efficiency_run):
    _, store, run_id = efficiency_run
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


def test_export_of_the_timed_level(efficiency_run, tmp_path, tiny_bert_dir, tiny_dev_tsv):
    config, store, run_id = efficiency_run
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
