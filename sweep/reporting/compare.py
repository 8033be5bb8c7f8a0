"""Cross-domain consistency (Michel et al. sec. 5): do two runs of one model find the same heads?

Two runs of the same model on different evaluation sets (e.g. in-domain and out-of-domain test
sets) are compared head by head: Spearman and Pearson correlations of their single-head deltas
(each in its metric's direction: as harm, so that an accuracy run and a perplexity run of one model
correlate positively when the same heads matter) and of their importance scores, and the overlap
of the heads each finds significant. Two runs of one model and data that differ only in ``sweep.ablation`` (zero and
mean ablation, say) compare the same way: how far the methods agree on which heads matter (the rank correlation of
the deltas), and the significant heads one method finds and the other does not (``heads_gained``: significant in
run b only; ``heads_lost``: in run a only).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
from scipy import stats

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep import experiments  # noqa: F401 - registers the kinds' tables and views read here
from headsweep.sweep.models.weights import stored_fingerprints
from headsweep.workers.ablation.registry import DEFAULT_METHOD
from headsweep.workers.core.metrics import higher_is_better

# Per head of one run (the run id is a query parameter, never pasted into the SQL).
DELTAS_SQL = """SELECT attention, layer, head, delta FROM evaluations
                WHERE run_id = ? AND experiment = 'single_head'"""
IMPORTANCE_SQL = """SELECT attention, layer, head, score FROM importance
                    WHERE run_id = ? AND method = 'gradient'"""
SIGNIFICANT_SQL = """SELECT attention, layer, head, 1 AS s FROM deltas
                     WHERE run_id = ? AND experiment = 'single_head' AND significant"""


def _run(store: ResultStore, run_id: str) -> dict:
    run = store.run(run_id)
    if run is None:
        raise HeadsweepError(f"no run {run_id!r} in store {store.uri}")
    return run


def _by_head(table: pa.Table, value: str) -> dict[tuple, float]:
    return {(r["attention"], r["layer"], r["head"]): r[value] for r in table.to_pylist()}


def _correlations(name: str, a: dict, b: dict) -> dict:
    heads = sorted(set(a) & set(b))
    x = np.array([a[h] for h in heads], dtype=float)
    y = np.array([b[h] for h in heads], dtype=float)
    row = {"quantity": name, "n_heads": len(heads), "spearman": None, "spearman_p": None,
           "pearson": None, "pearson_p": None}
    if len(heads) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
        s, p = stats.spearmanr(x, y)
        r, q = stats.pearsonr(x, y)
        row.update(spearman=float(s), spearman_p=float(p), pearson=float(r), pearson_p=float(q))
    return row


def _names(heads: set[tuple]) -> str:
    return ", ".join(f"{a}:{layer}:{h}" for a, layer, h in sorted(heads))


def other_model(ra: dict, rb: dict) -> str | None:
    """Why two run rows are of two models (other weights by their fingerprints; without fingerprints, other model
    names), or None."""
    a, b = stored_fingerprints(ra["facts"]), stored_fingerprints(rb["facts"])
    if a and b:
        if [w["sha256"] for w in a] != [w["sha256"] for w in b]:
            return (f"weights sha256 {', '.join(w['sha256'][:12] for w in a)}... and "
                    f"{', '.join(w['sha256'][:12] for w in b)}...")
        return None
    if ra["model"] != rb["model"]:
        return f"models {ra['model']} and {rb['model']}"
    return None


def compare_runs(store: ResultStore, run_a: str, run_b: str) -> tuple[pa.Table, pa.Table]:
    """Correlations of deltas and importances, and the overlap of significant heads."""
    if run_a == run_b:
        raise HeadsweepError(f"compare needs two different runs; {run_a} was given twice (a run agrees with itself)")
    ra, rb = _run(store, run_a), _run(store, run_b)
    if json.loads(ra["heads"]) != json.loads(rb["heads"]):
        raise HeadsweepError(f"runs {run_a} and {run_b} are not of the same model (their heads differ)")
    other = other_model(ra, rb)
    if other:
        logging.getLogger("headsweep").warning(
            "runs %s and %s are of two models with the same heads (%s): compare is meant for two runs of one model; "
            "the numbers below compare two models' heads", run_a, run_b, other)
    deltas, importance, significant = {}, {}, {}
    for run_id, run in ((run_a, ra), (run_b, rb)):
        # As harm (positive: the head was needed), so that runs of metrics of opposite directions (accuracy
        # and perplexity) correlate the right way round; for two runs of one metric this changes nothing.
        sign = -1.0 if higher_is_better(run["metric"]) else 1.0
        deltas[run_id] = {h: sign * d for h, d in _by_head(run_query(store, DELTAS_SQL, [run_id]), "delta").items()}
        importance[run_id] = _by_head(run_query(store, IMPORTANCE_SQL, [run_id]), "score")
        significant[run_id] = set(_by_head(run_query(store, SIGNIFICANT_SQL, [run_id]), "s"))
    if not deltas[run_a] and not importance[run_a]:
        raise HeadsweepError(f"run {run_a} has neither single_head evaluations nor gradient importance to compare")
    rows = []
    if deltas[run_a] and deltas[run_b]:
        rows.append(_correlations("single_head_delta", deltas[run_a], deltas[run_b]))
    if importance[run_a] and importance[run_b]:
        rows.append(_correlations("gradient_importance", importance[run_a], importance[run_b]))
    sa, sb = significant[run_a], significant[run_b]
    union = sa | sb
    overlap = {
        "ablation_a": [ra.get("ablation") or DEFAULT_METHOD], "ablation_b": [rb.get("ablation") or DEFAULT_METHOD],
        "significant_a": [len(sa)], "significant_b": [len(sb)], "significant_both": [len(sa & sb)],
        "jaccard": [len(sa & sb) / len(union) if union else None],
        "heads_both": [_names(sa & sb)], "heads_gained": [_names(sb - sa)], "heads_lost": [_names(sa - sb)],
    }
    return pa.Table.from_pylist(rows), pa.table(overlap)
