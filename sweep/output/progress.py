"""Progress of long steps: one live line on a terminal, plain lines every few seconds elsewhere.

On a terminal (the console's stderr is a TTY) a ``Progress`` is a single tqdm line, redrawn in
place: the phase, count, bar, rate, elapsed time, ETA and each worker's state; headsweep's own
lines pass above it (``headsweep.sweep.output.console``). tqdm rather than rich: tqdm is already
installed with transformers, huggingface_hub and fairseq (no new dependency), draws exactly one
line trimmed to the terminal's width and only writes to the stream it is given; rich arrives
only through typer and its live display takes over ``sys.stdout``/``sys.stderr``, which the
console already points at the log file.

Elsewhere (cluster logs, CI, a pipe) the lines are plain and appended:
``evaluations: done/total (pct) rate/s elapsed H:MM:SS ETA H:MM:SS [last eval id]`` at most every
``every`` seconds and at the end (updates marked ``more``, the rest of one worker call's results, wait for the
last of them), and the ``detail`` line (per-worker state) every
``detail_every`` seconds and at the end.

``step(name)`` is the same for a long step that is not a stream of evaluations (importance,
efficiency timing): a live elapsed-time line on a terminal, a start and an end line elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from headsweep.sweep.output import console

# The live line: phase, count, bar, percent, rate, elapsed, ETA, then the postfix (worker state, last item).
BAR_FORMAT = ("{desc} {n_fmt}/{total_fmt} {bar:16} {percentage:3.0f}% {speed} "
              "elapsed {elapsed} ETA {remaining}{postfix}")
STEP_FORMAT = "{desc} running, elapsed {elapsed}{postfix}"
TICK_S = 1.0  # how often the live line is redrawn when nothing lands (elapsed time, worker state)


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _isatty(stream) -> bool:
    if os.environ.get("HEADSWEEP_PLAIN_PROGRESS"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def phase_of(note: str) -> str | None:
    """The phase an eval id belongs to: ``[single_head/self:1:2]`` -> ``single_head``,
    ``[ckpt0/prune_level/global/0.3000]`` -> ``ckpt0/prune_level/global``."""
    text = note.strip().strip("[]")
    return text.rsplit("/", 1)[0] if "/" in text else None


_WORKER = re.compile(r"(?:worker-)?(\d+)@\S+ (\d+) done, (\w+)")


def compact_workers(text: str) -> str:
    """The per-worker state for the live line: ``workers: worker-0@host:pid 12 done, busy; ...`` ->
    ``w0 busy 12 done · w1 idle 11 done``; past four workers, a count per state (``8 workers: 7 busy, 1 lost``)."""
    found = _WORKER.findall(text)
    if not found:
        return re.sub(r"@\S+", "", text.removeprefix("workers: "))
    if len(found) <= 4:
        return " · ".join(f"w{i} {state} {n} done" for i, n, state in found)
    states = Counter(state for _, _, state in found)
    return f"{len(found)} workers: " + ", ".join(f"{k} {state}" for state, k in sorted(states.items()))


def rate_text(rate: float | None, unit: str | None) -> str:
    """``2.97/s`` (no unit: the evaluation lines' form), ``2.97 evals/s``, or ``9.2 s/epoch`` below one a second."""
    if unit is None:
        return f"{rate or 0.0:.2f}/s"
    if rate is None or rate <= 0:
        return f"? {unit}s/s"
    if rate < 1:
        return f"{1 / rate:.1f} s/{unit}"
    return f"{rate:.2f} {unit}s/s"


class _Live:
    """A tqdm line on the console's terminal, redrawn every ``TICK_S`` by a thread so that time moves
    even while nothing lands."""

    def __init__(self, stream, total: int | None, desc: str, unit: str, fmt: str, postfix: Callable[[], str]):
        from tqdm import tqdm

        class Bar(tqdm):
            @property
            def format_dict(self):
                # The rate as the plain lines word it (tqdm's own would read "9.15s/ epoch").
                d = super().format_dict
                elapsed = d.get("elapsed") or 0.0
                rate = d.get("rate") or (d["n"] / elapsed if elapsed > 0 and d["n"] else None)
                return {**d, "speed": rate_text(rate, unit)}

        self.postfix = postfix
        self.lock = threading.RLock()
        # A terminal that reports no width (a fresh pseudo-terminal) gets 100 columns.
        dynamic = _columns(stream) > 0
        self.bar = Bar(total=total, file=stream, desc=desc, unit=unit, bar_format=fmt, dynamic_ncols=dynamic,
                       ncols=None if dynamic else 100, mininterval=0.2, leave=True, smoothing=0.1)
        self._set_postfix()
        self.bar.refresh()
        console.attach_live(self)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="headsweep-progress", daemon=True)
        self._ticker.start()

    def _set_postfix(self) -> None:
        try:
            text = self.postfix()
        except Exception:  # noqa: BLE001 - a status callback must never break the run
            text = ""
        self.bar.set_postfix_str(text, refresh=False)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self.lock:
                self._set_postfix()
                self.bar.refresh()

    def clear(self) -> None:
        """Erase the line (a line of headsweep's own is about to be written)."""
        with self.lock:
            self.bar.clear()

    def refresh(self) -> None:
        with self.lock:
            self.bar.refresh()

    def update(self, n: int, desc: str | None) -> None:
        with self.lock:
            if desc:
                self.bar.set_description_str(desc, refresh=False)
            self._set_postfix()
            self.bar.update(n)

    def close(self, leave: bool = True) -> None:
        """Stop redrawing; ``leave`` the last state on the terminal as a line, or erase it."""
        self._stop.set()
        with self.lock:
            if self.bar.disable:  # closed already
                return
            self._set_postfix()
            console.detach_live(self)
            self.bar.leave = leave
            self.bar.close()


class Progress:
    """Counts, rate and ETA of ``total`` items (``update`` per item that lands).

    ``label`` names the items in plain lines; ``phase`` (or, by default, the eval id in each
    ``update``'s note) names the step on the live line; ``detail`` is the per-worker state.
    ``unit`` (e.g. ``"epoch"``) switches plain lines' rate to ``units/s`` or ``s/unit``.
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
        phase: str | None = None,
        unit: str | None = None,
    ):
        self.total = total
        self.detail = detail
        self.detail_every = detail_every
        self._last_detail = time.monotonic()
        self.label = label
        self.phase = phase
        self.unit = unit
        self.every = every
        self.enabled = enabled
        self.stream = stream or console.err_stream()
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._note = ""
        self._printed = 0
        self._tty = _isatty(self.stream)
        self._live: _Live | None = None
        self._closed = False
        if enabled and self._tty and total > 0:
            self._live = _Live(self.stream, total, phase or label, unit or "eval", BAR_FORMAT, self._postfix)

    def update(self, n: int = 1, note: str = "", more: bool = False) -> None:
        """``n`` more items done; ``more``: further updates land at the same moment (the rest of one worker call's
        results), so a plain line waits for the last of them rather than print the first alone."""
        self.done += n
        self._note = note
        if self._live is not None:
            self._live.update(n, self.phase or phase_of(note))
            if self.done >= self.total:
                self.close()
            return
        now = time.monotonic()
        finished = self.done >= self.total
        if self.enabled and (finished or (not more and now - self._last >= self.every)):
            self._last = now
            self._print(note)
            if self.detail is not None and (now - self._last_detail >= self.detail_every or finished):
                self._last_detail = now
                self._write(self.detail())

    def close(self) -> None:
        """End the line (a step that stopped short of ``total`` leaves its last count)."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            live, self._live = self._live, None
            live.close()
        elif self.enabled and self._printed < self.done:
            self._print(self._note)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _postfix(self) -> str:
        parts = []
        if self.detail is not None:
            parts.append(compact_workers(self.detail()))
        if self._note and not self._note.startswith("["):  # an eval id only repeats the phase
            parts.append(self._note)
        return "  ".join(parts)

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_text = _clock(eta) if eta == eta else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (
            f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) {rate_text(rate, self.unit)} "
            f"elapsed {_clock(elapsed)} ETA {eta_text}"
        )
        return f"{text} {note}".rstrip()

    def _print(self, note: str) -> None:
        self._printed = self.done
        self._write(self.line(note))

    def _write(self, text: str) -> None:
        _say(self.stream, text)


@contextlib.contextmanager
def step(name: str, enabled: bool = True, detail: Callable[[], str] | None = None, stream=None) -> Iterator[None]:
    """A long step that is not a stream of evaluations (gradient importance, efficiency timing).

    On a terminal: one live line ``NAME running, elapsed 0:12 (worker state)`` while it runs; elsewhere
    ``NAME ...`` when it starts. Both end with ``NAME: done in 12.3 s``.
    """
    stream = stream or console.err_stream()
    if not enabled:
        yield
        return
    start = time.monotonic()
    live = None
    if _isatty(stream):
        live = _Live(stream, None, name, "s", STEP_FORMAT, lambda: compact_workers(detail()) if detail else "")
    else:
        _say(stream, f"{name} ...")
    try:
        yield
    finally:
        if live is not None:
            live.close(leave=False)
    _say(stream, f"{name}: done in {time.monotonic() - start:.1f} s")


def _say(stream, text: str) -> None:
    if stream is console.err_stream():
        console.say(text)
    else:
        stream.write(text + "\n")
        stream.flush()
