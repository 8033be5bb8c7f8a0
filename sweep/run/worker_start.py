"""Waiting for the workers of a sweep to start: placed by Ray, their processes started, their models loaded.

Ray queues an actor it cannot place without a word, and starts actor processes a few at a time; each worker then
loads its model copy. Workers not all ready ``WAIT_NOTICE_S`` after they were asked for are reported in a status
line, again every ``WAIT_REPEAT_S``: how many are ready, how many are loading the model, and how many wait, for
Ray to start their processes or for resources (what each asks, what the cluster has free), until
``sweep.placement_timeout_s`` ends the wait with an error.
"""

from __future__ import annotations

import time

import ray

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster.dispatch import get, log
from headsweep.sweep.cluster.placement import WorkerAsk

# A tiny model loads in a few seconds: a longer wait has a cause the user should see.
WAIT_NOTICE_S = 10.0
WAIT_REPEAT_S = 30.0


def wait_for_workers(loads: list, started: list, timeout_s: float, ask: WorkerAsk) -> list:
    """Results of the workers' ``load`` calls (``loads``), or an error naming what the cluster lacks after
    ``timeout_s``. ``started``: a call each worker was sent before its ``load`` (an actor runs its calls in order),
    done once Ray placed the worker and started its process."""
    begun = time.monotonic()
    notice = WAIT_NOTICE_S
    pending = list(loads)
    while pending:
        elapsed = time.monotonic() - begun
        if elapsed >= timeout_s:
            break
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(timeout_s, notice) - elapsed)
        elapsed = time.monotonic() - begun
        if pending and notice <= elapsed < timeout_s:
            log(waiting_line(len(loads), len(loads) - len(pending), started, elapsed, timeout_s, ask))
            notice += WAIT_REPEAT_S
    if pending:
        raise HeadsweepError(f"{len(pending)} of {len(loads)} workers did not start within {timeout_s:g} s "
                             f"(sweep.placement_timeout_s): {ask.describe()}")
    return [get(ref) for ref in loads]


def waiting_line(total: int, ready: int, started: list, elapsed: float, timeout_s: float, ask: WorkerAsk) -> str:
    """``0 of 18 workers ready after 10 s: 2 loading the model, 16 waiting for Ray to start their processes (each
    worker asks ...)``. Workers not started wait for resources while the cluster has not what one asks free."""
    placed, _ = ray.wait(started, num_returns=len(started), timeout=0)
    loading = max(0, len(placed) - ready)
    waiting = total - ready - loading
    parts = [f"{loading} loading the model"] if loading else []
    if waiting:
        what = "for Ray to start their processes" if ask.fits_now() else "for resources"
        parts.append(f"{waiting} waiting {what} ({ask.describe()}; sweep.placement_timeout_s: {timeout_s:g} s)")
    return f"{ready} of {total} workers ready after {elapsed:.0f} s: {', '.join(parts)}"
