"""``headsweep demo``: the embedded default, end to end, offline.

Trains a small model on generated data (cached after the first run), sweeps its heads on a
local Ray instance, writes the results store, prints what a user would look at first and writes
the report of the runs (``headsweep.sweep.reporting.report``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from headsweep.results.outputs import check_output
from headsweep.results.query import format_table, run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.cluster.dispatch import log
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.output import console
from headsweep.sweep.output.progress import Progress
from headsweep.sweep.reporting.report import write_report
from headsweep.sweep.run.driver import Sweep

DEMO_VERSION = "v1"


def cache_dir() -> Path:
    root = os.environ.get("HEADSWEEP_CACHE") or Path.home() / ".cache" / "headsweep"
    return Path(root) / f"demo-{DEMO_VERSION}"


EXPERIMENTS = ["baseline", "single_head", "all_but_one", "importance", "prune_level"]


def epoch_progress(title: str, epochs: int, show: bool) -> tuple[Progress, Callable[[str], None]]:
    """A progress line over a trainer's epochs, and the ``log`` callback to give the trainer: its
    ``...epoch N...: losses`` messages advance the line, its other messages are status lines."""
    what = f"training the demo {title}"
    progress = Progress(epochs, label=what, every=0.0, enabled=show, phase=what, unit="epoch")

    def report(message: str) -> None:
        head, sep, rest = message.strip().partition(": ")
        if sep and "epoch" in head:
            progress.update(1, rest)
        else:
            log(message)

    return progress, report


def classifier_config(workers: int, show_progress: bool = True) -> dict:
    """The demo classifier (trained on first use) and its evaluation and importance data."""
    from headsweep.sweep.demo.sentiment import generate, train_classifier, write_tsv

    root = cache_dir() / "sentiment"
    model_dir = root / "bert-3x4-synthetic-sentiment"
    if not (model_dir / "config.json").is_file():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
        log(f"training the demo classifier (once; cached in {model_dir}) ...")
        tmp = root / f".model-{os.getpid()}"
        progress, report = epoch_progress("classifier", 6, show_progress)
        with progress:
            train_classifier(tmp, layers=3, heads=4, hidden=48, n_train=4000, epochs=6, log=report)
        tmp.rename(model_dir)
    dev, valid = root / "dev.tsv", root / "valid.tsv"
    if not dev.is_file():
        write_tsv(generate(1000, seed=2024), dev)
    if not valid.is_file():
        write_tsv(generate(500, seed=2025), valid)
    return {
        "name": "demo-sentiment",
        "model": {"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {"path": str(dev), "name": "synthetic-sentiment-dev"},
        "sweep": {"experiments": EXPERIMENTS, "workers": workers, "batch_size": 100},
        "importance": {"data": {"path": str(valid), "name": "synthetic-sentiment-valid"}},
    }


def translation_config(workers: int, show_progress: bool = True) -> dict:
    """The demo translation model (a tiny fairseq Transformer trained on first use)."""
    from headsweep.sweep.demo.translation import train_synthetic
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    root = cache_dir() / "translation"
    done = root / "READY"
    if not done.is_file():
        log(f"training the demo fairseq translation model (once; cached in {root}) ...")
        logging.getLogger("fairseq").setLevel(logging.WARNING)
        # A fixed number of epochs (about 20 s on 2 idle cores), so that the cached model does not
        # depend on how busy the machine was; the time cap only guards against a very slow one.
        progress, report = epoch_progress("translation model", 10, show_progress)
        with progress:
            train_synthetic(root, TrainSettings(max_epochs=10, max_seconds=150.0), log=report)
        done.write_text("ok\n")
    data_bin = root / "data-bin"
    return {
        "name": "demo-translation",
        "model": {"kind": "fairseq_translation", "checkpoint": str(root / "checkpoints" / "checkpoint_last.pt"),
                  "data_bin": str(data_bin), "name": "transformer-2+2x4-synthetic"},
        "data": {"source": str(root / "test.src"), "target": str(root / "test.tgt"), "name": "synthetic-test"},
        "sweep": {"experiments": EXPERIMENTS, "workers": workers, "batch_size": 50},
        "importance": {"data": {"data_bin": str(data_bin), "split": "valid", "name": "synthetic-valid"}},
    }


def language_model_config(workers: int, show_progress: bool = True) -> dict:
    """The demo decoder-only LM (Llama-style, 8 query / 2 key-value heads per layer, trained on first use),
    scored by perplexity on held-out generated text."""
    from headsweep.sweep.demo.language_model import generate, train_language_model

    root = cache_dir() / "language_model"
    model_dir = root / "llama-3x8q2kv-synthetic"
    if not (model_dir / "config.json").is_file():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        log(f"training the demo language model (once; cached in {model_dir}) ...")
        tmp = root / f".model-{os.getpid()}"
        progress, report = epoch_progress("language model", 6, show_progress)
        with progress:
            train_language_model(tmp, epochs=6, log=report)
        tmp.rename(model_dir)
    test, valid = root / "test.txt", root / "valid.txt"
    for path, seed in ((test, 2024), (valid, 2025)):
        if not path.is_file():
            path.write_text(generate(600, seed=seed), encoding="utf-8")
    return {
        "name": "demo-language-model",
        "model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {"path": str(test), "name": "synthetic-text-test", "window": 64},
        "sweep": {"experiments": EXPERIMENTS, "workers": workers, "batch_size": 32},
        "importance": {"data": {"path": str(valid), "name": "synthetic-text-valid", "window": 64}},
    }


DEMOS = (("classifier", classifier_config), ("translation", translation_config),
         ("language model", language_model_config))


def summarise(store: ResultStore, run_id: str) -> None:
    """Print the baseline, the heads whose removal hurts most, and the best kept head per layer."""
    base = run_query(
        store, "SELECT model, dataset, metric, baseline_score, n_done FROM runs WHERE run_id = ?", [run_id]
    )
    console.out(format_table(base))
    console.out("\nheads whose removal hurts most (single_head, most harmful delta first in the metric's direction; "
                "p from the paired test,")
    console.out("adjusted over all heads of the experiment, * = significant at the adjusted level):")
    console.out(
        format_table(
            run_query(
                store,
                """SELECT name AS head, score, delta, test, p_value, p_adjusted, correction,
                          CASE WHEN significant THEN '*' ELSE '' END AS sig
                   FROM heads WHERE run_id = ? AND delta IS NOT NULL
                   ORDER BY harm DESC, attention, layer, head LIMIT 5""",
                [run_id],
            )
        )
    )
    console.out("\nall-but-one: best head to keep alone in each layer:")
    console.out(
        format_table(
            run_query(
                store,
                """SELECT attention, layer, best_head, score, delta FROM layers WHERE run_id = ?
                   ORDER BY attention, layer""",
                [run_id],
            )
        )
    )
    console.out("\npruning curve (least important heads first, by gradient importance on held-out data):")
    console.out(
        format_table(
            run_query(
                store,
                """SELECT level, n_masked, score, relative_score AS relative, p_adjusted,
                          CASE WHEN significant THEN '*' ELSE '' END AS sig
                   FROM pruning WHERE run_id = ? ORDER BY scope, level""",
                [run_id],
            )
        )
    )


def report_dir(store_uri: str) -> Path:
    """Where the demo writes its report: ``headsweep-report`` beside a local store, else here."""
    if "://" in store_uri:
        return Path("headsweep-report")
    return Path(store_uri).expanduser().resolve().parent / "headsweep-report"


def run_demo(store_uri: str, workers: int = 2, show_progress: bool = True, report: str | None = None) -> int:
    """Run the demo sweeps into ``store_uri``, print their summaries and write their report."""
    start = time.perf_counter()
    store = ResultStore(store_uri)
    store.check_writable()
    report = report or report_dir(store_uri)
    check_output(report, "folder", store=store, option="--report", can_force=False)  # before the sweeps, not after
    run_ids = []
    for title, make in DEMOS:
        cfg = build_config(make(workers, show_progress))
        log(f"sweeping the heads of the demo {title} on {workers} worker(s) ...")
        run_id = Sweep(cfg, store, show_progress=show_progress).execute()
        run_ids.append(run_id)
        console.out(f"\n== {title} run {run_id} ==")
        summarise(store, run_id)
    console.out(f"\nresults store: {store.uri}  (try: headsweep runs --store {store_uri}, or "
          f"headsweep query \"SELECT * FROM heads\" --store {store_uri})")
    written = time.perf_counter()
    page = write_report(store, run_ids, report, option="--report")
    console.out(f"report of the runs ({time.perf_counter() - written:.1f} s): {page}")
    console.out(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0
