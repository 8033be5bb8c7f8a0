"""The results store: one Parquet dataset per table, Hive-partitioned by ``run_id``.

Parquet has no transactions, so every file is written under a hidden temporary name
(readers skip names starting with ``.``) and renamed into place. Evaluations are written in
chunks: a chunk's ``examples`` file first, then its ``evaluations`` file under the same
name. The evaluations file is the commit record: an examples file without its evaluations
twin is the leftover of a crash and is removed when the run is resumed or finished.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from headsweep.errors import HeadsweepError
from headsweep.results.schema import TABLES, with_run_id

# The files the store writes: one partition folder per run, Parquet files with visible names.
_OWN_FILE = re.compile(r"run_id=[^/]+/[^./][^/]*\.parquet")
_warned: set[str] = set()
log = logging.getLogger("headsweep.results")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("headsweep: warning: %s", message)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise HeadsweepError(f"cannot open store {uri}: {str(exc).splitlines()[0]}") from None


class ResultStore:
    """Reads and writes the results tables under one URI (local path, ``s3://``, ...)."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.root = _filesystem(uri)

    # -- paths --------------------------------------------------------------------------
    def table_dir(self, table: str) -> str:
        return f"{self.root}/{table}"

    def partition_dir(self, table: str, run_id: str) -> str:
        return f"{self.root}/{table}/run_id={run_id}"

    # -- writing ------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Fail with a one-line error now rather than after hours of compute."""
        probe = f"{self.root}/.write-probe-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise HeadsweepError(f"store {self.uri} is not writable: {str(exc).splitlines()[0]}") from None

    def write(self, table: str, run_id: str, data: pa.Table, name: str | None = None) -> str:
        """Write ``data`` as one file of ``table`` in the run's partition, atomically."""
        schema = TABLES[table]
        data = data.select(schema.names).cast(schema)
        directory = self.partition_dir(table, run_id)
        self.fs.create_dir(directory, recursive=True)
        final = f"{directory}/{name or 'part-' + uuid.uuid4().hex}.parquet"
        tmp = f"{directory}/.{uuid.uuid4().hex}.tmp"
        pq.write_table(data, tmp, filesystem=self.fs, compression="zstd")
        self.fs.move(tmp, final)
        return final

    def write_rows(self, table: str, run_id: str, rows: list[dict], name: str | None = None) -> str:
        schema = TABLES[table]
        return self.write(table, run_id, pa.Table.from_pylist(rows, schema=schema), name)

    # -- reading ------------------------------------------------------------------------
    def files(self, table: str) -> list[str]:
        """The table's committed Parquet files: ``<table>/run_id=<id>/<name>.parquet``, hidden names excluded.

        Anything else under the table's folder (a ``NOTES.txt``, a stray folder) is not the store's
        own: it is skipped with one warning per file, never read as data.
        """
        directory = self.table_dir(table)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=True, allow_not_found=True))
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

    def dataset(self, table: str) -> ds.Dataset:
        """The table as a pyarrow dataset (with ``run_id``), empty if nothing is written yet."""
        schema = with_run_id(TABLES[table])
        files = self.files(table)
        if not files:
            return ds.dataset(schema.empty_table())
        return ds.dataset(
            files,
            filesystem=self.fs,
            format="parquet",
            schema=schema,
            partitioning=ds.partitioning(pa.schema([("run_id", pa.string())]), flavor="hive"),
            partition_base_dir=self.table_dir(table),
        )

    def read(self, table: str, run_id: str | None = None, columns: list[str] | None = None) -> pa.Table:
        dataset = self.dataset(table)
        flt = ds.field("run_id") == run_id if run_id is not None else None
        try:
            return dataset.to_table(columns=columns, filter=flt)
        except (OSError, pa.ArrowException) as exc:
            raise self.unreadable(table, exc) from None

    def unreadable(self, table: str, exc: BaseException) -> HeadsweepError:
        """The error for a table that failed to read: names the corrupt file when one is found."""
        for path in self.files(table):
            try:
                pq.read_metadata(path, filesystem=self.fs)
            except (OSError, pa.ArrowException) as bad:
                return HeadsweepError(
                    f"store {self.uri}: {path} is not a readable Parquet file ({str(bad).splitlines()[0]}); "
                    "it was damaged or not written by headsweep: move it out of the store, or restore it"
                )
        return HeadsweepError(f"cannot read table {table} of store {self.uri}: {str(exc).splitlines()[0]}")

    def run(self, run_id: str) -> dict | None:
        rows = self.read("runs", run_id).to_pylist()
        return rows[0] if rows else None

    def eval_ids(self, run_id: str) -> set[str]:
        return set(self.read("evaluations", run_id, columns=["eval_id"]).column("eval_id").to_pylist())

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
                    self.fs.delete_file(info.path)
                    removed += 1
        return removed
