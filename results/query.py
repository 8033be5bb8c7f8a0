"""SQL over the results tables with DuckDB: one view per table, read through pyarrow, plus the
derived views of ``results/views.py`` (``deltas``, ``heads``, ``layers``, ``pruning``, ``summary``).

Views are built from pyarrow datasets with the store's own schemas, so files written before a
column existed read back with that column null, a table an older release never wrote reads
empty, and any filesystem pyarrow supports works. A store holding runs written by a newer
schema version than this release knows is refused.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.results.schema import RENAMED, SCHEMA_VERSION, TABLES, with_run_id
from headsweep.results.store import ResultStore
from headsweep.results.views import VIEWS

FORMATS = ("table", "csv", "json", "parquet")
T = TypeVar("T")


def store_schema_version(con: duckdb.DuckDBPyConnection) -> int | None:
    """The newest schema version among the store's runs (None for an empty store).

    Runs written before the version was recorded count as version 1.
    """
    (version,) = con.execute("SELECT max(coalesce(schema_version, 1)) FROM runs").fetchone()
    return version


def check_schema_version(con: duckdb.DuckDBPyConnection, uri: str) -> None:
    """Refuse a store written by a newer release: its tables may mean things this one misreads."""
    version = store_schema_version(con)
    if version is not None and version > SCHEMA_VERSION:
        raise HeadsweepError(
            f"store {uri} holds runs written with results schema version {version}; this headsweep reads "
            f"versions 1 to {SCHEMA_VERSION}: upgrade headsweep to read it"
        )


def connect(store: ResultStore) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view named after each results table, plus the derived views.

    The connection cannot touch files (``enable_external_access`` off, configuration locked): the
    tables are Arrow datasets read by pyarrow, so a query can read the store but never write into it,
    attach databases or install extensions.
    """
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        for table in TABLES:
            renamed = RENAMED.get(table)
            if renamed is None:
                con.register(table, store.dataset(table))
                continue
            # The files' columns as `_files_<table>`; the table's view takes a renamed column from its old name
            # where an older file has only that one.
            con.register(f"_files_{table}", store.dataset(table))
            columns = ", ".join(f'coalesce("{name}", "{renamed[name]}") AS "{name}"' if name in renamed
                                else f'"{name}"' for name in with_run_id(TABLES[table]).names)
            con.execute(f"CREATE VIEW {table} AS SELECT {columns} FROM _files_{table}")
        check_schema_version(con, store.uri)
        for sql in VIEWS.values():
            con.execute(sql)
        con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise scan_error(store, exc) from None
    except BaseException:
        con.close()
        raise
    return con


# Statements a query may run: reading only. Exports go through ``--out FILE``.
READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Refuse anything but SELECT (and EXPLAIN): no COPY, ATTACH, INSTALL, SET or DDL on the store's views."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise HeadsweepError(f"query failed: {str(exc).splitlines()[0]}") from None
    if not statements:
        raise HeadsweepError("query is empty (no SQL statement in it, only blanks, ';' or comments): give a SELECT, "
                             "e.g. \"SELECT * FROM runs\"")
    for statement in statements:
        if statement.type not in READ_ONLY:
            kind = statement.type.name.replace("_", " ")
            raise HeadsweepError(
                f"query is read-only: a {kind} statement is not allowed (only SELECT); "
                "to save a result use --out FILE with --format csv, json or parquet"
            )


def run_query(store: ResultStore, sql: str, params: list | None = None) -> pa.Table:
    """Run ``sql`` (SELECT only) against the store's views and return the result as an Arrow table.

    ``params`` fill the ``?`` placeholders of ``sql`` (values from users or data never go into the SQL text).
    Ctrl-C stops the query (KeyboardInterrupt), also while DuckDB is inside a long scan.
    """
    con = connect(store)
    try:
        check_read_only(con, sql)
        return interruptible(con, lambda: _arrow(con.sql(sql, params=params)))
    except duckdb.Error as exc:
        raise scan_error(store, exc) from None
    finally:
        with contextlib.suppress(duckdb.Error):  # a query that outlived its interrupt keeps the connection busy
            con.close()


def _arrow(relation: duckdb.DuckDBPyRelation | None) -> pa.Table:
    return relation.to_arrow_table() if relation is not None else pa.table({})


# How long a query may take to stop once DuckDB is told to (it checks between vectors: normally milliseconds).
INTERRUPT_GRACE_S = 10.0


def interruptible(con: duckdb.DuckDBPyConnection, work: Callable[[], T]) -> T:
    """``work()`` (queries on ``con``) in a worker thread; Ctrl-C interrupts it and raises KeyboardInterrupt.

    A query running inside DuckDB does not return to Python, so a KeyboardInterrupt raised in the thread that
    runs it may wait until the query ends. Here the main thread only waits, and takes the signal at once; it
    stops the query with the connection's ``interrupt()`` (DuckDB's documented way, safe from another thread).
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the main thread, which raises it
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="headsweep-query", daemon=True).start()
    # An Event, not Thread.join: a KeyboardInterrupt inside join() marks a still-running thread as ended (CPython
    # 3.11), and short waits, so that the main thread runs the signal handler promptly.
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        con.interrupt()
        done.wait(INTERRUPT_GRACE_S)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def scan_error(store: ResultStore, exc: duckdb.Error) -> HeadsweepError:
    """A DuckDB error as one line; one raised while scanning a damaged Parquet file names that file."""
    message = str(exc).splitlines()[0]
    if "Parquet" in message or "Arrow" in message or "IOError" in message:
        for table in TABLES:
            diagnosis = store.unreadable(table, exc)
            if " is not a readable Parquet file " in str(diagnosis):
                return diagnosis
    return HeadsweepError(f"query failed: {message}")


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
        raise HeadsweepError(f"unknown text format {fmt!r} (known: table, csv, json)")
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[_cell(r[n]) for n in names] for r in shown]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more rows")
    lines.append(f"({len(rows)} rows)")
    return "\n".join(lines)


def check_out(out: str | Path | None, store: ResultStore, what: str = "file") -> None:
    """Refuse an ``--out`` ``what`` (a file, or a folder: a report's, an exported model's) inside the store: in a
    table's folder it would be read as the table's data, and anywhere in the store it is no file of the store's
    own."""
    if not out or not store.local:
        return
    target = Path(out).expanduser().resolve()
    root = Path(store.root)
    if target == root or root in target.parents:
        raise HeadsweepError(f"--out {out} is inside the store {store.uri}, which holds only what headsweep runs "
                             f"write: give --out a {what} outside it")


def write_result(table: pa.Table, fmt: str, out: str | None) -> str | None:
    """Write a query result to ``out`` in ``fmt``, or return its text when ``out`` is None.

    Parquet is binary, so it goes to a file only.
    """
    if fmt not in FORMATS:
        raise HeadsweepError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "parquet":
        if not out:
            raise HeadsweepError("--format parquet writes a file: give --out FILE")
        try:
            pq.write_table(table, out, compression="zstd")
        except OSError as exc:
            raise HeadsweepError(f"cannot write {out}: {str(exc).splitlines()[0]}") from None
        return None
    text = format_table(table, fmt)
    if not out:
        return text
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        raise HeadsweepError(f"cannot write {out}: {exc.strerror}") from None
    return None
