"""Sweeps run through the public API (``headsweep.run``, ``headsweep.open_store``) and watched from this process:
stderr lines time-stamped, the Ray workers' peak memory and CPU time sampled, evaluations and per-example
statistics read back from the store (real_size, ablation_methods)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


class StampedStderr:
    """``sys.stderr`` while a sweep runs: each line passes through, and is kept with the time it was written."""

    def __init__(self, stream):
        self.stream, self.buf, self.lines = stream, "", []

    def write(self, text: str) -> int:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.lines.append((time.time(), line))
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


class WorkerWatch:
    """This process's Ray worker processes, sampled by a thread: each one's peak resident memory (``VmHWM``) and
    the CPU time it has used (``utime + stime``), with the time of each sample."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, every: float = 0.25):
        self.every, self.peak, self.cpu = every, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _stats() -> dict[int, list[str]]:
        out = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        out[int(entry)] = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
        return out

    def sample(self) -> None:
        now, stats = time.time(), self._stats()
        found, frontier = [], [os.getpid()]
        while frontier:  # descendants: the Ray instance this process started, and its workers
            frontier = [p for p, fields in stats.items() if int(fields[1]) in frontier]
            found += frontier
        for pid in found:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not f.read().startswith(b"ray::"):
                        continue
                with open(f"/proc/{pid}/status") as f:
                    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration, ValueError):
                continue
            self.peak[pid] = max(self.peak.get(pid, 0), hwm)
            fields = stats[pid]  # after ")": state, ppid, ..., utime and stime are fields 12 and 13
            self.cpu.setdefault(pid, []).append((now, (int(fields[11]) + int(fields[12])) / self.TICK))

    def cpu_seconds(self, pid: int, start: float, end: float) -> float:
        """CPU seconds ``pid`` used between ``start`` and ``end`` (from the samples around them)."""
        samples = self.cpu.get(pid, [])
        before = [c for t, c in samples if t <= start] or [samples[0][1] if samples else 0.0]
        after = [c for t, c in samples if t >= end] or [samples[-1][1] if samples else 0.0]
        return after[0] - before[-1]

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Run:
    """One sweep: its id, wall time, stamped stderr lines and its evaluations."""

    run_id: str
    start: float
    wall: float
    lines: list[tuple[float, str]]
    evaluations: list[dict] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def stamp(self, pattern: str) -> float | None:
        """When the first stderr line matching ``pattern`` was written."""
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def span(self, experiment: str) -> tuple[float, float] | None:
        """(start, end) of ``experiment``'s evaluations: when the first worker began its first call of them (the
        results of a call land together, their ``seconds`` adding up to the call's), and when the last landed."""
        rows = [e for e in self.evaluations if e["experiment"] == experiment]
        if not rows:
            return None
        starts = []
        for worker in {e["worker"] for e in rows}:
            mine = sorted((e for e in rows if e["worker"] == worker), key=lambda e: e["finished_at"])
            call = [e for e in mine if e["finished_at"] - mine[0]["finished_at"] < 0.05]
            starts.append(mine[0]["finished_at"] - sum(e["seconds"] for e in call))
        return min(starts), max(e["finished_at"] for e in rows)


def run_sweep(config: Path, store: str) -> Run:
    """``headsweep.run`` with its stderr lines time-stamped; then the run's evaluations and facts from the store."""
    import headsweep

    os.environ["HEADSWEEP_PLAIN_PROGRESS"] = "1"  # the plain progress lines, also on a terminal
    stamped = StampedStderr(sys.stderr)
    sys.stderr = stamped
    start = time.time()
    try:
        run_id = headsweep.run(str(config), [], store=store)
    finally:
        sys.stderr = stamped.stream
    run = Run(run_id, start, time.time() - start, stamped.lines)
    with headsweep.open_store(store) as s:
        cols = ["eval_id", "experiment", "heads_masked", "seconds", "worker", "finished_at"]
        # finished_at as epoch seconds (a timestamp with time zone would need pytz to fetch)
        rel = s.sql(f"SELECT {', '.join(cols[:-1])}, epoch(finished_at) FROM evaluations WHERE run_id = ?", [run_id])
        run.evaluations = [dict(zip(cols, row, strict=True)) for row in rel.fetchall()]
        run.facts = json.loads(s.sql("SELECT facts FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0])
    return run


def examples_by_mask(store: str, run_id: str) -> dict[tuple[str, ...], dict[str, tuple[list[float], float | None]]]:
    """Per mask (its heads, sorted) and example: the stored statistics and loss."""
    import headsweep

    with headsweep.open_store(store) as s:
        rows = s.sql("SELECT v.heads_masked, x.example_id, x.stats, x.loss FROM examples x JOIN evaluations v "
                     "ON x.run_id = v.run_id AND x.eval_id = v.eval_id WHERE x.run_id = ?", [run_id]).fetchall()
    out: dict = {}
    for heads, example, stats, loss in rows:
        out.setdefault(tuple(sorted(heads)), {})[example] = (list(stats), loss)
    return out
