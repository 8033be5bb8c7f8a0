"""Plain progress lines (a log, a pipe) when a worker call's results land together.

A call carries several masks (``sweep.masks_per_batch``, the baseline with the first layer's masks): its results
reach the driver at one moment. The line must count them all, not print the first alone (``1/65 ... ETA 2:28:05``
in a run whose first call had finished 8 of 65) and hold the rest back for the next line, a call later.
"""

from __future__ import annotations

import io
import re

from headsweep.sweep.output.progress import Progress

LINE = re.compile(r"evaluations: (\d+)/(\d+) ")


def counts(text: str) -> list[int]:
    return [int(m.group(1)) for m in LINE.finditer(text)]


def land(progress: Progress, call: int, first: int) -> None:
    """One call's ``call`` results, as the driver's loop passes them on (``more`` while others of it follow)."""
    for k in range(call):
        progress.update(1, f"[m{first + k}]", more=k < call - 1)


def test_a_call_that_lands_together_is_counted_whole() -> None:
    out = io.StringIO()
    progress = Progress(12, every=3600.0, stream=out)  # throttled: only the first line and the last are due
    land(progress, 8, 0)
    assert counts(out.getvalue()) == [8]  # the first line: the whole call, not its first unit alone
    assert out.getvalue().rstrip().endswith("[m7]")
    land(progress, 4, 8)
    assert counts(out.getvalue()) == [8, 12]  # the last line, whatever the throttle


def test_updates_without_more_keep_a_line_per_due_update() -> None:
    """Single updates (one unit a call, a demo's epochs) print as they come, the throttle allowing."""
    out = io.StringIO()
    progress = Progress(3, every=0.0, stream=out)
    for k in range(3):
        progress.update(1, f"[m{k}]")
    assert counts(out.getvalue()) == [1, 2, 3]


def test_a_call_cut_short_still_leaves_its_count_on_close() -> None:
    """A run stopped inside a call's results (an interrupt, a budget) closes with the count it reached."""
    out = io.StringIO()
    progress = Progress(10, every=3600.0, stream=out)
    land(progress, 4, 0)
    progress.update(1, "[m4]", more=True)  # the next call's first result; the run stops here
    progress.close()
    assert counts(out.getvalue()) == [4, 5]
