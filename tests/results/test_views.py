"""The query views (heads, layers, pruning, summary) on a store built by a small real sweep,
checked against the raw tables read back with pyarrow; `headsweep runs` and `query` formats."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import run_cli
from small_store import ALPHA, LEVELS, small_store

from headsweep.results.query import run_query
from headsweep.results.store import ResultStore


@pytest.fixture(scope="module")
def small(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    store, run_id, checkpoints = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return ResultStore(str(store)), run_id, checkpoints


def key(r: dict) -> tuple:
    return r["checkpoint"], r["attention"], r["layer"], r["head"]


def raw(store: ResultStore, run_id: str, experiment: str) -> dict[tuple, dict]:
    """Evaluations of one experiment by (checkpoint, attention, layer, head), joined in Python with
    their paired t-test row: the independent route the views are checked against."""
    tests = {s["eval_id"]: s for s in store.read("significance", run_id).to_pylist() if s["test"] == "paired_ttest"}
    rows = [e for e in store.read("evaluations", run_id).to_pylist() if e["experiment"] == experiment]
    return {key(e): {**e, "sig": tests.get(e["eval_id"])} for e in rows}


def test_heads_view_one_row_per_head_and_checkpoint(small):
    store, run_id, checkpoints = small
    heads = run_query(store, f"SELECT * FROM heads WHERE run_id = '{run_id}'").to_pylist()
    assert len(heads) == 2 * 8
    assert len({key(h) for h in heads}) == len(heads)  # no duplicate heads across checkpoints
    assert {h["checkpoint"] for h in heads} == set(checkpoints)
    single, alone = raw(store, run_id, "single_head"), raw(store, run_id, "all_but_one")
    importance = {key(r): r for r in store.read("importance", run_id).to_pylist()}
    baselines = {e["checkpoint"]: e["score"] for e in store.read("evaluations", run_id).to_pylist()
                 if e["experiment"] == "baseline"}
    for h in heads:
        s, a, m = single[key(h)], alone[key(h)], importance[key(h)]
        assert h["name"] == f"self:{h['layer']}:{h['head']}" and h["metric"] == "accuracy"
        assert h["baseline_score"] == baselines[h["checkpoint"]]
        assert (h["score"], h["delta"]) == (s["score"], s["delta"])
        assert (h["p_value"], h["p_adjusted"], h["significant"]) == (
            s["sig"]["p_value"], s["sig"]["p_adjusted"], s["sig"]["significant"])
        assert h["test"] == "paired_ttest" and h["alpha"] == ALPHA
        assert (h["all_but_one_score"], h["all_but_one_delta"]) == (a["score"], a["delta"])
        assert (h["importance"], h["importance_normalized"], h["importance_rank"]) == (
            m["score"], m["score_normalized"], m["rank"])
    # Each checkpoint ranks its own 8 heads.
    for ckpt in checkpoints:
        assert sorted(h["importance_rank"] for h in heads if h["checkpoint"] == ckpt) == list(range(1, 9))
    assert any(h["significant"] for h in heads)  # high alpha: the marks below are not vacuous


def test_layers_view_best_kept_head(small):
    store, run_id, checkpoints = small
    layers = run_query(store, f"SELECT * FROM layers WHERE run_id = '{run_id}'").to_pylist()
    assert len(layers) == 2 * 2 and len({(r["checkpoint"], r["layer"]) for r in layers}) == 4
    alone = raw(store, run_id, "all_but_one")
    for r in layers:
        mine = [e for k, e in alone.items() if k[0] == r["checkpoint"] and k[2] == r["layer"]]
        best = max(mine, key=lambda e: (e["score"], -e["head"]))
        assert r["n_heads"] == 4 and r["best_head"] == best["head"] and r["score"] == best["score"]
        # exact for the stored delta; other for the float64 subtraction redone here (abs 1e-12 on scores <= 1)
        assert r["delta"] == best["delta"] == pytest.approx(best["score"] - r["baseline_score"], abs=1e-12)
        assert r["p_adjusted"] == best["sig"]["p_adjusted"]
        assert r["worst_delta"] == min(e["delta"] for e in mine)
        assert r["best_name"] == f"self:{r['layer']}:{best['head']}"


def test_pruning_view_levels_and_relative_scores(small):
    store, run_id, checkpoints = small
    rows = run_query(store, f"SELECT * FROM pruning WHERE run_id = '{run_id}' ORDER BY checkpoint, level").to_pylist()
    assert len(rows) == 2 * len(LEVELS)
    evals = [e for e in store.read("evaluations", run_id).to_pylist() if e["experiment"] == "prune_level"]
    by_eval = {(e["checkpoint"], e["level"]): e for e in evals}
    tests = {s["eval_id"]: s for s in store.read("significance", run_id).to_pylist() if s["test"] == "paired_ttest"}
    for ckpt in checkpoints:
        mine = [r for r in rows if r["checkpoint"] == ckpt]
        assert [r["level"] for r in mine] == LEVELS and [r["n_masked"] for r in mine] == [0, 2, 4, 6, 8]
        for r in mine:
            e = by_eval[(ckpt, r["level"])]
            assert r["scope"] == "global" and r["attention"] is None
            assert r["score"] == e["score"] and r["heads_masked"] == e["heads_masked"]
            # other: the view's float64 division (DuckDB) against Python's; rel 1e-12
            assert r["relative_score"] == pytest.approx(e["score"] / e["baseline_score"], rel=1e-12)
            assert r["p_adjusted"] == tests[e["eval_id"]]["p_adjusted"]
        assert mine[0]["relative_score"] == 1.0


def test_runs_command_lists_the_run(small):
    store, run_id, _ = small
    proc = run_cli("runs", "--store", str(store.root), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    [row] = [json.loads(line) for line in proc.stdout.splitlines()]
    [run] = store.read("runs", run_id).to_pylist()
    heads = run_query(store, "SELECT * FROM heads").to_pylist()
    assert row["run_id"] == run_id and row["status"] == "complete" and row["name"] == "small-store"
    assert (row["model"], row["dataset"], row["metric"]) == (run["model"], run["dataset"], "accuracy")
    assert row["baseline_score"] == run["baseline_score"] and row["n_examples"] == 40
    assert row["n_done"] == row["n_planned"] == 2 * (1 + 8 + 8 + len(LEVELS))
    assert (row["n_checkpoints"], row["n_heads"]) == (2, 8)
    assert row["n_significant"] == len({h["name"] for h in heads if h["significant"]})
    table = run_cli("runs", "--store", str(store.root))
    assert table.returncode == 0 and run_id in table.stdout and "(1 rows)" in table.stdout


def test_query_formats_and_parquet_file(small, tmp_path):
    store, run_id, _ = small
    sql = "SELECT checkpoint, name, delta, significant FROM heads ORDER BY checkpoint, name"
    as_json = run_cli("query", sql, "--store", str(store.root), "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert len(rows) == 16
    out = tmp_path / "heads.parquet"
    proc = run_cli("query", sql, "--store", str(store.root), "--format", "parquet", "--out", str(out))
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert pq.read_table(out).to_pylist() == rows
    bad = run_cli("query", sql, "--store", str(store.root), "--format", "parquet")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "headsweep: error: --format parquet writes a file: give --out FILE"


def test_the_deltas_view_takes_each_metric_primary_test_from_one_mapping():
    import duckdb

    from headsweep.results.views import DELTAS, OTHER_METRICS_TEST, PRIMARY_TEST, primary_test_sql
    from headsweep.sweep.statistics.significance_runner import DEFAULT_TESTS

    assert primary_test_sql("e.metric") in DELTAS
    for metric, test in PRIMARY_TEST.items():
        assert test in DEFAULT_TESTS[metric]  # the test shown is one a run computes by default
    con = duckdb.connect()
    cases = {m: con.execute(f"SELECT {primary_test_sql('m')} FROM (SELECT ? AS m)", [m]).fetchall()[0][0]
             for m in ("accuracy", "bleu", "chrf")}
    assert cases == {"accuracy": "paired_ttest", "bleu": "paired_bootstrap", "chrf": OTHER_METRICS_TEST}
