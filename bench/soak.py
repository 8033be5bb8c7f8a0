"""Soak benchmark: a long grid while workers are killed again and again, against the same grid left alone.

The demo classifier (``headsweep demo``'s 3-layer, 4-head BERT on generated sentiment sentences, trained on first
use and cached in ``$HEADSWEEP_CACHE/demo-v1``), evaluated on its 1,000 dev sentences under every subset of its
12 heads: 4,095 ``custom`` masks and the baseline (the empty mask), 4,096 evaluations, on 2 workers. Each run is
the real ``headsweep run`` CLI in a subprocess, as users run it, on a local Ray instance this process starts:

* faulted: from the first stored evaluation on, a worker is SIGKILLed every ``--every`` seconds (worker-0 and
  worker-1 in turn, at the pid the driver's own log names: ``workers ready: ...``, then ``restarted as ...``),
  until the grid is done; Ray restarts it (``sweep.worker_restarts`` allows it) and the pool re-runs the calls
  it had in flight. A kill waits until the last one's worker is back (its model loaded): one worker is down
  at a time, so the faults stay within what ``sweep.max_retries`` (2, the default) can absorb; killing
  faster than workers come back (10-20 s from a kill to a worker back with its model, on 2 busy cores) loses
  every worker in turn, and a batch re-run on each loss fails the run, as the bound means it to. The driver's
  resident memory (``VmRSS``) is sampled meanwhile.
* uninterrupted: the same config into another store.

Significance is off (it tests statistics, not dispatch; bench/significance.py measures it); torch runs on one
thread per worker in both runs, so that their numbers may be compared bit for bit.

Final line: ``RESULT soak masks=<n> kills=<n> lost=<n> duplicated=<n> equal=<true|false>
driver_rss_mib_start=<n> driver_rss_mib_end=<n>``: ``masks`` the evaluations the faulted run planned, ``kills``
the SIGKILLs that hit a live worker, ``lost`` the planned evaluations it did not store, ``duplicated`` the rows
it stored more than once, ``equal`` whether every stored number of the two runs is the same bit for bit (the
evaluations and per-example rows, less run id, worker and timings), and the driver's RSS once a tenth of the
grid was stored (on the demo the driver grows by ~55 MiB over its first four chunks of 64 and is flat after:
a warm-up, not growth with the grid; its RSS at the first stored chunk is printed apart) and at its last sample
before it exited. Goals: nothing lost or duplicated, equal, the end within 10% of the start.

    python -m bench.soak                  # 4,096 evaluations, a kill every 20 s (tens of minutes on 2 cores)
    python -m bench.soak --heads 8 --every 10
    python -m bench.soak --smoke          # a 6-head classifier trained in seconds, 64 evaluations, one kill
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml

from bench import common

REPO = Path(__file__).resolve().parent.parent
# What differs between two runs of one config by design.
NOT_COMPARED = {"run_id", "worker", "seconds", "finished_at"}
WORKER = re.compile(r"(worker-\d+)@[^:,\s]+:(\d+)")


def smoke_model() -> dict:
    """The smoke run's model and data: a 3-layer, 2-head classifier trained for seconds, 300 dev sentences."""
    from headsweep.sweep.demo.sentiment import generate, train_classifier, write_tsv

    root = common.smoke_cache() / "soak"
    model, dev = root / "classifier", root / "dev.tsv"
    if not (model / "config.json").is_file():
        train_classifier(model, layers=3, heads=2, hidden=16, n_train=200, epochs=1, log=lambda _m: None)
    if not dev.is_file():
        write_tsv(generate(300, seed=2024), dev)
    return {"model": {"kind": "hf_classifier", "path": str(model)}, "data": {"path": str(dev)},
            "sweep": {"batch_size": 100}}


def demo_model() -> dict:
    """The demo classifier and its dev sentences (trained once, on first use)."""
    from headsweep.sweep.demo import classifier_config

    cfg = classifier_config(2, show_progress=False)
    return {"model": cfg["model"], "data": cfg["data"], "sweep": {"batch_size": cfg["sweep"]["batch_size"]}}


def head_names(model_dir: str) -> list[str]:
    """Every head of the classifier at ``model_dir``, as ``self:layer:head``."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return [f"self:{layer}:{head}" for layer in range(config["num_hidden_layers"])
            for head in range(config["num_attention_heads"])]


def write_config(base: dict, heads: int | None, folder: Path, flush_every: int) -> Path:
    """The soak's config: every non-empty subset of the model's first ``heads`` heads (all without) as custom
    masks, beside the baseline, on 2 workers that Ray may restart as often as they are killed."""
    names = head_names(base["model"]["path"])[:heads]
    masks = [list(subset) for size in range(1, len(names) + 1) for subset in itertools.combinations(names, size)]
    cfg = {
        "name": "soak",
        "model": base["model"],
        "data": base["data"],
        "sweep": {**base["sweep"], "experiments": ["baseline"], "masks": masks, "workers": 2,
                  "threads_per_worker": 1, "worker_restarts": 10_000, "flush_every": flush_every},
        "significance": {"enabled": False},
    }
    path = folder / "soak.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


class Driver:
    """``headsweep run`` in a subprocess: its stderr read line by line, the pid of each worker's live process
    (from the driver's log), its resident memory sampled."""

    def __init__(self, config: Path, store: Path, address: str):
        self.store = store
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headsweep", "run", str(config), "--store", str(store), "--address", address,
             "--quiet"],
            cwd=config.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "RAY_AUTH_MODE": "disabled"},
        )
        self.lines: list[str] = []
        self.back: list[float] = []  # when each "restarted as" line came (time.time())
        self.pids: dict[str, int] = {}  # worker name -> pid of its live process; absent while Ray restarts it
        self.rss: list[float] = []
        self.lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if " restarted as " in line:
                self.back.append(time.time())
            if "workers ready:" in line or " restarted as " in line:
                found = WORKER.findall(line.split(" restarted as ")[-1])
                with self.lock:
                    self.pids.update((name, int(pid)) for name, pid in found)

    def _sample(self) -> None:
        while self.proc.poll() is None:
            mib = rss_mib(self.proc.pid)
            if mib:  # none before the interpreter has started, or once it is gone
                self.rss.append(mib)
            time.sleep(0.5)

    def both_up(self) -> bool:
        """Whether both workers' live processes are known: neither is being restarted."""
        with self.lock:
            return len(self.pids) == 2

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill_worker(self, name: str) -> bool:
        """SIGKILL ``name``'s live process; False when it is being restarted (no live pid known) or gone."""
        with self.lock:
            pid = self.pids.pop(name, None)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def stored_any(self) -> bool:
        """Whether the first chunk of evaluations has landed (a look at the folder: cheap enough to ask often)."""
        folder = self.store / "evaluations"
        return folder.is_dir() and any(folder.rglob("*.parquet"))

    def stored(self) -> int:
        """Evaluations in the store so far (chunks land whole: written under a temporary name, then renamed)."""
        from headsweep.results.store import ResultStore

        if not (self.store / "evaluations").is_dir():
            return 0
        return ResultStore(str(self.store)).read("evaluations", columns=["eval_id"]).num_rows

    def finish(self) -> int:
        self.proc.wait()
        for t in self._readers:
            t.join(timeout=10)
        return self.proc.returncode


def faulted_run(config: Path, store: Path, address: str, every: float, max_kills: int | None,
                warm_up: int) -> tuple[Driver, list[float], dict[str, float]]:
    """The grid while a worker is killed every ``every`` s from its first stored evaluation on (at most
    ``max_kills``), worker-0 and worker-1 in turn, and only while the other one is up: a tick that finds a worker
    still being restarted waits for it. Returns the driver, when each kill hit a live worker, and the driver's RSS
    when its first evaluations were stored (``first``) and once ``warm_up`` were (``start``)."""
    driver = Driver(config, store, address)
    kills: list[float] = []
    rss: dict[str, float] = {}
    next_kill, next_count = time.monotonic(), 0.0
    while driver.running() and (max_kills is None or len(kills) < max_kills or "start" not in rss):
        if "first" not in rss and driver.stored_any() and driver.rss:
            rss["first"] = driver.rss[-1]
        if "first" in rss and "start" not in rss and time.monotonic() >= next_count:
            next_count = time.monotonic() + 2.0
            if driver.stored() >= warm_up:
                rss["start"] = driver.rss[-1]
        if "first" in rss and time.monotonic() >= next_kill and driver.both_up() and (
                max_kills is None or len(kills) < max_kills):
            if driver.kill_worker(f"worker-{len(kills) % 2}"):
                kills.append(time.time())
                print(f"  kill {len(kills)} at {time.strftime('%H:%M:%S')}", flush=True)
            next_kill = time.monotonic() + every
        time.sleep(0.2)
    driver.finish()
    return driver, kills, rss


def table(store: Path, name: str, keys: list[str]) -> pa.Table:
    """A stored table without what differs between runs by design, sorted by ``keys``."""
    from headsweep.results.store import ResultStore

    t = ResultStore(str(store)).read(name)
    t = t.drop_columns([c for c in t.column_names if c in NOT_COMPARED])
    return t.sort_by([(k, "ascending") for k in keys])


def same_bits(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """Whether two columns hold the same values, floats compared by their bits (a NaN equals a NaN)."""
    if a.type != b.type or len(a) != len(b) or not a.is_null().equals(b.is_null()):
        return False
    if pa.types.is_list(a.type):
        return (pc.list_value_length(a).equals(pc.list_value_length(b))
                and same_bits(pc.list_flatten(a), pc.list_flatten(b)))
    if pa.types.is_floating(a.type):
        bits = [np.asarray(pc.fill_null(x, 0.0).to_numpy(zero_copy_only=False)).view(np.int64) for x in (a, b)]
        return bool(np.array_equal(*bits))
    return a.equals(b)


def same_numbers(one: Path, other: Path) -> bool:
    """Whether two stores hold the same evaluations and per-example rows, bit for bit."""
    for name, keys in (("evaluations", ["eval_id"]), ("examples", ["eval_id", "example_id"])):
        a, b = table(one, name, keys), table(other, name, keys)
        if a.column_names != b.column_names or a.num_rows != b.num_rows:
            return False
        if not all(same_bits(a.column(c), b.column(c)) for c in a.column_names):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=20.0,
                        help="seconds between kills, at least (default 20; a kill waits for the last one's restart)")
    parser.add_argument("--heads", type=int, default=None,
                        help="masks over the first HEADS heads only (default: all 12: 4,095 masks)")
    common.add_argument(parser)
    args = parser.parse_args()
    smoke = common.enable_smoke(args)
    base = smoke_model() if smoke else demo_model()
    import ray

    # One local instance for both runs (as for a cluster's users: the driver connects with --address); its
    # workers are this process's descendants, and only those the driver's log names are killed.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 2 workers and room for Ray's own tasks
    address = ray.get_runtime_context().gcs_address
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        folder = Path(tmp)
        # Smoke: chunks of 4, so that the kill lands while most of the small grid is still to come.
        config = write_config(base, args.heads, folder, flush_every=4 if smoke else 64)
        planned = len(yaml.safe_load(config.read_text())["sweep"]["masks"]) + 1  # and the baseline
        start = time.monotonic()
        print(f"faulted run: a worker killed every {args.every:g} s", flush=True)
        # The driver's memory from a tenth of the grid on: past its warm-up over the first chunks.
        driver, kills, rss = faulted_run(config, folder / "faulted", address, args.every, 1 if smoke else None,
                                         warm_up=max(1, planned // 10))
        if driver.proc.returncode != 0:
            sys.exit(f"the faulted run exited {driver.proc.returncode}:\n{''.join(driver.lines[-30:])}")
        # One worker down at a time: each kill's restart is the next "restarted as" line after it.
        downtime = [next(t for t in driver.back if t > k) - k for k in kills if any(t > k for t in driver.back)]
        print(f"faulted run: {time.monotonic() - start:.0f} s, {len(kills)} kills, {len(driver.back)} restarts "
              f"logged, kill to restarted (model loaded) {np.mean(downtime) if downtime else float('nan'):.1f} s on "
              "average, "
              f"driver RSS {rss.get('first', float('nan')):.0f} MiB at its first stored evaluations, "
              f"{rss.get('start', float('nan')):.0f} MiB at a tenth of the grid, at most {max(driver.rss):.0f} MiB",
              flush=True)
        start = time.monotonic()
        whole = Driver(config, folder / "whole", address)
        if whole.finish() != 0:
            sys.exit(f"the uninterrupted run exited {whole.proc.returncode}:\n{''.join(whole.lines[-30:])}")
        print(f"uninterrupted run: {time.monotonic() - start:.0f} s", flush=True)

        from headsweep.results.store import ResultStore

        faulted = ResultStore(str(folder / "faulted"))
        [run] = faulted.read("runs").to_pylist()
        ids = faulted.read("evaluations").column("eval_id").to_pylist()
        print(f"faulted run: status {run['status']}, {run['n_done']} of {run['n_planned']} done", flush=True)
        common.result("soak", masks=run["n_planned"], kills=len(kills), lost=run["n_planned"] - len(set(ids)),
                      duplicated=len(ids) - len(set(ids)),
                      equal=str(same_numbers(folder / "faulted", folder / "whole")).lower(),
                      driver_rss_mib_start=f"{rss.get('start', float('nan')):.0f}",
                      driver_rss_mib_end=f"{driver.rss[-1]:.0f}")
    ray.shutdown()

if __name__ == "__main__":
    main()
