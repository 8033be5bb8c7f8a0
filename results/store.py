"""The results store: one Parquet dataset per table, Hive-partitioned by ``run_id``.

Parquet has no transactions, so every file is written under a hidden temporary name
(readers skip names starting with ``.``) and renamed into place. Evaluations are written in
chunks: a chunk's ``examples`` file first, then its ``evaluations`` file under the same
name. The evaluations file is the commit record: an examples file without its evaluations
twin is the leftover of a crash and is removed when the run is resumed or finished.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.results.schema import RENAMED, TABLES, file_schema

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# The files the store writes: one partition folder per run, Parquet files with visible names.
_OWN_FILE = re.compile(r"run_id=[^/]+/[^./][^/]*\.parquet")
_warned: set[str] = set()
_READ_TRIES = 3
log = logging.getLogger("headsweep.results")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("headsweep: warning: %s", message)


# What a write meets when the store's file system is full, or a file would pass RLIMIT_FSIZE (ulimit -f).
FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class StoreFull(HeadsweepError):
    """The store's file system took no more: one line naming the store and the space a run still needs."""

    def __init__(self, uri: str, needed_bytes: int):
        self.uri = uri
        self.needed_bytes = needed_bytes
        super().__init__(f"store {uri} is full (or past a file-size limit): {mib(needed_bytes)} MiB more are "
                         "needed; free space and run the same command to resume")

    def needing(self, needed_bytes: int) -> StoreFull:
        """The same error with a larger estimate of the space needed (the rest of the run, not one file)."""
        return StoreFull(self.uri, max(self.needed_bytes, needed_bytes))


def os_reason(exc: OSError) -> str:
    """An OS error's reason in a few words (``Operation not permitted``); pyarrow's own text where it has no
    errno."""
    if exc.errno:
        return os.strerror(exc.errno)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class StoreUnwritable(HeadsweepError):
    """A write the store refused (not for want of space): one line naming the folder and the reason."""

    def __init__(self, uri: str, directory: str, exc: OSError):
        reason = os_reason(exc)
        super().__init__(f"store {uri}: cannot write into {directory} ({reason}); what was stored before stays: make "
                         "the store writable and run the same command again to continue the run")


def mib(n_bytes: int) -> int:
    """``n_bytes`` in whole MiB, rounded up: what to free is never understated."""
    return max(1, math.ceil(n_bytes / 2**20))


def _parquet_bytes(data: pa.Table) -> int:
    """The size of ``data`` as the store writes it (measured in memory)."""
    sink = pa.BufferOutputStream()
    pq.write_table(data, sink, compression="zstd")
    return sink.getvalue().size


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise HeadsweepError(f"cannot open store {uri}: {str(exc).splitlines()[0]}") from None


def schema_problem(table: str, schema: pa.Schema) -> str | None:
    """Why a file with ``schema`` is not one of ``table``'s files (None if it is): a column the table does not have,
    or has with another type (``run_id`` too: that is the folder's name, never a column of a file), or the table's
    first column (written since the table's first version) missing."""
    expected = file_schema(table)
    wrong = [f.name for f in schema if f.name == "run_id" or expected.get_field_index(f.name) < 0
             or not f.type.equals(expected.field(f.name).type)]
    if wrong:
        return (f"its column{'s' if len(wrong) > 1 else ''} {', '.join(wrong[:5])} {'are' if len(wrong) > 1 else 'is'} "
                "not the table's")
    first = TABLES[table].names[0]
    if first not in schema.names and RENAMED.get(table, {}).get(first) not in schema.names:
        return f"it has no column {first}"
    return None


class ResultStore:
    """Reads and writes the results tables under one URI (local path, ``s3://``, ...)."""

    def __init__(self, uri: str):
        if not uri.strip():
            raise HeadsweepError("--store is empty: give the store's folder or URI (default: $HEADSWEEP_STORE, else "
                                 "./headsweep-store)")
        self.uri = uri
        self.fs, self.root = _filesystem(uri)

    # -- paths --------------------------------------------------------------------------
    def table_dir(self, table: str) -> str:
        return f"{self.root}/{table}"

    def partition_dir(self, table: str, run_id: str) -> str:
        return f"{self.root}/{table}/run_id={run_id}"

    # -- writing ------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def _info(self, path: str, failure: str) -> pafs.FileInfo:
        """``path``'s info; ``failure`` starts the error line when the filesystem cannot be reached."""
        try:
            return self.fs.get_file_info(path)
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"{failure}: {str(exc).splitlines()[0]}") from None

    def check_exists(self) -> None:
        """Refuse a store URI where nothing is (a typo), a file is, or a folder that holds things but no table folder
        (a folder of data files): a reader would show nothing and say nothing. An empty folder is an empty store."""
        kind = self._info(self.root, f"cannot read store {self.uri}").type
        if kind == pafs.FileType.NotFound:
            raise HeadsweepError(f"no store at {self.uri}: nothing is there; give --store the folder a run wrote into "
                                 "(default: $HEADSWEEP_STORE, else ./headsweep-store)")
        if kind != pafs.FileType.Directory:
            raise HeadsweepError(f"no store at {self.uri}: it is a file, not a store folder; give --store the folder "
                                 "a run wrote into")
        entries = self._info_list(self.root)
        visible = [i for i in entries if not i.base_name.startswith(".")]
        if visible and not any(i.type == pafs.FileType.Directory and i.base_name in TABLES for i in visible):
            names = sorted(i.base_name for i in visible)
            shown = names[0] + (", ..." if len(names) > 1 else "")
            raise HeadsweepError(f"no store at {self.uri}: the folder holds {len(names)} "
                                 f"{'entries' if len(names) > 1 else 'entry'} ({shown}) but none of a store's table "
                                 "folders (runs/, evaluations/, ...); give --store the folder a run wrote into")

    def _info_list(self, folder: str) -> list[pafs.FileInfo]:
        try:
            return self.fs.get_file_info(pafs.FileSelector(folder))
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"cannot read store {self.uri}: {str(exc).splitlines()[0]}") from None

    def check_writable(self) -> None:
        """Fail with a one-line error now rather than after hours of compute, creating nothing: the store's folder
        is made by its first write, so a run refused before that leaves no empty folder behind."""
        kind = self._info(self.root, f"store {self.uri} is not writable").type
        if kind not in (pafs.FileType.Directory, pafs.FileType.NotFound):
            raise HeadsweepError(f"store {self.uri} is a file, not a folder: give --store a new folder or one a run "
                                 "wrote into")
        try:
            if kind == pafs.FileType.NotFound and self.local:
                self._check_creatable()
            else:
                self._probe()
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"store {self.uri} is not writable: {str(exc).splitlines()[0]}") from None

    def _probe(self) -> None:
        """Write and delete a hidden file in the store (object stores need no folder for it), and in each table
        folder a local store has: a run writes into all of them (one it cannot write, an immutable ``evaluations/``
        say, would fail the run after its first rows)."""
        self._probe_in(self.root)
        if not self.local:
            return
        for table in TABLES:
            directory = self.table_dir(table)
            if os.path.isdir(directory):
                try:
                    self._probe_in(directory)
                except OSError as exc:
                    raise HeadsweepError(f"store {self.uri} is not writable: its folder {table}/ takes no files "
                                         f"({os_reason(exc)}): make it writable (chmod, chattr -i) or run with "
                                         "another --store") from None

    def _probe_in(self, folder: str) -> None:
        probe = f"{folder}/.write-probe-{uuid.uuid4().hex}"
        try:
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
        except (OSError, pa.ArrowException):
            if self.local:
                raise
            # A filesystem with real folders (HDFS, ...): the store's folder first, as the first write would.
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
        self.fs.delete_file(probe)

    def _check_creatable(self) -> None:
        """A local store that does not exist yet: its nearest existing parent must be a folder that takes a new
        folder (made and removed again here)."""
        parent = Path(self.root).parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise HeadsweepError(f"store {self.uri} is not writable: {parent} is a file, not a folder")
        os.rmdir(tempfile.mkdtemp(prefix=".headsweep-probe-", dir=parent))

    def write(self, table: str, run_id: str, data: pa.Table, name: str | None = None) -> str:
        """Write ``data`` as one file of ``table`` in the run's partition, atomically."""
        schema = TABLES[table]
        data = data.select(schema.names).cast(schema)
        directory = self.partition_dir(table, run_id)
        final = f"{directory}/{name or 'part-' + uuid.uuid4().hex}.parquet"
        tmp = f"{directory}/.{uuid.uuid4().hex}.tmp"
        try:
            self.fs.create_dir(directory, recursive=True)
            pq.write_table(data, tmp, filesystem=self.fs, compression="zstd")
            self.fs.move(tmp, final)
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                # Permissions taken away mid-run, an immutable folder, a store gone read-only: the run stops here
                # with what it committed so far, resumable once the store takes files again.
                with contextlib.suppress(OSError):
                    self.fs.delete_file(tmp)
                raise StoreUnwritable(self.uri, directory, exc) from None
            # The partial file goes at once: it holds space the user is about to free, and nothing reads it.
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            raise StoreFull(self.uri, _parquet_bytes(data)) from None
        return final

    def write_rows(self, table: str, run_id: str, rows: list[dict], name: str | None = None) -> str:
        schema = TABLES[table]
        return self.write(table, run_id, pa.Table.from_pylist(rows, schema=schema), name)

    # -- reading ------------------------------------------------------------------------
    def files(self, table: str, run_id: str | None = None) -> list[str]:
        """The table's committed Parquet files (of one run's partition, or all): ``<table>/run_id=<id>/<name>.parquet``,
        hidden names excluded.

        Anything else under the table's folder (a ``NOTES.txt``, a stray folder) is not the store's own: it is
        skipped with one warning per file, never read as data. (:meth:`dataset` also skips a Parquet file there
        whose columns are not the table's.)
        """
        directory = self.table_dir(table)
        where = directory if run_id is None else self.partition_dir(table, run_id)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"cannot read store {self.uri}: {str(exc).splitlines()[0]}") from None
        own = []
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(directory) + 1:]
            if _OWN_FILE.fullmatch(relative):
                own.append(info.path)
            elif not any(part.startswith(".") for part in relative.split("/")):
                _warn_once(f"store {self.uri}: skipping {table}/{relative} (not a results file of this store)")
        return sorted(own)

    def dataset(self, table: str, run_id: str | None = None) -> ds.Dataset:
        """The table's files (of one run's partition, or all) as a pyarrow dataset (with ``run_id``), empty if
        nothing is written yet: what the query views scan.

        Its schema is ``file_schema``: a renamed column comes with its old name beside it (older files fill
        that one); :meth:`read` and the query views merge the two. A Parquet file whose columns are not the
        table's (another tool's, a query's export) is skipped with one warning naming it, never read as rows of
        nulls. Each footer is read once here and kept by the dataset for its scan; a file whose footer cannot be
        read stays, so that reading it fails with the line naming it (:meth:`unreadable`).
        """
        # pyarrow.dataset imports pandas (0.25-0.5 s): only the commands that query import it, never a run's driver.
        import pyarrow.dataset as ds

        schema = file_schema(table)
        files = self.files(table, run_id)
        if not files:
            return ds.dataset(schema.empty_table())
        dataset = self._dataset(table, files)
        foreign = set()
        for fragment in dataset.get_fragments():
            try:
                physical = fragment.physical_schema
            except (OSError, pa.ArrowException):
                continue
            if self._foreign(table, fragment.path, physical):
                foreign.add(fragment.path)
        if not foreign:
            return dataset
        kept = [f for f in files if f not in foreign]
        return self._dataset(table, kept) if kept else ds.dataset(schema.empty_table())

    def _dataset(self, table: str, files: list[str]) -> ds.Dataset:
        import pyarrow.dataset as ds

        return ds.dataset(
            files,
            filesystem=self.fs,
            format="parquet",
            schema=file_schema(table),
            partitioning=ds.partitioning(pa.schema([("run_id", pa.string())]), flavor="hive"),
            partition_base_dir=self.table_dir(table),
        )

    def _foreign(self, table: str, path: str, physical: pa.Schema) -> bool:
        """Whether the file at ``path`` is not one of ``table``'s files (warned about once, by name)."""
        problem = schema_problem(table, physical)
        if problem is not None:
            relative = path[len(self.table_dir(table)) + 1:]
            _warn_once(f"store {self.uri}: skipping {table}/{relative} (not a file of table {table}: {problem})")
        return problem is not None

    def _read_files(self, table: str, run_id: str | None, columns: list[str] | None) -> pa.Table:
        """The rows of the table's files in :meth:`files`'s order, each conformed to ``file_schema`` (``columns``
        of it): what :meth:`dataset` would scan, read file by file with the Parquet reader alone."""
        schema = file_schema(table)
        target = schema if columns is None else pa.schema([schema.field(name) for name in columns])
        parts = []
        for path in self.files(table, run_id):
            with self.fs.open_input_file(path) as source:
                parquet = pq.ParquetFile(source)
                physical = parquet.schema_arrow
                if self._foreign(table, path, physical):
                    continue
                data = parquet.read(columns=[n for n in target.names if n in physical.names], use_threads=False)
            run = path[len(self.table_dir(table)) + 1:].split("/", 1)[0].removeprefix("run_id=")
            parts.append(pa.table([
                pa.array([run] * data.num_rows, pa.string()) if field.name == "run_id"
                else data.column(field.name).cast(field.type) if field.name in data.column_names
                else pa.nulls(data.num_rows, field.type)
                for field in target], schema=target))
        return pa.concat_tables(parts) if parts else target.empty_table()

    def read(self, table: str, run_id: str | None = None, columns: list[str] | None = None) -> pa.Table:
        """The table's rows (of one run, or all), with today's columns: a renamed column is read from its old
        name in files written before the rename."""
        renamed = RENAMED.get(table, {})
        wanted = columns
        if columns is not None:
            columns = [*columns, *(old for new, old in renamed.items() if new in columns)]
        for attempt in range(_READ_TRIES):
            try:
                data = self._read_files(table, run_id, columns)
                break
            except (OSError, pa.ArrowException) as exc:
                # Other drivers write the store meanwhile: a run's row file is replaced, a resumed run's crash
                # leftovers removed, so a file listed a moment ago may be gone or another by the time it is read.
                # Listed again it reads; a damaged file fails every time and is named.
                if attempt == _READ_TRIES - 1:
                    raise self.unreadable(table, exc) from None
                time.sleep(0.1 * (attempt + 1))
        for new, old in renamed.items():
            if old in data.column_names:
                if new in data.column_names:
                    merged = pc.coalesce(data.column(new), data.column(old))
                    data = data.set_column(data.column_names.index(new), new, merged)
                data = data.drop_columns([old])
        return data if wanted is None else data.select(wanted)

    def unreadable(self, table: str, exc: BaseException) -> HeadsweepError:
        """The error for a table that failed to read: names the corrupt file when one is found."""
        for path in self.files(table):
            try:
                pq.read_metadata(path, filesystem=self.fs)
            except (OSError, pa.ArrowException) as bad:
                return HeadsweepError(self._damaged(path, bad))
        return HeadsweepError(f"cannot read table {table} of store {self.uri}: {str(exc).splitlines()[0]}")

    def _damaged(self, path: str, exc: BaseException) -> str:
        return (f"store {self.uri}: {path} is not a readable Parquet file ({str(exc).splitlines()[0]}); "
                "it was damaged or not written by headsweep: move it out of the store, or restore it")

    def check_files(self) -> None:
        """Before a run adds to the store: every Parquet file in it is a readable file of its table.

        A damaged file, or another tool's Parquet file where a table's files go, would make every later query
        fail or read it as data; a run refuses such a store up front (one line naming the file) instead of
        writing beside it. Files of other kinds (notes) and hidden files are left alone.
        """
        if self._info(self.root, f"cannot read store {self.uri}").type != pafs.FileType.Directory:
            return
        try:
            top = self.fs.get_file_info(pafs.FileSelector(self.root))
            foreign = [i.path for i in top if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                       and not i.base_name.startswith(".")]
            own: list[tuple[str, str]] = []
            for table in TABLES:
                directory = self.table_dir(table)
                selector = pafs.FileSelector(directory, recursive=True, allow_not_found=True)
                for info in self.fs.get_file_info(selector):
                    relative = info.path[len(directory) + 1:]
                    if info.type != pafs.FileType.File or any(p.startswith(".") for p in relative.split("/")):
                        continue
                    if _OWN_FILE.fullmatch(relative):
                        own.append((table, info.path))
                    elif relative.endswith(".parquet"):
                        foreign.append(info.path)
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"cannot read store {self.uri}: {str(exc).splitlines()[0]}") from None
        if foreign:
            raise HeadsweepError(
                f"store {self.uri} holds {foreign[0]}, a Parquet file headsweep did not write (a table's files are "
                "<store>/<table>/run_id=<id>/<name>.parquet): move it out of the store, or run with another --store"
            )
        with ThreadPoolExecutor(max_workers=16) as pool:  # one footer read each: round trips on an object store
            problems = pool.map(lambda item: self._file_problem(*item), own)
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise HeadsweepError(problem)

    def _file_problem(self, table: str, path: str) -> str | None:
        """Why ``path`` is not a readable file of ``table`` (its footer and columns), or None."""
        try:
            schema = pq.read_schema(path, filesystem=self.fs)
        except (OSError, pa.ArrowException) as exc:
            return self._damaged(path, exc)
        problem = schema_problem(table, schema)
        if problem is not None:
            return f"store {self.uri}: {path} is not a file of table {table} ({problem}); it was not written by " \
                   "headsweep: move it out of the store"
        return None

    def run(self, run_id: str) -> dict | None:
        rows = self.read("runs", run_id).to_pylist()
        return rows[0] if rows else None

    def eval_ids(self, run_id: str) -> set[str]:
        return set(self.read("evaluations", run_id, columns=["eval_id"]).column("eval_id").to_pylist())

    def run_bytes(self, run_id: str) -> int:
        """Bytes the run's committed files take in the store, over every table."""
        total = 0
        for table in TABLES:
            selector = pafs.FileSelector(self.partition_dir(table, run_id), allow_not_found=True)
            total += sum(i.size or 0 for i in self.fs.get_file_info(selector)
                         if i.type == pafs.FileType.File and not i.base_name.startswith("."))
        return total

    # -- crash leftovers ------------------------------------------------------------------
    def _chunk_names(self, table: str, run_id: str) -> set[str]:
        selector = pafs.FileSelector(self.partition_dir(table, run_id), allow_not_found=True)
        return {os.path.basename(i.path) for i in self.fs.get_file_info(selector) if i.path.endswith(".parquet")}

    def remove_orphans(self, run_id: str) -> int:
        """Delete examples chunks whose evaluations chunk never landed, and stale temp files."""
        committed = self._chunk_names("evaluations", run_id)
        removed = 0
        for table in TABLES:
            selector = pafs.FileSelector(self.partition_dir(table, run_id), allow_not_found=True)
            for info in self.fs.get_file_info(selector):
                base = os.path.basename(info.path)
                stale_tmp = base.startswith(".") and base.endswith(".tmp")
                orphan = table == "examples" and base.startswith("chunk-") and base not in committed
                if stale_tmp or orphan:
                    try:
                        self.fs.delete_file(info.path)
                    except OSError as exc:
                        raise StoreUnwritable(self.uri, os.path.dirname(info.path), exc) from None
                    removed += 1
        return removed
