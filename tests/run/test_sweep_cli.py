"""A real sweep through the real CLI, read back with DuckDB and pyarrow."""

from __future__ import annotations

import json

import duckdb
import pyarrow.dataset as ds
import pytest
import yaml
from conftest import run_cli


def write_config(path, model_dir, data_file, significance=None, **sweep):
    cfg = {
        "name": "test-sweep",
        "model": {"kind": "hf_classifier", "path": str(model_dir)},
        "data": {"path": str(data_file)},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16, "flush_every": 3, **sweep},
        "significance": significance or {},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """One sweep for every test here (each run costs a driver and its workers' start): 8 single heads, 8
    all-but-one masks and one custom mask on two workers, three tests each, and the baseline (not asked for: always
    evaluated); returns (store, run id)."""
    tmp = tmp_path_factory.mktemp("cli")
    tests = ["paired_ttest", "mcnemar_exact", "paired_bootstrap"]
    config = write_config(tmp / "sweep.yaml", tiny_bert_dir, tiny_dev_tsv,
                          significance={"tests": tests, "n_resamples": 200, "seed": 5, "correction": "holm"},
                          experiments=["single_head", "all_but_one"], masks=[["self:0:1", "self:1:2"]])
    store = tmp / "store"
    proc = run_cli("run", str(config), "sweep.workers=2", "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    return store, run_id


N_EVALS = 18  # baseline + 8 single heads + 8 all-but-one + 1 custom mask of the tiny 2x4 BERT


def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


def test_single_head_rows_with_duckdb(grid_run):
    store, run_id = grid_run
    con = duckdb.connect()
    rows = con.sql(f"SELECT layer, head, score, baseline_score, delta, heads_masked, n_masked, n_examples "
                   f"FROM {duck(store, 'evaluations')} WHERE experiment = 'single_head' AND run_id = '{run_id}' "
                   "ORDER BY layer, head").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(layer, head) for layer in range(2) for head in range(4)]
    for layer, head, score, base, delta, masked, n_masked, n in rows:
        # other: the same float64 subtraction, written and read back; abs 1e-12 on scores <= 1
        assert delta == pytest.approx(score - base, abs=1e-12)
        assert masked == [f"self:{layer}:{head}"] and n_masked == 1 and n == 40
    (base_score,) = con.sql(f"SELECT score FROM {duck(store, 'evaluations')} WHERE experiment='baseline'").fetchall()[0]
    assert base_score == rows[0][3]


def test_examples_sum_to_score_with_pyarrow(grid_run):
    store, run_id = grid_run
    part = ds.partitioning(flavor="hive")
    evals = ds.dataset(store / "evaluations", partitioning=part).to_table().to_pylist()
    examples = ds.dataset(store / "examples", partitioning=part).to_table().to_pylist()
    assert len(evals) == N_EVALS and {e["run_id"] for e in evals} == {run_id}
    by_eval: dict[str, list] = {}
    for row in examples:
        by_eval.setdefault(row["eval_id"], []).append(row)
    assert set(by_eval) == {e["eval_id"] for e in evals}
    for e in evals:
        rows = by_eval[e["eval_id"]]
        assert len(rows) == 40 and len({r["example_id"] for r in rows}) == 40
        # other: a float64 mean of 0/1 stats, summed here in another order; abs 1e-12 on a score <= 1
        assert sum(r["stats"][0] for r in rows) / len(rows) == pytest.approx(e["score"], abs=1e-12)
        assert all(r["output"] in ("0", "1") and r["reference"] in ("0", "1") for r in rows)
        assert all(r["loss"] >= 0 for r in rows)


def test_runs_row_and_query_command(grid_run):
    store, run_id = grid_run
    proc = run_cli("query", "SELECT run_id, status, n_planned, n_done, config FROM runs", "--store", str(store),
                   "--format", "json")
    assert proc.returncode == 0, proc.stderr
    [row] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert row["run_id"] == run_id and row["status"] == "complete"
    assert row["n_planned"] == row["n_done"] == N_EVALS
    assert json.loads(row["config"])["sweep"]["workers"] == 2
    csv_out = run_cli("query", "SELECT count(*) AS n FROM examples", "--store", str(store), "--format", "csv")
    assert csv_out.stdout.split() == ["n", str(N_EVALS * 40)]


def test_all_but_one_and_custom_masks(grid_run):
    store, _ = grid_run
    con = duckdb.connect()
    rows = con.sql(f"SELECT experiment, layer, head, n_masked, heads_masked FROM {duck(store, 'evaluations')}"
                   " ORDER BY experiment, layer, head").fetchall()
    abo = [r for r in rows if r[0] == "all_but_one"]
    assert len(abo) == 8 and all(r[3] == 3 for r in abo)
    for _, layer, head, _, masked in abo:
        assert f"self:{layer}:{head}" not in masked and all(m.startswith(f"self:{layer}:") for m in masked)
    [custom] = [r for r in rows if r[0] == "custom"]
    assert custom[4] == ["self:0:1", "self:1:2"]
    assert sum(1 for r in rows if r[0] == "baseline") == 1  # not asked for, evaluated once


def test_significance_rows_against_scipy(grid_run):
    """Stored p-values against scipy on the stored per-example statistics (an independent route)."""
    import numpy as np
    from scipy import stats

    store, run_id = grid_run
    con = duckdb.connect()
    sig = con.sql(f"SELECT eval_id, test, statistic, p_value, p_adjusted, correction, significant, alpha, "
                  f"n_resamples, seed FROM {duck(store, 'significance')}").fetchall()
    assert {r[1] for r in sig} == {"paired_ttest", "mcnemar_exact", "paired_bootstrap"}
    # every mask but the baseline has its three tests; the single heads are this test's family
    assert len(sig) == 3 * (N_EVALS - 1) and not [r for r in sig if r[0] == "baseline"]
    sig = [r for r in sig if r[0].startswith("single_head/")]
    assert len(sig) == 3 * 8
    rows = con.sql(f"SELECT eval_id, example_id, stats[1] FROM {duck(store, 'examples')} "
                   "ORDER BY eval_id, example_id").fetchall()
    correct: dict[str, list[float]] = {}
    for eval_id, _, c in rows:
        correct.setdefault(eval_id, []).append(c)
    base = np.array(correct["baseline"])
    ttest = {r[0]: r for r in sig if r[1] == "paired_ttest"}
    assert sum(not np.array_equal(np.array(correct[k]), base) for k in ttest) >= 2
    for eval_id, r in ttest.items():
        system = np.array(correct[eval_id])
        if np.array_equal(system, base):
            assert r[3] == 1.0  # scipy says NaN for zero-variance differences; we say "no evidence"
        else:
            expected = stats.ttest_rel(system, base)
            # other: float64 t-test recomputed with scipy (approx's default rel 1e-6)
            assert r[2] == pytest.approx(expected.statistic) and r[3] == pytest.approx(expected.pvalue)
    # Holm over the family of single-head t-tests, computed here by hand.
    p = np.array([ttest[k][3] for k in sorted(ttest)])
    order = np.argsort(p)
    holm = np.minimum(1, np.maximum.accumulate(p[order] * (len(p) - np.arange(len(p)))))
    expected_adj = np.empty_like(holm)
    expected_adj[order] = holm
    for k, adj in zip(sorted(ttest), expected_adj, strict=True):
        # other: float64 Holm adjustment recomputed by hand (approx's default rel 1e-6)
        assert ttest[k][4] == pytest.approx(adj) and ttest[k][5] == "holm"
        assert ttest[k][6] == (adj < 0.01) and ttest[k][7] == 0.01
    boot = [r for r in sig if r[1] == "paired_bootstrap"]
    assert all(r[8] == 200 and r[9] == 5 for r in boot)


def test_deltas_view_shows_significance(grid_run):
    store, run_id = grid_run
    proc = run_cli("query", "SELECT eval_id, delta, test, p_adjusted, significant FROM deltas "
                   "WHERE experiment='single_head'", "--store", str(store), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 8 and {r["test"] for r in rows} == {"paired_ttest"}
    assert all(r["p_adjusted"] is not None for r in rows)
