"""Progress lines with counts, rate and ETA for long sweeps, on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints ``label done/total rate ETA`` at most every ``every`` seconds (and at the end).

    ``detail`` (e.g. per-worker status) is printed on its own line every ``detail_every`` seconds.
    """

    def __init__(
        self,
        total: int,
        label: str = "evaluations",
        every: float = 2.0,
        enabled: bool = True,
        stream=None,
        detail: Callable[[], str] | None = None,
        detail_every: float = 30.0,
    ):
        self.total = total
        self.detail = detail
        self.detail_every = detail_every
        self._last_detail = time.monotonic()
        self.label = label
        self.every = every
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every or self.done >= self.total):
            self._last = now
            self._print(note)
            if self.detail is not None and (now - self._last_detail >= self.detail_every or self.done >= self.total):
                self._last_detail = now
                self.stream.write(("\n" if self._tty and self.done < self.total else "") + self.detail() + "\n")
                self.stream.flush()

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_text = _clock(eta) if eta == eta else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (
            f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) {rate:.2f}/s "
            f"elapsed {_clock(elapsed)} ETA {eta_text}"
        )
        return f"{text} {note}".rstrip()

    def _print(self, note: str) -> None:
        end = "\n" if (not self._tty or self.done >= self.total) else ""
        prefix = "\r" if self._tty else ""
        self.stream.write(prefix + self.line(note) + end)
        self.stream.flush()
