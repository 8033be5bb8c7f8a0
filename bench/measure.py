"""How the in-process grid benchmarks (grid_speed, lm_grid, translation_vs_fairseq) measure: resident memory
sampled while a phase runs, a grid evaluated in the calls the driver would make, and masks spread over heads."""

from __future__ import annotations

import ctypes
import os
import threading
import time

from headsweep.sweep.cluster.dispatch import units_per_call

try:
    TRIM = ctypes.CDLL("libc.so.6")
except OSError:
    TRIM = None


class PeakRSS:
    """Resident set size while a named phase runs, sampled by a thread: the highest seen, and the
    most it rose above its value at the start of one call (the call's transient memory)."""

    def __init__(self, every: float = 0.02):
        self.every, self.phase, self.peak, self.rise = every, None, {}, {}
        self._start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        """This process's resident set size now, in bytes."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self, phase: str) -> None:
        rss = self.rss()
        self.peak[phase] = max(self.peak.get(phase, 0), rss)
        self.rise[phase] = max(self.rise.get(phase, 0), rss - self._start)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            phase = self.phase
            if phase is not None:
                self._sample(phase)

    def timed(self, phase: str, fn, *args):
        """Run ``fn(*args)`` as ``phase``; returns (result, seconds)."""
        if TRIM is not None:
            TRIM.malloc_trim(0)  # hand freed heap back, so that the rise measures this call alone
        self._start = self.rss()
        self._sample(phase)
        self.phase = phase
        start = time.perf_counter()
        try:
            return fn(*args), time.perf_counter() - start
        finally:
            self.phase = None
            self._sample(phase)

    def stop(self) -> None:
        """End the sampling thread."""
        self._stop.set()


def mib(n: int) -> str:
    """``n`` bytes as whole MiB."""
    return f"{n / (1 << 20):.0f} MiB"


def run_grid(task, masks: list, options, peak: PeakRSS, phase: str) -> tuple[list, float]:
    """Evaluate ``masks`` in driver-sized calls; returns outputs and seconds."""
    outs, total = [], 0.0
    step = units_per_call(options.masks_per_batch)
    for i in range(0, len(masks), step):
        got, seconds = peak.timed(phase, task.evaluate, masks[i : i + step])
        outs += got
        total += seconds
    return outs, total


def spread(n: int, count: int) -> list[int]:
    """``count`` indices spread over range(n)."""
    count = min(count, n)
    return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)}) if count > 1 else [0]
