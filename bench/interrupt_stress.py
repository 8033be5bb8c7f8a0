"""Interrupt stress: runs stopped at random moments, each store checked, resumed, and compared with a clean run.

Each trial is the real ``headsweep run`` CLI in a subprocess (its own session, so that Ctrl-C can go to its process
group, as a terminal sends it), on a local Ray instance this process starts (``--address``), into a fresh store. It
is stopped in one of four ways, in turn: SIGINT to the driver's process group (Ctrl-C), SIGTERM to the driver (a
scheduler's stop), SIGKILL of the driver, SIGKILL of its worker (the pid its log names: ``workers ready: ...``;
Ray restarts it and the run goes on). The moment comes from the trial's own progress, not from a clock: each trial
waits for a phase of its run and signals it there, the phases in turn with the kinds (so every kind meets every
phase): ``start-up`` (a moment drawn in the driver's first second: its interpreter's start and imports, before or
just after headsweep's signal handlers are in place), ``workers`` (the driver's log says its worker is ready: the
model loaded, the run's first row being written), ``grid`` (k evaluations stored, k drawn from 1 to all but one,
read from the store's evaluation files as they land) and ``finishing`` (every evaluation stored: the significance
tests and the run's last row being written). A SIGKILL of the worker needs the worker: it meets ``workers`` in place
of ``start-up``.

After the stop, the store must hold (the invariant): no evaluation twice; every stored evaluation with exactly its
example rows (one per example of the set, no other); no example row of an evaluation not stored, except an
examples file whose evaluations file never landed after a SIGKILL of the driver (a resume removes it: counted as
``orphans``); no significance row of an evaluation not stored, none twice; a run marked interrupted counts in
``n_done`` what it stored. Then the same command resumes the run (unless it had finished), and the store must
hold the invariant with nothing missing (every planned evaluation, every test of each), the run complete, and
equal the clean run bit for bit (evaluations, example rows and significance, less run id, worker and timings;
``bench.soak.same_numbers``).

The grid: a 3-layer, 2-head classifier trained for seconds (``bench.soak``'s smoke model) on 300 sentences,
baseline + single-head + all-but-one + every pair of heads as custom masks (28 evaluations), one mask per call,
chunks of 3 evaluations (so an interrupt meets a buffer of several), one worker on one thread, significance on.

Final line: ``RESULT interrupt_stress trials=<n> violations=<n> resumed=<n> equal=<n> finished_first=<n>
orphans=<n> interpreter_start=<n> sigint=<n> sigterm=<n> sigkill_driver=<n> sigkill_worker=<n>``:
``interpreter_start`` the Ctrl-Cs that landed inside CPython's own start (:func:`interpreter_start`), ``violations``
the invariant's failures over all trials (after the stop and after the resume, a wrong exit status included),
``resumed`` the trials resumed, ``equal`` the trials whose final store equals the clean run's, ``finished_first``
the trials whose run ended before the signal came (so it stopped no live run). Goal: violations 0, equal = trials,
finished_first (nearly) 0.

    python -m bench.interrupt_stress              # 52 trials (tens of minutes on 2 busy cores)
    python -m bench.interrupt_stress --trials 8 --seed 3
    python -m bench.interrupt_stress --smoke      # 1 trial: Ctrl-C mid-grid on a 13-evaluation grid, resumed
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench import common
from bench.soak import WORKER, same_bits, same_numbers, smoke_model, table

KINDS = ("sigint", "sigterm", "sigkill_driver", "sigkill_worker")
PHASES = ("start-up", "workers", "grid", "finishing")
# Smoke (the suite's run): the clean run, one stopped run and its resume, each a CLI process (their start-up is
# most of the time). The suite stops drivers by SIGTERM and SIGKILL in tests/run/test_resume.py and
# test_chunk_interrupts.py and kills workers in bench/soak.py; this one meets the grid with Ctrl-C (the stop's flush
# of a buffer) and checks that the resume equals the clean run.
SMOKE_TRIALS = (("sigint", "grid"),)
# The exit statuses a stop may end in: the command's own (130, 143), or the interpreter's before headsweep's
# handlers are installed (a signal's negative number); 0 when the run ended before the signal came.
EXPECTED_EXIT = {"sigint": {130, -signal.SIGINT}, "sigterm": {143, -signal.SIGTERM},
                 "sigkill_driver": {-signal.SIGKILL}, "sigkill_worker": {0}}


def interpreter_start(code: int, lines: list[str]) -> bool:
    """Whether a Ctrl-C ended the process inside CPython's own start (exit 1 and a ``KeyboardInterrupt`` traceback
    with no frame of headsweep's: raised while the interpreter imports its own modules, before ``-m headsweep``
    runs a line, where CPython exits 1 rather than by the signal). Counted apart (``interpreter_start``), not as a
    violation: nothing of headsweep's ran, so there is nothing it can handle; the store is checked all the same."""
    text = "".join(lines)
    return code == 1 and text.rstrip().endswith("KeyboardInterrupt") and "headsweep" not in text


def write_config(folder: Path, pairs: bool = True) -> Path:
    """The grid: baseline, single-head, all-but-one, and (``pairs``) every pair of heads as custom masks."""
    base = smoke_model()
    heads = [f"self:{layer}:{head}" for layer in range(3) for head in range(2)]
    masks = [list(pair) for pair in itertools.combinations(heads, 2)] if pairs else []
    cfg = {
        "name": "interrupt-stress",
        "model": base["model"],
        "data": base["data"],
        "sweep": {**base["sweep"], "experiments": ["baseline", "single_head", "all_but_one"], "masks": masks,
                  "workers": 1, "threads_per_worker": 1, "masks_per_batch": 1, "flush_every": 3,
                  "worker_restarts": 100},
    }
    path = folder / "stress.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Driver:
    """``headsweep run`` in its own session; its stderr read as it comes, its worker's pid taken from it."""

    config: Path
    store: Path
    address: str
    lines: list[str] = field(default_factory=list)
    worker_pid: int | None = None
    rows: dict[Path, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headsweep", "run", str(self.config), "--store", str(self.store), "--address",
             self.address, "--quiet"],
            cwd=self.config.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "RAY_AUTH_MODE": "disabled"},
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "workers ready:" in line and (found := WORKER.findall(line)):
                self.worker_pid = int(found[0][1])

    def stored(self) -> int:
        """Evaluations stored so far: the rows of the evaluation files landed (each is renamed into place whole)."""
        import pyarrow.parquet as pq

        folder = self.store / "evaluations"
        for path in folder.rglob("*.parquet") if folder.is_dir() else ():
            if path not in self.rows:
                try:
                    self.rows[path] = pq.read_metadata(path).num_rows
                except OSError:
                    continue  # removed meanwhile (a resume's orphan): counted when seen again
        return sum(self.rows.values())

    def wait_for(self, phase: str, rng: random.Random, n_evals: int) -> str:
        """Wait until the run reaches ``phase`` (the module's docstring), or ends; returns where it was."""
        if phase == "start-up":
            time.sleep(rng.uniform(0, 1.0))
            return f"{time.monotonic() - self.started:.2f} s after its start"
        if phase == "workers":
            while self.proc.poll() is None and self.worker_pid is None:
                time.sleep(0.02)
            return "worker ready"
        want = rng.randint(1, n_evals - 1) if phase == "grid" else n_evals
        while self.proc.poll() is None and self.stored() < want:
            time.sleep(0.02)
        return f"{self.stored()} of {n_evals} stored (waited for {want})"

    def stop(self, kind: str) -> bool:
        """Send ``kind``'s signal; False when there was nothing to send it to (the run or the worker had ended)."""
        if self.proc.poll() is not None:
            return False
        try:
            if kind == "sigint":
                os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
            elif kind == "sigterm":
                self.proc.send_signal(signal.SIGTERM)
            elif kind == "sigkill_driver":
                self.proc.kill()
            elif self.worker_pid is not None:
                os.kill(self.worker_pid, signal.SIGKILL)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def finish(self, timeout: float = 600) -> int:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        self.proc.stdout.close()
        return self.proc.returncode


def invariant(store: Path, n_examples: int, tests: int, *, complete: bool,
              orphans_allowed: bool) -> tuple[list[str], int]:
    """What breaks the store's invariant (see the module's docstring), and the example rows of evaluations not
    stored that a SIGKILL may leave (``orphans_allowed``). ``complete``: after the resume, nothing may be missing."""
    from headsweep.results.store import ResultStore

    if not store.exists():
        return ([] if not complete else ["no store"]), 0
    reader = ResultStore(str(store))
    evals = reader.read("evaluations", columns=["eval_id", "experiment"]).to_pylist()
    ids = [e["eval_id"] for e in evals]
    stored = set(ids)
    problems = [f"{n - 1} more rows of evaluation {i}" for i, n in Counter(ids).items() if n > 1]
    examples = Counter((e["eval_id"], e["example_id"])
                       for e in reader.read("examples", columns=["eval_id", "example_id"]).to_pylist())
    problems += [f"example {ex} of {e} stored {n} times" for (e, ex), n in examples.items() if n > 1 and e in stored]
    per_eval = Counter(e for e, _ in examples)
    problems += [f"evaluation {i} has {per_eval[i]} example rows, not {n_examples}"
                 for i in stored if per_eval[i] != n_examples]
    orphans = sum(n for e, n in per_eval.items() if e not in stored)
    if orphans and not orphans_allowed:
        problems.append(f"{orphans} example rows of evaluations not stored")
    sig = Counter((s["eval_id"], s["test"])
                  for s in reader.read("significance", columns=["eval_id", "test"]).to_pylist())
    problems += [f"significance of {e} ({t}) stored {n} times" for (e, t), n in sig.items() if n > 1]
    problems += [f"significance of {e}, an evaluation not stored" for e in {e for e, _ in sig} - stored]
    runs = reader.read("runs").to_pylist()
    if len(runs) > 1:
        problems.append(f"{len(runs)} runs, not one")
    for run in runs:
        if run["status"] == "interrupted" and run["n_done"] != len(stored):
            problems.append(f"run marked interrupted with n_done {run['n_done']}, {len(stored)} stored")
        if complete:
            if run["status"] != "complete" or run["n_done"] != len(stored) or run["n_planned"] != len(stored):
                problems.append(f"run {run['status']} with {run['n_done']} of {run['n_planned']} done, "
                                f"{len(stored)} stored")
            tested = Counter(e for e, _ in sig)
            problems += [f"evaluation {e['eval_id']} has {tested[e['eval_id']]} significance rows, not {tests}"
                         for e in evals if e["experiment"] != "baseline" and tested[e["eval_id"]] != tests]
    if complete and orphans:
        problems.append(f"{orphans} example rows of evaluations not stored after the resume")
    return problems, orphans


def same_significance(one: Path, other: Path) -> bool:
    a, b = (table(s, "significance", ["eval_id", "test"]) for s in (one, other))
    return a.column_names == b.column_names and a.num_rows == b.num_rows and all(
        same_bits(a.column(c), b.column(c)) for c in a.column_names)


@dataclass
class Clean:
    """The clean run: its store and size."""

    store: Path
    n_evals: int
    n_examples: int
    tests: int


def clean_run(config: Path, store: Path, address: str) -> Clean:
    from headsweep.results.store import ResultStore

    driver = Driver(config, store, address)
    if driver.finish() != 0:
        sys.exit(f"the clean run exited {driver.proc.returncode}:\n{''.join(driver.lines[-30:])}")
    reader = ResultStore(str(store))
    [run] = reader.read("runs").to_pylist()
    sig = reader.read("significance", columns=["test"]).column("test").to_pylist()
    clean = Clean(store, run["n_planned"], run["n_examples"], len(set(sig)))
    problems, _ = invariant(store, clean.n_examples, clean.tests, complete=True, orphans_allowed=False)
    if problems:
        sys.exit(f"the clean run's store breaks the invariant: {problems[:5]}")
    return clean


def trial(number: int, kind: str, phase: str, rng: random.Random, config: Path, folder: Path, address: str,
          clean: Clean, totals: Counter) -> None:
    """One trial: a run stopped by ``kind`` once it reaches ``phase``, its store checked, resumed, checked,
    compared."""
    store = folder / f"trial-{number}"
    if kind == "sigkill_worker" and phase == "start-up":
        phase = "workers"  # a worker exists only once the driver has started it
    driver = Driver(config, store, address)
    where = driver.wait_for(phase, rng, clean.n_evals)
    sent = driver.stop(kind)
    code = driver.finish()
    problems = []
    in_interpreter = kind == "sigint" and interpreter_start(code, driver.lines)
    if code not in EXPECTED_EXIT[kind] and not (code == 0 and not sent) and not in_interpreter:
        problems.append(f"exit {code}: {''.join(driver.lines[-5:]).strip()}")
    found, orphans = invariant(store, clean.n_examples, clean.tests, complete=code == 0,
                               orphans_allowed=kind == "sigkill_driver")
    problems += found
    resumed = code != 0
    if resumed:
        rerun = Driver(config, store, address)
        if rerun.finish() != 0:
            problems.append(f"the resume exited {rerun.proc.returncode}: {''.join(rerun.lines[-5:]).strip()}")
        else:
            problems += invariant(store, clean.n_examples, clean.tests, complete=True, orphans_allowed=False)[0]
    equal = not problems and same_numbers(store, clean.store) and same_significance(store, clean.store)
    totals.update(trials=1, violations=len(problems), resumed=int(resumed), equal=int(equal),
                  finished_first=int(not sent), orphans=orphans, interpreter_start=int(in_interpreter),
                  **{kind: 1, phase: 1})
    print(f"trial {number}: {kind} at {phase} ({where}{'' if sent else ', ended before the signal'}): exit {code}"
          f"{', resumed' if resumed else ''}, {'equal' if equal else 'NOT equal'}, {len(problems)} violations"
          + "".join(f"\n    {p}" for p in problems[:10]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=52, help="trials (default 52; the kinds in turn)")
    parser.add_argument("--seed", type=int, default=45, help="seed of the moments drawn (default 45)")
    common.add_argument(parser)
    args = parser.parse_args()
    smoke = common.enable_smoke(args)
    plan = list(SMOKE_TRIALS) if smoke else [
        (KINDS[n % len(KINDS)], PHASES[n // len(KINDS) % len(PHASES)]) for n in range(args.trials)]
    rng = random.Random(args.seed)
    # A shell without job control starts a background job with SIGINT ignored, and the drivers would inherit that
    # (headsweep keeps a signal ignored that it was started ignoring): their Ctrl-C must be a Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's memory monitor kills a worker when the machine's memory is nearly full, as it is at times on a shared
    # machine; such a kill is not one of the trial's (a worker lost while it loads ends the run): off here.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    for attempt in range(3):  # Ray gives its raylet 30 s to register: not always enough on an overloaded machine
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for it
            ray.shutdown()
            if attempt == 2:
                sys.exit(f"Ray did not start: {exc}")
            print(f"Ray did not start ({exc}); trying again", flush=True)
    address = ray.get_runtime_context().gcs_address
    totals: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="interrupt-stress-") as tmp:
        folder = Path(tmp)
        config = write_config(folder, pairs=not smoke)
        start = time.monotonic()
        clean = clean_run(config, folder / "clean", address)
        print(f"clean run: {time.monotonic() - start:.1f} s, {clean.n_evals} evaluations, {clean.n_examples} "
              f"examples, {clean.tests} tests", flush=True)
        for number, (kind, phase) in enumerate(plan):
            trial(number, kind, phase, rng, config, folder, address, clean, totals)
        print(f"{len(plan)} trials in {time.monotonic() - start:.0f} s; by phase: "
              + ", ".join(f"{p} {totals[p]}" for p in PHASES), flush=True)
    ray.shutdown()
    common.result("interrupt_stress", trials=totals["trials"], violations=totals["violations"],
                  resumed=totals["resumed"], equal=totals["equal"], finished_first=totals["finished_first"],
                  orphans=totals["orphans"], interpreter_start=totals["interpreter_start"],
                  **{k: totals[k] for k in KINDS})


if __name__ == "__main__":
    main()
