"""``headsweep status RUN``: where one run stands, read from the store (also while its driver is writing it)."""

from __future__ import annotations

import pyarrow as pa

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.schema import COMPLETE, RUNNING
from headsweep.results.store import ResultStore
from headsweep.sweep import experiments  # noqa: F401 - registers the kinds' tables and views read here
from headsweep.sweep.run.runs import HEARTBEAT_S, STALE_AFTER_S, driver_alive, local_pid, ray_job_alive, run_driver

# Timestamps as text and an age in seconds: DuckDB's TIMESTAMPTZ values need pytz in Python. The count of stored
# evaluations is the summary view's n_done: the evaluations table's count, as `headsweep runs` and the report show it
# (not the row's own n_done, written with the row: behind a live run, and never updated by a driver that died).
STATUS_SQL = """
SELECT s.run_id, s.name, s.status, s.model, s.dataset, s.metric, s.baseline_score, s.n_planned, s.n_significant,
       s.n_heads, s.significant_so_far, s.eta_s, r.facts,
       s.n_done AS n_stored,
       strftime(s.updated_at AT TIME ZONE 'UTC', '%Y-%m-%d %H:%M:%S') AS updated,
       epoch(now()) - epoch(s.updated_at) AS age_s
FROM summary s JOIN runs r USING (run_id) WHERE s.run_id = ?
"""


# The driver and heartbeat age of every run whose row says running (what ``runs_listing`` checks).
RUNNING_SQL = """
SELECT run_id, facts, epoch(now()) - epoch(updated_at) AS age_s FROM runs WHERE status = 'running'
"""


STALE = "stale"


def shown_status(status: str | None, facts: str | None, age_s: float | None) -> str | None:
    """The status every reading command shows (``runs``, ``status``, ``report``): the row's, except ``stale`` for a
    run whose row says running but whose driver is gone (:func:`driver_alive`; ``age_s``: since the row's
    ``updated_at``, its heartbeat)."""
    if status != RUNNING:
        return status
    alive = driver_alive(run_driver(facts), max(age_s or 0.0, 0.0), ray_job_alive(facts))
    return status if alive else STALE


def runs_listing(store: ResultStore, sql: str) -> pa.Table:
    """``sql`` (the ``runs`` command's listing of the summary view) with ``status`` as :func:`shown_status` gives
    it."""
    table = run_query(store, sql)
    if "status" not in table.column_names or "run_id" not in table.column_names:
        return table
    stale = {r["run_id"] for r in run_query(store, RUNNING_SQL).to_pylist()
             if shown_status(RUNNING, r["facts"], r["age_s"]) == STALE}
    if not stale:
        return table
    ids, statuses = table.column("run_id").to_pylist(), table.column("status").to_pylist()
    statuses = [STALE if run_id in stale else status for run_id, status in zip(ids, statuses, strict=True)]
    i = table.column_names.index("status")
    return table.set_column(i, "status", pa.array(statuses, pa.string()))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def stale_line(driver: str, updated: str, age_s: float, ray_job_ended: bool = False) -> str:
    """Why a ``running`` run's driver is taken for gone: the Ray cluster this process is on has ended its job, its
    process is not there (a driver on this host), or its heartbeat stopped longer ago than a live driver ever lets
    it (elsewhere, or a store read from another host)."""
    if ray_job_ended:
        return (f"stale: its driver {driver}'s Ray job has ended on this cluster (last heartbeat {updated} UTC, "
                f"{_clock(age_s)} ago)")
    if local_pid(driver) is not None:
        return f"stale: its driver {driver} is not running (last heartbeat {updated} UTC, {_clock(age_s)} ago)"
    return (f"stale: its driver {driver or '(not named)'} has written no heartbeat since {updated} UTC "
            f"({_clock(age_s)} ago; a running driver writes one every {HEARTBEAT_S:.0f} s and is taken for gone "
            f"after {STALE_AFTER_S:.0f} s without)")


def status_lines(store: ResultStore, run_id: str) -> list[str]:
    """Status, evaluations stored of planned, significant heads (final, or so far), ETA and last update.

    A ``running`` run whose driver is gone (killed, its host lost) is shown as stale, with how to resume it."""
    rows = run_query(store, STATUS_SQL, [run_id]).to_pylist()
    if not rows:
        raise HeadsweepError(f"no run {run_id!r} in store {store.uri} (headsweep runs lists them)")
    r = rows[0]
    age = max(r["age_s"] or 0.0, 0.0)
    driver = run_driver(r["facts"])
    on_ray = ray_job_alive(r["facts"]) if r["status"] == RUNNING else None
    stale = shown_status(r["status"], r["facts"], age) == STALE
    state = stale_line(driver, r["updated"], age, ray_job_ended=on_ray is False) if stale else r["status"]
    stored, planned = r["n_stored"], r["n_planned"]
    if planned is None or planned < stored:
        counts = f"{stored} (how many were planned is not recorded)"
    else:
        counts = f"{stored} of {planned}" + ("" if r["status"] == COMPLETE else " planned so far")
    lines = [f"run {r['run_id']} ({r['name']}): {state}",
             f"model {r['model']}, data {r['dataset']}, metric {r['metric']}, baseline "
             + (f"{r['baseline_score']}" if r["baseline_score"] is not None else "not evaluated yet"),
             f"evaluations stored: {counts}"]
    live = r["status"] == RUNNING and not stale
    if live and r["significant_so_far"] is not None:
        lines.append(f"heads significant so far: {r['significant_so_far']} (corrected over the heads tested so far)")
    else:
        lines.append(f"heads significant: {r['n_significant']} of {r['n_heads']}")
    if live:
        eta = r["eta_s"]
        lines.append("ETA of the pass in progress: " + (_clock(eta) if eta is not None else "not known yet"))
    if stale or r["status"] in ("partial", "interrupted", "failed"):
        lines.append(f"run the same command again to continue it (or headsweep run CONFIG --resume {r['run_id']})")
    if r["updated"] is not None:
        lines.append(f"last written {_clock(age)} ago ({r['updated']} UTC)")
    return lines
