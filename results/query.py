"""SQL over the results tables with DuckDB: one view per table, read through pyarrow.

Views are built from pyarrow datasets with the store's own schemas, so files written before a
column existed read back with that column null, and any filesystem pyarrow supports works.
"""

from __future__ import annotations

import csv
import io
import json
import math

import duckdb
import pyarrow as pa

from results.schema import TABLES
from results.store import ResultStore
from sweep.errors import HeadsweepError

FORMATS = ("table", "csv", "json")


# Each evaluation with the test headsweep shows next to a delta (paired bootstrap for BLEU,
# paired t-test for accuracy); the other tests stay in `significance`.
DELTAS_VIEW = """
CREATE VIEW deltas AS
SELECT e.run_id, e.eval_id, e.experiment, e.attention, e.layer, e.head, e.level, e.checkpoint, e.n_masked, e.metric,
       e.score, e.baseline_score, e.delta, s.test, s.p_value, s.p_adjusted, s.correction, s.alpha,
       s.significant, s.ci_low, s.ci_high
FROM evaluations e
LEFT JOIN significance s
  ON s.run_id = e.run_id AND s.eval_id = e.eval_id
 AND s.test = CASE e.metric WHEN 'accuracy' THEN 'paired_ttest' ELSE 'paired_bootstrap' END
"""


def connect(store: ResultStore) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view named after each results table, plus ``deltas``."""
    con = duckdb.connect()
    for table in TABLES:
        con.register(table, store.dataset(table))
    con.execute(DELTAS_VIEW)
    return con


def run_query(store: ResultStore, sql: str) -> pa.Table:
    """Run ``sql`` against the store's views and return the result as an Arrow table."""
    con = connect(store)
    try:
        relation = con.sql(sql)
        return relation.to_arrow_table() if relation is not None else pa.table({})
    except duckdb.Error as exc:
        raise HeadsweepError(f"query failed: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return str(value)


def format_table(table: pa.Table, fmt: str = "table", max_rows: int | None = None) -> str:
    """Render a query result as an aligned text table, CSV or JSON lines."""
    rows = table.to_pylist()
    if fmt == "json":
        return "\n".join(json.dumps(r, default=str) for r in rows)
    names = table.column_names
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        for r in rows:
            writer.writerow([_cell(r[n]) for n in names])
        return out.getvalue().rstrip("\n")
    if fmt != "table":
        raise HeadsweepError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[_cell(r[n]) for n in names] for r in shown]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more rows")
    lines.append(f"({len(rows)} rows)")
    return "\n".join(lines)
