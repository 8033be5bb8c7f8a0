"""The report's roles part: role codes, the role-share table on hand-built rows, and a real roles run (single
head, LRP importance, pruning levels, roles) reported through the CLI, its table checked against SQL on the
store."""

from __future__ import annotations

import math
import re

import duckdb
import pytest
from conftest import run_cli, sweep_in_process

from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.experiments.roles.report import pruned_first, role_code, role_shares, spearman


def test_role_codes():
    assert [role_code(r) for r in ("positional:-1", "positional:1", "rare_words", "syntactic:amod")] == \
        ["P-1", "P+1", "R", "S:amod"]


def row(layer, head, roles, significant):
    return {"attention": "self", "layer": layer, "head": head, "roles": roles, "significant": significant}


def test_role_shares_by_hand():
    rows = [row(0, 0, ["positional:-1"], True), row(0, 1, [], True), row(0, 2, ["rare_words"], False),
            row(1, 0, ["syntactic:amod", "positional:1"], True), row(1, 1, None, False)]
    table = {r["group"]: r for r in role_shares(rows, {("self", 0, 2), ("self", 1, 1)})}
    assert table["all heads"] == {"group": "all heads", "heads": 5, "with_role": 3, "share": 0.6, "positional": 2,
                                  "rare_words": 1, "syntactic": 1}
    assert (table["removal significant"]["heads"], table["removal significant"]["with_role"]) == (3, 2)
    assert (table["pruned first"]["heads"], table["pruned first"]["with_role"]) == (2, 1)


def test_pruned_first_is_the_first_level_that_masks():
    levels = [{"level": 0.5, "heads_masked": ["self:0:1", "self:1:0"]}, {"level": 0.0, "heads_masked": []},
              {"level": 0.25, "heads_masked": ["self:1:0"]}]
    assert pruned_first(levels) == {("self", 1, 0)}


def test_spearman_skips_missing_pairs_and_needs_three():
    rho, _p, n = spearman([1.0, 2.0, None, 4.0, 3.0], [10.0, 20.0, 5.0, 40.0, float("nan")])
    assert (rho, n) == (pytest.approx(1.0), 3)  # three complete pairs, perfectly monotone
    rho, _p, n = spearman([1.0, 2.0], [1.0, 2.0])
    assert n == 2 and math.isnan(rho)  # two pairs are too few


def test_report_of_a_roles_run(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    train = write_tsv(generate(40, seed=11), tmp_path / "train.tsv")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(text for text, _ in generate(300, seed=11)) + "\n")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "single_head", "importance", "prune_level", "roles"],
                  "batch_size": 16},
        "importance": {"method": "lrp", "data": {"path": str(train)}},
        "prune": {"levels": [0.0, 0.25, 0.5]},
        "significance": {"n_resamples": 100, "seed": 3},
        "roles": {"frequencies": str(corpus), "rare_top": 5, "rare_min_sentences": 1},
    }
    store = tmp_path / "store"
    run_id = sweep_in_process(cfg, tmp_path, "c", store, ray_address)  # in this process: the report is under test
    out = tmp_path / "report"
    proc = run_cli("report", run_id, "--store", str(store), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    page = (out / "index.html").read_text()
    assert "What the heads do" in page and (out / f"{run_id}-roles.png").stat().st_size > 0
    assert (out / f"{run_id}-roles-scatter.png").stat().st_size > 0 and "Spearman rho" in page
    # The table's base-rate row against SQL on the stored head_roles rows.
    con = duckdb.connect()
    source = (f"read_parquet('{store}/head_roles/*/*.parquet', hive_partitioning=true, "
              "hive_types={'run_id': VARCHAR}, union_by_name=true)")
    n, with_role = con.sql(f"SELECT count(*), count(*) FILTER (WHERE len(roles) > 0) FROM {source} "
                           f"WHERE run_id = '{run_id}'").fetchall()[0]
    cells = re.search(r"<td class=\"text\">all heads</td><td>(\d+)</td><td>(\d+)</td>", page)
    assert cells is not None and (int(cells.group(1)), int(cells.group(2))) == (n, with_role)
    assert n == 8
