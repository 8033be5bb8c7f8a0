"""A synthetic results store for the report's scale benchmark and the browser tests: written through
``ResultStore.write`` with the store's own schemas, no sweep.

Runs of a classifier-like accuracy model (``layers`` x ``heads`` heads of attention type ``self``) on ``examples``
examples, one complete run per ablation method (same model, data and heads, so the report's method switch pairs
them): baseline, every head ablated alone, pruning levels, each evaluation's per-example rows, significance, gradient
importance and the run's inputs. The harm is heavy-tailed (most heads flip almost no example, a few flip many) and
the importance mostly agrees with it. This module imports nothing of ``bench``: the tests load it by its path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

LEVELS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def _rows_table(table: str, columns: dict) -> pa.Table:
    from headsweep.results.schema import TABLES
    from headsweep.sweep import experiments  # noqa: F401 - registers the kinds' tables (importance)

    schema = TABLES[table]
    n = len(next(iter(columns.values())))
    arrays = [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays([pa.array(a, f.type) if not isinstance(a, pa.Array) else a
                                 for a, f in zip(arrays, schema, strict=True)], schema=schema)


def build_store(root: Path, layers: int, heads: int, examples: int, methods: tuple[str, ...] = ("zero", "mean"),
                seed: int = 0, levels: list[float] | None = None) -> list[str]:
    """A synthetic store at ``root``: one complete accuracy run per ablation method in ``methods`` (same model, data
    and heads), each with baseline, single-head and pruning evaluations and their per-example rows, significance,
    gradient importance and inputs. Returns the run ids (the first is the zero-ablation run)."""
    from headsweep.results.store import ResultStore

    store = ResultStore(str(root))
    levels_at = LEVELS if levels is None else levels
    rng = np.random.default_rng(seed)
    names = [f"self:{layer}:{h}" for layer in range(layers) for h in range(heads)]
    n_heads = len(names)
    example_ids = np.array([f"{i:05d}" for i in range(examples)])
    labels = rng.integers(0, 2, examples)
    base_correct = (rng.random(examples) < 0.9).astype(np.float64)
    # heavy-tailed harm: most heads flip almost nothing, a few flip many examples
    flips = np.minimum(examples // 2, (rng.pareto(1.5, n_heads) * examples * 0.004).astype(int)
                       + (rng.random(n_heads) < 0.5))  # half the heads flip at least one example
    importance = flips + rng.random(n_heads) * examples * 0.01  # a cheap estimate that mostly agrees
    now = datetime.now(UTC)
    run_ids = []
    for m, method in enumerate(methods):
        run_id = f"20261126-000000-synth{m}"
        run_ids.append(run_id)
        scale = 1.0 if method == "zero" else 0.6  # mean ablation harms less
        correct = np.empty((n_heads, examples))
        for i in range(n_heads):
            row = base_correct.copy()
            k = int(flips[i] * scale)
            if k:
                row[rng.choice(examples, k, replace=False)] = 0.0
            correct[i] = row
        score = correct.mean(1)
        base = float(base_correct.mean())
        levels = [(lv, int(np.ceil(lv * n_heads))) for lv in levels_at]
        order = np.argsort(importance, kind="stable")
        eval_ids = ["baseline", *(f"single_head/{n}" for n in names),
                    *(f"prune_level/global/{lv:g}" for lv, _ in levels)]
        prune_scores = [max(0.0, base - 0.9 * k / n_heads) for _, k in levels]
        evals = _rows_table("evaluations", {
            "eval_id": eval_ids,
            "experiment": ["baseline", *["single_head"] * n_heads, *["prune_level"] * len(levels)],
            "attention": [None, *["self"] * n_heads, *[None] * len(levels)],
            "layer": [None, *(i // heads for i in range(n_heads)), *[None] * len(levels)],
            "head": [None, *(i % heads for i in range(n_heads)), *[None] * len(levels)],
            "heads_masked": [[], *([n] for n in names), *([names[j] for j in order[:k]] for _, k in levels)],
            "n_masked": [0, *[1] * n_heads, *(k for _, k in levels)],
            "level": [None, *[None] * n_heads, *(lv for lv, _ in levels)],
            "metric": ["accuracy"] * len(eval_ids),
            "score": [base, *score.tolist(), *prune_scores],
            "baseline_score": [base] * len(eval_ids),
            "delta": [0.0, *(score - base).tolist(), *(s - base for s in prune_scores)],
            "n_examples": [examples] * len(eval_ids),
            "ablation": [method] * len(eval_ids),
        })
        store.write("evaluations", run_id, evals, "chunk-synthetic")
        # per-example rows of the baseline and every single head (the drill-downs' source)
        n_rows = (n_heads + 1) * examples
        stats = np.concatenate([base_correct, correct.ravel()])
        stats_col = pa.ListArray.from_arrays(pa.array(np.arange(0, n_rows + 1, dtype=np.int32)), pa.array(stats))
        outputs = np.where(np.concatenate([base_correct, correct.ravel()]) > 0, np.tile(labels, n_heads + 1),
                           1 - np.tile(labels, n_heads + 1)).astype(str)
        rows = _rows_table("examples", {
            "eval_id": pa.array(np.repeat(np.array(eval_ids[: n_heads + 1]), examples)),
            "example_id": pa.array(np.tile(example_ids, n_heads + 1)),
            "stats": stats_col,
            "output": pa.array(outputs),
            "reference": pa.array(np.tile(labels.astype(str), n_heads + 1)),
        })
        store.write("examples", run_id, rows, "chunk-synthetic")
        delta = np.r_[score - base, np.array(prune_scores) - base]
        se = np.sqrt(np.maximum(base * (1 - base), 1e-6) / examples) * 2
        p = np.clip(np.exp(-np.abs(delta) / se * 2), 1e-12, 1.0)
        sig = _rows_table("significance", {
            "eval_id": eval_ids[1:], "test": ["paired_ttest"] * len(delta), "statistic": delta / se,
            "p_value": p, "p_adjusted": np.minimum(1.0, p * len(p)), "correction": ["holm"] * len(p),
            "alpha": [0.05] * len(p), "ci_low": delta - 1.96 * se / 2, "ci_high": delta + 1.96 * se / 2,
            "significant": (np.minimum(1.0, p * len(p)) < 0.05).tolist(), "n_resamples": [0] * len(p),
            "seed": [0] * len(p),
        })
        store.write("significance", run_id, sig, "chunk-synthetic")
        ranks = np.empty(n_heads, dtype=np.int32)
        ranks[np.argsort(-importance, kind="stable")] = np.arange(1, n_heads + 1)
        store.write("importance", run_id, _rows_table("importance", {
            "method": ["gradient"] * n_heads, "attention": ["self"] * n_heads,
            "layer": [i // heads for i in range(n_heads)], "head": [i % heads for i in range(n_heads)],
            "score": importance, "score_normalized": [None] * n_heads, "rank": ranks,
        }), "importance")
        store.write("inputs", run_id, _rows_table("inputs", {
            "example_id": example_ids, "position": np.arange(examples),
            "input": [f"synthetic sentence {i}: " + " ".join(f"w{j}" for j in rng.integers(0, 500, 12))
                      for i in range(examples)],
        }), "inputs")
        # a config that loads (what --attention reads) naming a model folder that does not exist
        config = {"name": f"synthetic-{method}", "model": {"kind": "hf_classifier", "path": "/nonexistent/synthetic"},
                  "data": {"path": "/nonexistent/synthetic/dev.tsv"},
                  "sweep": {"ablation": method, "experiments": ["baseline", "single_head"]},
                  "significance": {"correction": "holm", "alpha": 0.05}}
        store.write("runs", run_id, _rows_table("runs", {
            "created_at": [now], "updated_at": [now], "status": ["complete"], "name": [f"synthetic-{method}"],
            "config": [json.dumps(config)], "config_hash": ["synthetic"], "model": ["synthetic-32x32"],
            "dataset": ["synthetic-2000"], "metric": ["accuracy"], "n_examples": [examples],
            "n_planned": [len(eval_ids)], "n_done": [len(eval_ids)], "baseline_score": [base],
            "heads": [json.dumps([{"attention": "self", "layer": layer, "num_heads": heads}
                                  for layer in range(layers)])],
            "facts": ["{}"], "code_version": ["synthetic"], "schema_version": [10], "ablation": [method],
        }), "run")
    return run_ids
