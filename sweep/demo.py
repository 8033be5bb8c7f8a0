"""``headsweep demo``: the embedded default, end to end, offline.

Trains a small model on generated data (cached after the first run), sweeps its heads on a
local Ray instance, writes the results store and prints what a user would look at first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from results.query import format_table, run_query
from results.store import ResultStore
from sweep.config import build_config
from sweep.driver import Sweep

DEMO_VERSION = "v1"


def cache_dir() -> Path:
    root = os.environ.get("HEADSWEEP_CACHE") or Path.home() / ".cache" / "headsweep"
    return Path(root) / f"demo-{DEMO_VERSION}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def classifier_artefacts() -> tuple[Path, Path]:
    """The demo classifier and its evaluation file, trained and written on first use."""
    from workers.synthetic_sentiment import generate, train_classifier, write_tsv

    root = cache_dir() / "sentiment"
    model_dir = root / "bert-3x4-synthetic-sentiment"
    dev = root / "dev.tsv"
    if not (model_dir / "config.json").is_file():
        log(f"training the demo classifier (once; cached in {model_dir}) ...")
        tmp = root / f".model-{os.getpid()}"
        train_classifier(tmp, layers=3, heads=4, hidden=48, n_train=4000, epochs=6, log=log)
        tmp.rename(model_dir)
    if not dev.is_file():
        write_tsv(generate(1000, seed=2024), dev)
    return model_dir, dev


def classifier_config(model_dir: Path, dev: Path, workers: int) -> dict:
    return {
        "name": "demo-sentiment",
        "model": {"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {"path": str(dev), "name": "synthetic-sentiment-dev"},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one"], "workers": workers, "batch_size": 100},
    }


def summarise(store: ResultStore, run_id: str) -> None:
    """Print the baseline, the heads whose removal hurts most, and the best kept head per layer."""
    base = run_query(
        store, f"SELECT model, dataset, metric, baseline_score, n_done FROM runs WHERE run_id = '{run_id}'"
    )
    print(format_table(base))
    print("\nheads whose removal hurts most (single_head, most negative delta first; p from the paired test,")
    print("adjusted over all heads of the experiment, * = significant at the adjusted level):")
    print(
        format_table(
            run_query(
                store,
                f"""SELECT attention || ':' || layer || ':' || head AS head, score, delta, test, p_value,
                           p_adjusted, correction, CASE WHEN significant THEN '*' ELSE '' END AS sig
                    FROM deltas WHERE run_id = '{run_id}' AND experiment = 'single_head'
                    ORDER BY delta, attention, layer, head LIMIT 5""",
            )
        )
    )
    print("\nall-but-one: best head to keep alone in each layer:")
    print(
        format_table(
            run_query(
                store,
                f"""SELECT attention, layer, arg_max(head, score) AS best_head, max(score) AS score,
                           max(score) - any_value(baseline_score) AS delta
                    FROM evaluations WHERE run_id = '{run_id}' AND experiment = 'all_but_one'
                    GROUP BY attention, layer ORDER BY attention, layer""",
            )
        )
    )


def run_demo(store_uri: str, workers: int = 2, show_progress: bool = True) -> int:
    """Run the demo sweeps into ``store_uri`` and print their summaries."""
    start = time.perf_counter()
    store = ResultStore(store_uri)
    store.check_writable()
    model_dir, dev = classifier_artefacts()
    cfg = build_config(classifier_config(model_dir, dev, workers))
    log(f"sweeping the heads of the demo classifier on {workers} worker(s) ...")
    run_id = Sweep(cfg, store, show_progress=show_progress).execute()
    print(f"\n== classifier run {run_id} ==")
    summarise(store, run_id)
    print(f"\nresults store: {store.uri}  (try: headsweep query \"SELECT * FROM runs\" --store {store_uri})")
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0
