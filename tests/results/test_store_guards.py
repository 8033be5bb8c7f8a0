"""The store against foreign and damaged files, and queries that try to write: one line, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import error_line, run_cli
from small_store import small_store


@pytest.fixture(scope="module")
def small(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    return small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)


@pytest.fixture
def store(small, tmp_path) -> Path:
    """A private copy of the session's small store, free to damage."""
    copy = tmp_path / "store"
    shutil.copytree(small[0], copy)
    return copy


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_failure(proc, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""
    line = error_line(proc.stderr)
    for fragment in fragments:
        assert fragment in line, line
    return line


def test_stray_file_is_skipped_with_a_warning(store, small):
    (store / "runs" / "NOTES.txt").write_text("my notes about these runs\n")
    (store / "evaluations" / "README").write_text("not data\n")
    before = listing(store)
    proc = run_cli("runs", "--store", str(store), "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert small[1] in proc.stdout
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")]
    assert any("runs/NOTES.txt" in w for w in warnings) and any("evaluations/README" in w for w in warnings)
    assert "Traceback" not in proc.stderr
    proc = run_cli("query", "SELECT count(*) AS n FROM evaluations", "--store", str(store), "--format", "csv")
    assert proc.returncode == 0 and int(proc.stdout.split()[1]) > 0, proc.stderr
    assert listing(store) == before


def test_corrupt_run_file_is_named(store):
    [run_file] = (store / "runs").rglob("*.parquet")
    run_file.write_bytes(run_file.read_bytes()[:40])  # a truncated copy
    before = listing(store)
    for args in (["runs"], ["query", "SELECT * FROM runs"]):
        proc = run_cli(*args, "--store", str(store))
        assert_one_line_failure(proc, str(run_file.relative_to(store)), "not a readable Parquet file")
    assert listing(store) == before


def test_corrupt_evaluations_chunk_does_not_stop_queries_that_do_not_read_it(store, small):
    chunk = sorted((store / "evaluations").rglob("*.parquet"))[0]
    chunk.write_bytes(b"PAR1 this is not parquet")
    proc = run_cli("query", "SELECT run_id, status FROM runs", "--store", str(store), "--format", "csv")
    assert proc.returncode == 0 and small[1] in proc.stdout, proc.stderr
    proc = run_cli("query", "SELECT count(*) FROM evaluations", "--store", str(store))
    assert_one_line_failure(proc, chunk.name, "not a readable Parquet file")


def test_status_and_report_name_a_damaged_chunk_of_the_run(store, small, tmp_path):
    """The commands that read one run give the line every reading command gives for a file of that run's that is
    not Parquet, and write nothing (no report folder either)."""
    chunk = sorted((store / "evaluations" / f"run_id={small[1]}").glob("*.parquet"))[0]
    chunk.write_bytes(chunk.read_bytes()[:60])  # a truncated copy, as a full disk or a killed copy leaves it
    before = listing(store)
    for args in (["status", small[1]], ["report", small[1], "--out", str(tmp_path / "report")]):
        proc = run_cli(*args, "--store", str(store))
        assert_one_line_failure(proc, str(chunk), "is not a readable Parquet file", "move it out of the store")
    assert listing(store) == before and not (tmp_path / "report").exists()


@pytest.mark.parametrize("sql, kind", [
    ("COPY (SELECT 1 AS x) TO '{store}/runs/junk.parquet' (FORMAT parquet)", "COPY"),
    ("DROP VIEW runs", "DROP"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("ATTACH '{store}/x.duckdb' AS x", "ATTACH"),
    ("INSTALL httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("SELECT 1; DROP VIEW heads", "DROP"),
])
def test_queries_cannot_write_into_the_store(store, sql, kind):
    before = listing(store)
    proc = run_cli("query", sql.format(store=store), "--store", str(store))
    assert_one_line_failure(proc, "read-only", kind)
    assert listing(store) == before


def test_queries_cannot_read_or_write_other_files(store, tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    proc = run_cli("query", f"SELECT * FROM read_csv('{secret}')", "--store", str(store))
    assert_one_line_failure(proc, "query failed")
    proc = run_cli("query", "SELECT count(*) AS n FROM heads", "--store", str(store), "--format", "csv")
    assert proc.returncode == 0 and int(proc.stdout.split()[1]) > 0
