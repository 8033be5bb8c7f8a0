"""Dispatch benchmark: how fast the driver hands out and records evaluations, and whether its memory stays flat.

The workers hold a trivial task (a plugin ``model.kind``, ``dispatch_trivial``) whose evaluation costs nothing, so what
is measured is headsweep's own machinery end to end: planning, Ray calls with a window in flight per
worker, ``ray.wait`` streaming, chunked Parquet writes (examples, then evaluations) and the run row.
Significance is off (it tests statistics, not dispatch; bench/significance.py measures it).

Each grid size runs in a fresh driver process so its peak RSS is its own::

    python -m bench.dispatch                       # both cases: throughput, then balance
    python -m bench.dispatch --case throughput --sizes 1000 --examples 100
    python -m bench.dispatch --case balance --sleep 0.2
    python -m bench.dispatch --smoke               # both cases on tiny sizes (seconds; figures mean nothing)

Final line: ``RESULT dispatch units_per_s=<x> peak_rss_mb_1k=<a> peak_rss_mb_20k=<b>``: the rate is the largest
grid's evaluations recorded per second between its first and last ``finished_at`` (Ray start-up and worker
load excluded; the whole-run time is printed too).

Balance case (``--case balance``): the workers hold a task whose evaluation sleeps a known time per
mask (``dispatch_sleep``), so the figure is about scheduling, not compute. For 2 and 4 workers and
12 and 100 evaluations it runs the same evaluations twice: ``pool`` streams them straight through
``WorkerPool.stream`` (the dispatch rule alone), ``sweep`` runs a whole sweep (baseline and single-head
masks, as users run it: every phase of the driver counts). Utilisation is

    sum over workers of busy time / (workers x wall)

where a worker's busy time is the time it spent inside ``evaluate`` (timed on the worker, logged per
call) and wall runs from the first evaluation call's start to the last result the driver received
(``pool``: when ``stream`` yielded it; ``sweep``: the largest ``finished_at`` stored). 1.0 means no
worker was ever idle. Final line: ``RESULT dispatch_balance utilisation_min=<x> pool_min=<p> sweep_min=<s>``
(``utilisation_min`` is the smallest over every case; the goal is >= 0.85).
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

from bench import common
from headsweep.plugins import FAMILIES_GROUP
from headsweep.workers.core.family import DatasetInfo, MaskOutput, ModelFamily, RuntimeOptions
from headsweep.workers.core.heads import Head, HeadInventory, LayerShape
from headsweep.workers.core.metrics import ACCURACY

REPO = Path(__file__).resolve().parent.parent
HEADS_PER_LAYER = 100


@dataclass
class TrivialModel:
    """``model`` section of the trivial kind: a made-up model with ``heads`` heads in layers of 100."""

    kind: str = "dispatch_trivial"
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


TRIVIAL = ModelFamily("dispatch_trivial", TrivialModel, TrivialData, "bench.dispatch:TrivialTask")


@dataclass
class SleepData:
    """``data`` section of the sleeping kind: seconds per mask, and where each worker logs its calls."""

    examples: int = 10
    seconds: float = 0.2
    log: str = ""  # folder: one JSON-lines file per worker process, a line per evaluate call


class SleepTask(TrivialTask):
    """The trivial task, but each evaluation takes ``seconds`` per mask (a sleep, so no CPU is used).

    Each call logs its start and end (wall clock, seconds since the epoch) and mask count, so busy
    time is measured on the worker side.
    """

    def __init__(self, model: TrivialModel, data: SleepData, runtime: RuntimeOptions):
        super().__init__(model, TrivialData(data.examples), runtime)
        self.seconds = data.seconds
        self.log = Path(data.log) / f"{os.getpid()}.jsonl" if data.log else None

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        start = time.time()
        time.sleep(self.seconds * len(masks))
        end = time.time()
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps({"pid": os.getpid(), "start": start, "end": end, "masks": len(masks)}) + "\n")
        per_mask = (end - start) / max(1, len(masks))
        return [MaskOutput(self.stats, self.loss, self.outputs, 1.0, per_mask) for _ in masks]


SLEEP = ModelFamily("dispatch_sleep", TrivialModel, SleepData, "bench.dispatch:SleepTask")


def child(n_units: int, examples: int, workers: int, store: str) -> dict:
    """One sweep of ``n_units`` single-head evaluations in this process; its timing and peak RSS."""
    from headsweep.results.store import ResultStore
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.run.driver import Sweep

    cfg = build_config({
        "model": {"kind": "dispatch_trivial", "heads": n_units - 1},
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


def worker_calls(log_dir: Path) -> list[dict]:
    """Every ``evaluate`` call the sleeping workers logged: pid, start, end (epoch seconds), masks."""
    return [json.loads(line) for f in sorted(log_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]


def utilisation(calls: list[dict], workers: int, first: float, last: float) -> dict:
    """Busy seconds per worker (time inside ``evaluate``), wall from ``first`` to ``last``, and their ratio."""
    busy: dict[int, float] = {}
    for c in calls:
        busy[c["pid"]] = busy.get(c["pid"], 0.0) + c["end"] - c["start"]
    wall = last - first
    return {"busy": sorted(busy.values(), reverse=True), "wall": wall,
            "utilisation": sum(busy.values()) / (workers * wall)}


def pool_case(workers: int, n: int, sleep: float, log_dir: Path) -> dict:
    """``n`` units straight through ``WorkerPool.stream``: the dispatch rule alone."""
    import ray

    from headsweep.sweep.cluster.dispatch import WorkerPool, units_per_call
    from headsweep.workers.actor.eval_worker import EvalWorker
    from headsweep.workers.core.work import WorkUnit

    model, data = TrivialModel(kind="dispatch_sleep", heads=n), SleepData(seconds=sleep, log=str(log_dir))
    names = [f"worker-{i}" for i in range(workers)]
    actors = [EvalWorker.options(num_cpus=0.25).remote(name, model.kind, model, data, RuntimeOptions(threads=1))
              for name in names]
    ray.get([a.load.remote() for a in actors])
    pool = WorkerPool(actors, ray.get([a.where.remote() for a in actors]))
    heads = [Head("self", k // HEADS_PER_LAYER, k % HEADS_PER_LAYER) for k in range(n)]
    units = [WorkUnit(f"single_head/{h}", "single_head", (h,), h.attention, h.layer, h.head) for h in heads]
    first = time.time()  # the stream's first call goes out on the first next()
    for _ in pool.stream(units, units_per_call(0)):
        last = time.time()
    per_worker = [pool.done_by_worker[i] for i in range(workers)]
    pool.stop()
    return {"per_worker": per_worker, **utilisation(worker_calls(log_dir), workers, first, last)}


def sweep_case(workers: int, n: int, sleep: float, log_dir: Path, store: str) -> dict:
    """A whole sweep of ``n`` evaluations (the baseline and ``n - 1`` single heads), as users run it."""
    from collections import Counter

    from headsweep.results.store import ResultStore
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.run.driver import Sweep

    cfg = build_config({
        "model": {"kind": "dispatch_sleep", "heads": n - 1},
        "data": {"seconds": sleep, "log": str(log_dir)},
        "sweep": {"experiments": ["baseline", "single_head"], "workers": workers, "num_cpus_per_worker": 0.25,
                  "threads_per_worker": 1},
        "significance": {"enabled": False},
    })
    run_id = Sweep(cfg, ResultStore(store), show_progress=False).execute()
    rows = ResultStore(store).read("evaluations", run_id, columns=["worker", "finished_at"]).to_pylist()
    counts = Counter(r["worker"].split("@")[0] for r in rows)
    calls = worker_calls(log_dir)
    last = max(r["finished_at"] for r in rows).timestamp()
    return {"per_worker": [counts[f"worker-{i}"] for i in range(workers)],
            **utilisation(calls, workers, min(c["start"] for c in calls), last)}


def balance_child(workers: list[int], sizes: list[int], sleep: float) -> list[dict]:
    """Every balance case in this process (one Ray instance): pool and sweep, per worker count and size."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
    cases = []
    for w in workers:
        for n in sizes:
            for mode in ("pool", "sweep"):
                with tempfile.TemporaryDirectory() as tmp:
                    log_dir = Path(tmp) / "calls"
                    log_dir.mkdir()
                    if mode == "pool":
                        r = pool_case(w, n, sleep, log_dir)
                    else:
                        r = sweep_case(w, n, sleep, log_dir, f"{tmp}/store")
                cases.append({"mode": mode, "workers": w, "evaluations": n, **r})
    return cases


def install_families(folder: Path) -> Path:
    """Declare the two kinds as ``headsweep.families`` entry points of a distribution in ``folder``, as pip installs
    a plugin (configs name a plugin by its entry point, never by a module path); returns ``folder``, to put on the
    children's ``PYTHONPATH``."""
    dist = folder / "headsweep_dispatch_bench-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: headsweep-dispatch-bench\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{FAMILIES_GROUP}]\n{TRIVIAL.name} = bench.dispatch:TRIVIAL\n"
                                           f"{SLEEP.name} = bench.dispatch:SLEEP\n")
    return folder


def run_child(args: list[str], env: dict, what: str) -> dict | list:
    """Run this module with ``args`` in a fresh process (cwd the repository); its last stdout line, as JSON."""
    proc = subprocess.run([sys.executable, "-m", "bench.dispatch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"dispatch child for {what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rate(r: dict) -> float:
    """Evaluations recorded per second between the first and the last (nan when all landed in one instant, as a
    tiny grid's may)."""
    return (r["stored"] - 1) / r["stream_seconds"] if r["stream_seconds"] > 0 else float("nan")


def throughput(args: argparse.Namespace, env: dict) -> None:
    results = {}
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            r = run_child(["--child", str(n), "--examples", str(args.examples), "--workers", str(args.workers),
                           "--store", f"{tmp}/store"], env, f"{n} evaluations")
        results[n] = r
        print(f"{n:>6} planned, {r['stored']:>6} stored; whole run {r['seconds']:.1f} s (Ray start, worker load, "
              f"writes); first to last evaluation recorded {r['stream_seconds']:.1f} s = "
              f"{rate(r):.0f} evaluations/s; driver peak RSS {r['peak_rss_mb']:.0f} MB",
              flush=True)
    small, large = min(results), max(results)
    common.result("dispatch", units_per_s=f"{rate(results[large]):.0f}",
                  peak_rss_mb_1k=f"{results[small]['peak_rss_mb']:.0f}",
                  peak_rss_mb_20k=f"{results[large]['peak_rss_mb']:.0f}")


def balance(args: argparse.Namespace, env: dict) -> None:
    cases = run_child(["--balance-child", "--balance-workers", *map(str, args.balance_workers),
                       "--balance-sizes", *map(str, args.balance_sizes), "--sleep", str(args.sleep)],
                      env, "the balance cases")
    print(f"balance: {args.sleep:g} s per mask; utilisation = busy / (workers x wall)")
    print(f"{'mode':<6}{'workers':>8}{'evals':>7}  {'evaluations per worker':<24}{'busy s per worker':<30}"
          f"{'wall s':>7}{'utilisation':>13}")
    for c in cases:
        print(f"{c['mode']:<6}{c['workers']:>8}{c['evaluations']:>7}  {' '.join(map(str, c['per_worker'])):<24}"
              f"{' '.join(f'{b:.2f}' for b in c['busy']):<30}{c['wall']:>7.2f}{c['utilisation']:>13.3f}")
    low = {m: min(c["utilisation"] for c in cases if c["mode"] == m) for m in ("pool", "sweep")}
    common.result("dispatch_balance", utilisation_min=f"{min(low.values()):.3f}", pool_min=f"{low['pool']:.3f}",
                  sweep_min=f"{low['sweep']:.3f}")


def main() -> None:
    """Both cases (or ``--case``), each grid size or balance set in a fresh child process; or, as that child, one."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["all", "throughput", "balance"], default="all")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 20000], help="throughput: evaluations")
    parser.add_argument("--examples", type=int, default=100, help="throughput: examples per evaluation")
    parser.add_argument("--workers", type=int, default=2, help="throughput: workers")
    parser.add_argument("--balance-workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--balance-sizes", type=int, nargs="+", default=[12, 100], help="balance: evaluations")
    parser.add_argument("--sleep", type=float, default=0.2, help="balance: seconds per mask (default 0.2)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--balance-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    common.add_argument(parser)
    args = parser.parse_args()
    if common.enable_smoke(args):
        # One small grid (its figures stand for both sizes) and one balance case: every child starts Ray.
        args.sizes, args.examples = [40], 10
        args.balance_workers, args.balance_sizes, args.sleep = [2], [6], 0.02
    if args.child:
        print(json.dumps(child(args.child, args.examples, args.workers, args.store)))
        return
    if args.balance_child:
        print(json.dumps(balance_child(args.balance_workers, args.balance_sizes, args.sleep)))
        return

    with tempfile.TemporaryDirectory(prefix="dispatch-plugins-") as plugins:
        # The children's drivers and Ray workers find the kinds by their entry points, and import this module.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([install_families(Path(plugins)).as_posix(), str(REPO)]),
               "RAY_DEDUP_LOGS": "1"}
        if args.case in ("all", "throughput"):
            throughput(args, env)
        if args.case in ("all", "balance"):
            balance(args, env)


if __name__ == "__main__":
    main()
