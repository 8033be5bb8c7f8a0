"""Results identity: every table's schema and every view's columns, pinned as computed before the experiment kinds
declared their own tables and views, so that assembling them from the registry provably changed none;
updated by schema version 9 (runs and evaluations gain ``ablation``, the table ``ablation_values``, the views
``deltas``, ``heads`` and ``pruning`` an ``ablation`` column, ``deltas`` also ``logit_diff_normalized``) and by schema
version 10 (the table ``inputs``; ``head_roles`` and the ``roles`` view gain ``sink_share``) and by schema version 11
(the table ``serving``)."""

from __future__ import annotations

import hashlib

from headsweep.results.query import run_query
from headsweep.results.schema import RENAMED, TABLES
from headsweep.results.store import ResultStore
from headsweep.results.views import VIEWS

# sha256 of str(schema) [:16], by the code before the restructuring.
TABLE_SCHEMAS = {
    "runs": "b8ef53ec2b3cdf1a", "evaluations": "45338b486cccee33", "examples": "a59303de5a81b426",
    "significance": "3639d29009b5cfa0", "ablation_values": "e6882a44bcf7be9e", "importance": "ad03cd3d6f7f4798",
    "efficiency": "a28670936fa39255",
    "gates": "bd53d1a21b7670ae", "head_roles": "18d76c1e5cb8e148", "interactions": "6a48948cf46cf463",
    "inputs": "969ef41913c7dbd5",  # schema version 10: each run's inputs, once per run
    "serving": "0698c6f689941633",  # schema version 11: stock exports as served
}
SYNTAX = [f"{rel}_{col}" for rel in ("nsubj", "obj", "amod", "advmod")
          for col in ("dep2gov", "dep2gov_baseline", "gov2dep", "gov2dep_baseline", "instances")]
TEST = ["test", "p_value", "p_adjusted", "correction", "alpha", "significant"]
VIEW_COLUMNS = {
    "deltas": ["run_id", "eval_id", "experiment", "attention", "layer", "head", "level", "checkpoint", "n_masked",
               "heads_masked", "metric", "score", "baseline_score", "delta", *TEST, "ci_low", "ci_high", "harm",
               "screen", "ablation", "logit_diff_normalized"],
    "heads": ["run_id", "checkpoint", "attention", "layer", "head", "name", "metric", "baseline_score", "score",
              "delta", *TEST, "harm", "screen", "all_but_one_score", "all_but_one_delta", "importance_method",
              "importance", "importance_normalized", "importance_rank", "ablation"],
    "layers": ["run_id", "checkpoint", "attention", "layer", "n_heads", "best_head", "best_name", "metric", "score",
               "baseline_score", "delta", *TEST, "worst_delta"],
    "pruning": ["run_id", "checkpoint", "scope", "attention", "level", "n_masked", "heads_masked", "metric", "score",
                "baseline_score", "delta", "relative_score", *TEST, "ablation", "method", "l0_lambda"],
    "summary": ["run_id", "name", "status", "created_at", "model", "dataset", "metric", "baseline_score",
                "n_examples", "n_planned", "n_done", "n_checkpoints", "n_heads", "n_significant",
                "significant_so_far", "eta_s", "updated_at"],
    "roles": ["run_id", "checkpoint", "attention", "layer", "head", "name", "confidence", "entropy", "top_offset",
              "top_offset_share", "rare_share", "rare_sentences", "rare_chance", "n_tokens", "roles", *SYNTAX,
              "sink_share", "metric", "baseline_score", "score", "delta", *TEST, "harm", "importance_method",
              "importance", "importance_normalized", "importance_rank"],
}


def test_every_table_has_its_columns_and_types():
    found = {name: hashlib.sha256(str(schema).encode()).hexdigest()[:16] for name, schema in TABLES.items()}
    assert found == TABLE_SCHEMAS
    assert RENAMED == {"gates": {"l0_lambda": "lambda"}}


def test_every_view_has_its_columns(tmp_path):
    store = ResultStore(str(tmp_path / "store"))
    assert list(VIEWS) == list(VIEW_COLUMNS)
    for view, columns in VIEW_COLUMNS.items():
        assert run_query(store, f"SELECT * FROM {view} LIMIT 0").column_names == columns, view
