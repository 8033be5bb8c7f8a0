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
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.results.outputs import Output, written_file
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


# DuckDB's own memory (its default is 80% of the machine's): sorts, joins and aggregates past it spill to a scratch
# folder, and results leave in batches of BATCH_ROWS, so a query's memory is bounded whatever it reads.
QUERY_MEMORY = "1GB"
BATCH_ROWS = 8192
# The most rows an aligned table holds (it is measured whole before the first line): more go to a file (--out) or
# as CSV / JSON lines, which stream.
TABLE_ROWS = 10_000
# A Parquet result's row groups: batches are gathered up to this size (each batch its own group makes files twice as
# large and slow to read).
ROW_GROUP_BYTES = 64 * 2**20


def _scratch() -> str:
    """Where DuckDB spills: a folder of its own in the system's temporary folder (never the store), which DuckDB
    makes only when it spills and removes when the connection closes."""
    return str(Path(tempfile.gettempdir()) / f"headsweep-query-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def connect(store: ResultStore) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view named after each results table, plus the derived views.

    The connection cannot touch files (``enable_external_access`` off, configuration locked): the
    tables are Arrow datasets read by pyarrow, so a query can read the store but never write into it,
    attach databases or install extensions. Its memory is bounded (``QUERY_MEMORY``; it spills to a scratch
    folder outside the store).
    """
    con = duckdb.connect(config={"enable_external_access": False, "memory_limit": QUERY_MEMORY,
                                 "temp_directory": _scratch()})
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
    """Refuse anything but one SELECT (or EXPLAIN): no COPY, ATTACH, INSTALL, SET or DDL on the store's views, and
    no second statement (whose result alone DuckDB would return)."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise HeadsweepError(f"query failed: {one_line(exc)}") from None
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
    if len(statements) > 1:
        raise HeadsweepError(f"query holds {len(statements)} statements and headsweep query answers one: give one "
                             "SELECT per command (a ';' ends the statement)")


def run_query(store: ResultStore, sql: str, params: list | None = None) -> pa.Table:
    """Run ``sql`` (SELECT only) against the store's views and return the result as an Arrow table.

    ``params`` fill the ``?`` placeholders of ``sql`` (values from users or data never go into the SQL text).
    Ctrl-C stops the query (KeyboardInterrupt), also while DuckDB is inside a long scan. For results of any size,
    :func:`consume_query` hands them over in batches instead.
    """
    return consume_query(store, sql, lambda reader: reader.read_all(), params)


def consume_query(store: ResultStore, sql: str, consume: Callable[[pa.RecordBatchReader], T],
                  params: list | None = None) -> T:
    """Run ``sql`` (SELECT only) and return ``consume(reader)``, ``reader`` yielding the result in batches of
    ``BATCH_ROWS`` rows while DuckDB computes them; interruptible as :func:`run_query` is."""
    con = connect(store)
    try:
        check_read_only(con, sql)
        return interruptible(con, lambda: consume(_reader(con.sql(sql, params=params))))
    except (duckdb.Error, pa.ArrowException) as exc:
        raise scan_error(store, exc) from None
    finally:
        with contextlib.suppress(duckdb.Error):  # a query that outlived its interrupt keeps the connection busy
            con.close()


def _reader(relation: duckdb.DuckDBPyRelation | None) -> pa.RecordBatchReader:
    if relation is None:
        return pa.table({}).to_reader()
    return relation.to_arrow_reader(BATCH_ROWS)


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


def one_line(exc: BaseException) -> str:
    """An error's whole message on one line: DuckDB's spans several (its hints, the cause after a colon), and the
    query echoed with a caret under the culprit, which is left out."""
    lines = [x.strip() for x in str(exc).splitlines()]
    kept = [x for x in lines if x and not x.startswith("LINE ") and set(x) != {"^"}]
    return " ".join(kept) or type(exc).__name__


def scan_error(store: ResultStore, exc: BaseException) -> HeadsweepError:
    """A DuckDB (or Arrow) error as one line; one raised while scanning a damaged Parquet file names that file."""
    message = one_line(exc)
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


def text_lines(data: pa.Table | pa.RecordBatch, fmt: str, header: bool = True) -> list[str]:
    """``data``'s rows as CSV lines (``header``: the column names first) or JSON lines, one per row."""
    rows = data.to_pylist()
    if fmt == "json":
        return [json.dumps(r, default=str) for r in rows]
    names = data.schema.names
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(names)
    for r in rows:
        writer.writerow([_cell(r[n]) for n in names])
    return out.getvalue().split("\n")[:-1]


def format_table(table: pa.Table, fmt: str = "table", max_rows: int | None = None) -> str:
    """Render a query result as an aligned text table, CSV or JSON lines."""
    if fmt in ("json", "csv"):
        return "\n".join(text_lines(table, fmt))
    if fmt != "table":
        raise HeadsweepError(f"unknown text format {fmt!r} (known: table, csv, json)")
    rows = table.to_pylist()
    names = table.column_names
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[_cell(r[n]) for n in names] for r in shown]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more rows")
    lines.append(f"({len(rows)} rows)")
    return "\n".join(lines)


def check_format(fmt: str, out: Output | None) -> None:
    """Refuse an unknown format, or parquet without a file, before the query runs."""
    if fmt not in FORMATS:
        raise HeadsweepError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "parquet" and out is None:
        raise HeadsweepError("--format parquet writes a file: give --out FILE")


def write_result(reader: pa.RecordBatchReader, fmt: str, out: Output | None,
                 show: Callable[[str], None] | None = None) -> None:
    """Write a query result, batch by batch, to ``out`` (checked by :func:`headsweep.results.outputs.check_output`)
    in ``fmt``, or hand its text to ``show`` (the terminal) when ``out`` is None. CSV and JSON lines stream; an
    aligned table holds at most ``TABLE_ROWS`` rows and is refused past them; Parquet goes to a file only."""
    check_format(fmt, out)
    if out is None:
        assert show is not None
        for text in _text_chunks(reader, fmt):
            show(text)
        return
    try:
        with written_file(out) as tmp:
            if fmt == "parquet":
                _write_parquet(reader, tmp)
                return
            with open(tmp, "w", encoding="utf-8") as f:
                for text in _text_chunks(reader, fmt):
                    f.write(text + "\n")
    except OSError as exc:
        raise HeadsweepError(f"cannot write {out.named}: {exc.strerror or one_line(exc)}") from None


def _text_chunks(reader: pa.RecordBatchReader, fmt: str) -> Iterator[str]:
    """The result as text, a chunk per batch (CSV with its header first, JSON lines), or one aligned table; a result
    of no batch at all is its header alone, as for an empty table."""
    if fmt == "table":
        yield format_table(_table_rows(reader))
        return
    header = fmt == "csv"
    for batch in reader:
        lines = text_lines(batch, fmt, header)
        header = False
        if lines:
            yield "\n".join(lines)
    if header:
        yield "\n".join(text_lines(reader.schema.empty_table(), fmt, True))


def _write_parquet(reader: pa.RecordBatchReader, path: Path) -> None:
    """The batches as one Parquet file, in row groups of about ``ROW_GROUP_BYTES`` (not one per batch)."""
    with pq.ParquetWriter(path, reader.schema, compression="zstd") as writer:
        pending: list[pa.RecordBatch] = []
        size = 0
        for batch in reader:
            pending.append(batch)
            size += batch.nbytes
            if size >= ROW_GROUP_BYTES:
                writer.write_table(pa.Table.from_batches(pending), row_group_size=sum(b.num_rows for b in pending))
                pending, size = [], 0
        if pending:
            writer.write_table(pa.Table.from_batches(pending), row_group_size=sum(b.num_rows for b in pending))


def _table_rows(reader: pa.RecordBatchReader) -> pa.Table:
    """The result whole, for an aligned table; refused past ``TABLE_ROWS`` rows (never held beyond them)."""
    batches, n = [], 0
    for batch in reader:
        batches.append(batch)
        n += batch.num_rows
        if n > TABLE_ROWS:
            raise HeadsweepError(f"the result has more than {TABLE_ROWS} rows, more than a table on the terminal "
                                 "shows: write it with --out FILE (--format csv, json or parquet), stream it with "
                                 "--format csv or json, or add a LIMIT")
    return pa.Table.from_batches(batches, schema=reader.schema)
