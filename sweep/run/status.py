"""``headsweep status RUN``: where one run stands, read from the store (also while its driver is writing it)."""

from __future__ import annotations

from headsweep.errors import HeadsweepError
from headsweep.results.query import connect
from headsweep.results.store import ResultStore
from headsweep.sweep import experiments  # noqa: F401 - registers the kinds' tables and views read here


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def status_lines(store: ResultStore, run_id: str) -> list[str]:
    """Status, evaluations stored of planned, significant heads (final, or so far), ETA and last update."""
    con = connect(store)
    try:
        # Timestamps as text and an age in seconds: DuckDB's TIMESTAMPTZ values need pytz in Python.
        rel = con.execute("SELECT run_id, name, status, model, dataset, metric, baseline_score, n_done, n_planned, "
                          "n_significant, n_heads, significant_so_far, eta_s, "
                          "strftime(updated_at AT TIME ZONE 'UTC', '%Y-%m-%d %H:%M:%S') AS updated, "
                          "epoch(now()) - epoch(updated_at) AS age_s FROM summary WHERE run_id = ?", [run_id])
        columns = [d[0] for d in rel.description]
        rows = [dict(zip(columns, r, strict=True)) for r in rel.fetchall()]
    finally:
        con.close()
    if not rows:
        raise HeadsweepError(f"no run {run_id!r} in store {store.uri} (headsweep runs lists them)")
    r = rows[0]
    lines = [f"run {r['run_id']} ({r['name']}): {r['status']}",
             f"model {r['model']}, data {r['dataset']}, metric {r['metric']}, baseline "
             + (f"{r['baseline_score']}" if r["baseline_score"] is not None else "not evaluated yet"),
             f"evaluations stored: {r['n_done']} of {r['n_planned']}"
             + ("" if r["status"] == "complete" else " planned so far")]
    if r["status"] == "running" and r["significant_so_far"] is not None:
        lines.append(f"heads significant so far: {r['significant_so_far']} (corrected over the heads tested so far)")
    else:
        lines.append(f"heads significant: {r['n_significant']} of {r['n_heads']}")
    if r["status"] == "running":
        eta = r["eta_s"]
        lines.append("ETA of the pass in progress: " + (_clock(eta) if eta is not None else "not known yet"))
    if r["status"] in ("partial", "interrupted", "failed"):
        lines.append("run the same command again to continue it (or headsweep run CONFIG --resume RUN_ID)")
    if r["updated"] is not None:
        lines.append(f"last written {_clock(max(r['age_s'], 0))} ago ({r['updated']} UTC)")
    return lines
