"""Dispatch benchmark: how fast the driver hands out and records evaluations, and whether its memory stays flat.

The workers hold a trivial task (a plugin ``model.kind``) whose evaluation costs nothing, so what
is measured is headsweep's own machinery end to end: planning, Ray calls with a window in flight per
worker, ``ray.wait`` streaming, chunked Parquet writes (examples, then evaluations) and the run row.
Significance is off (it tests statistics, not dispatch; bench/significance.py measures it).

Each grid size runs in a fresh driver process so its peak RSS is its own::

    python bench/dispatch.py                       # 1,000 and 20,000 evaluations, 2 workers
    python bench/dispatch.py --sizes 1000 --examples 100

Final line: ``RESULT dispatch units_per_s=<x> peak_rss_mb_1k=<a> peak_rss_mb_20k=<b>``: the rate is the largest
grid's evaluations recorded per second between its first and last ``finished_at`` (Ray start-up and worker
load excluded; the whole-run time is printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from headsweep.workers.family import DatasetInfo, MaskOutput, RuntimeOptions, TaskKind  # noqa: E402
from headsweep.workers.heads import Head, HeadInventory, LayerShape  # noqa: E402
from headsweep.workers.metrics import ACCURACY  # noqa: E402

HEADS_PER_LAYER = 100


@dataclass
class TrivialModel:
    """``model`` section of the trivial kind: a made-up model with ``heads`` heads in layers of 100."""

    kind: str = "dispatch:TRIVIAL"
    heads: int = 1000


@dataclass
class TrivialData:
    """``data`` section: how many examples each evaluation reports (rows in ``examples``)."""

    examples: int = 100


class TrivialTask:
    """A task adapter whose evaluation is free: every example correct, constant loss."""

    metric = ACCURACY

    def __init__(self, model: TrivialModel, data: TrivialData, runtime: RuntimeOptions):
        sizes = [min(HEADS_PER_LAYER, model.heads - start) for start in range(0, model.heads, HEADS_PER_LAYER)]
        self.inventory = HeadInventory([LayerShape("self", i, n) for i, n in enumerate(sizes)])
        self.ids = [f"ex{i}" for i in range(data.examples)]
        self.stats = np.ones((data.examples, 1))
        self.loss = np.zeros(data.examples)
        self.outputs = ["1"] * data.examples

    def describe(self) -> DatasetInfo:
        return DatasetInfo("trivial", "trivial", "accuracy", ["correct"], self.ids, self.outputs, self.inventory)

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        return [MaskOutput(self.stats, self.loss, self.outputs, 1.0, 0.0) for _ in masks]


TRIVIAL = TaskKind("dispatch:TRIVIAL", TrivialModel, TrivialData, "dispatch:TrivialTask")


def child(n_units: int, examples: int, workers: int, store: str) -> dict:
    """One sweep of ``n_units`` single-head evaluations in this process; its timing and peak RSS."""
    from headsweep.results.store import ResultStore
    from headsweep.sweep.config import build_config
    from headsweep.sweep.driver import Sweep

    cfg = build_config({
        "model": {"kind": "dispatch:TRIVIAL", "heads": n_units - 1},
        "data": {"examples": examples},
        "sweep": {"experiments": ["baseline", "single_head"], "workers": workers, "num_cpus_per_worker": 0.5,
                  "masks_per_batch": 16, "flush_every": 256},
        "significance": {"enabled": False},
    })
    sweep = Sweep(cfg, ResultStore(store), show_progress=False)
    start = time.perf_counter()
    run_id = sweep.execute()
    seconds = time.perf_counter() - start
    finished = ResultStore(store).read("evaluations", run_id, columns=["finished_at"]).column("finished_at")
    finished = sorted(finished.to_pylist())
    stream_seconds = (finished[-1] - finished[0]).total_seconds()
    return {"planned": n_units, "stored": len(finished), "seconds": seconds, "stream_seconds": stream_seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 20000])
    parser.add_argument("--examples", type=int, default=100, help="examples per evaluation (default 100)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.examples, args.workers, args.store)))
        return

    # Workers import this module by the plugin name `dispatch:TRIVIAL`.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), str(REPO)]), "RAY_DEDUP_LOGS": "1"}
    results = {}
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(n), "--examples", str(args.examples),
                 "--workers", str(args.workers), "--store", f"{tmp}/store"],
                env=env, capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                sys.exit(f"dispatch child for {n} evaluations failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[n] = r
        print(f"{n:>6} planned, {r['stored']:>6} stored; whole run {r['seconds']:.1f} s (Ray start, worker load, "
              f"writes); first to last evaluation recorded {r['stream_seconds']:.1f} s = "
              f"{(r['stored'] - 1) / r['stream_seconds']:.0f} evaluations/s; driver peak RSS {r['peak_rss_mb']:.0f} MB",
              flush=True)
    small, large = min(results), max(results)
    rate = (results[large]["stored"] - 1) / results[large]["stream_seconds"]
    print(f"RESULT dispatch units_per_s={rate:.0f} peak_rss_mb_1k={results[small]['peak_rss_mb']:.0f} "
          f"peak_rss_mb_20k={results[large]['peak_rss_mb']:.0f}")


if __name__ == "__main__":
    main()
