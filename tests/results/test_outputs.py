"""Outputs a user names, queries of any size, and reading a store with foreign files, through the real CLI.

The store is ``tests/data/store_v1`` (three complete runs, written once by an older release), copied per test: no
sweep runs here.

- ``--out`` (report, query, runs, export): a folder or file that exists and that headsweep did not write is refused
  in one line (exit 2, nothing changed) unless ``--force``; ``--force`` writes beside a user's files and never over
  one of them, nor over the model an export reads; a report replaces its own earlier report (and keeps one-run
  reports in its folder). ``submit --store`` (a path on the cluster) makes no folder on this machine.
- Queries: a result streams to ``--out`` in batches (peak memory measured), a table past the terminal's rows, several
  statements, non-UTF-8 text are refused in one line; DuckDB's message is shown whole.
- A Parquet file in a table's run partition with other columns is skipped with one warning naming it: every
  reading command answers as for the clean store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, run_cli
from test_store_probe import refused, snapshot

from headsweep.results.outputs import MARKER
from headsweep.results.store import ResultStore

STORE_V1 = Path(__file__).resolve().parents[1] / "data" / "store_v1"
CLASSIFIER, TRANSLATION, GLOBAL = "20261122-180235-883e36", "20261122-180259-b00d8e", "20261122-180323-e73df3"


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture
def store(tmp_path) -> Path:
    return shutil.copytree(STORE_V1, tmp_path / "store")


def test_report_never_replaces_a_users_files(store, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "index.html").write_text("my page\n")
    before = snapshot(tmp_path)
    for out in (mine, clash):
        refused(run_cli("report", GLOBAL, "--store", str(store), "--out", str(out)),
                f"--out {out} holds 1 file headsweep did not write", "add --force to write beside them")
    assert snapshot(tmp_path) == before
    # --force: written beside the user's file, which stays; one of theirs by the name of one of headsweep's stays too
    assert ok(run_cli("report", GLOBAL, "--store", str(store), "--out", str(mine), "--force")).strip() == \
        str(mine / "index.html")
    assert (mine / "notes.txt").read_text() == "my notes\n"
    listed = json.loads((mine / MARKER).read_text())["files"]
    assert "index.html" in listed and f"{GLOBAL}-config.yaml" in listed and "notes.txt" not in listed
    refused(run_cli("report", GLOBAL, "--store", str(store), "--out", str(clash), "--force"),
            f"--out {clash} holds index.html, which headsweep did not write and would replace")
    assert snapshot(clash) == {"index.html": b"my page\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash", "mine", "store"]  # nothing left beside them


def test_a_report_replaces_its_own_and_keeps_one_run_reports_in_its_folder(store, tmp_path):
    """The default folders: ./headsweep-report/RUN for one run, ./headsweep-report for several. An earlier report
    (its marker lists its files) is replaced without --force; the one-run report in a sub-folder stays."""
    reports = tmp_path / "headsweep-report"
    one = reports / CLASSIFIER
    one.mkdir(parents=True)
    (one / "index.html").write_text("the classifier's report\n")
    (one / MARKER).write_text(json.dumps({"written_by": "headsweep report", "files": ["index.html"]}))
    (reports / "old-figure.png").write_bytes(b"png")
    (reports / MARKER).write_text(json.dumps({"written_by": "headsweep report", "files": ["old-figure.png"]}))
    kept = snapshot(one)
    ok(run_cli("report", TRANSLATION, GLOBAL, "--store", str(store), "--out", str(reports)))
    assert snapshot(one) == kept and not (reports / "old-figure.png").exists()
    assert f"{GLOBAL}-config.yaml" in json.loads((reports / MARKER).read_text())["files"]
    assert (reports / f"{GLOBAL}-config.yaml").is_file()


def test_query_and_runs_out_refuse_an_existing_file_unless_force(store, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("years of work\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    before = snapshot(tmp_path)
    refused(run_cli("query", "SELECT 1 AS x", "--format", "csv", "--store", str(store), "--out", str(precious)),
            f"--out {precious} exists and headsweep cannot tell whether it wrote it", "add --force")
    refused(run_cli("runs", "--format", "parquet", "--store", str(store), "--out", str(folder)),
            f"--out {folder} is a folder")
    assert snapshot(tmp_path) == before
    ok(run_cli("query", "SELECT 7 AS x", "--format", "csv", "--store", str(store), "--out", str(precious), "--force"))
    assert precious.read_text() == "x\n7\n"


def test_export_never_writes_over_the_model_it_reads_or_a_users_files(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    model = shutil.copytree(tiny_bert_dir, tmp_path / "models" / "bert")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(model)},
                                      "data": {"path": str(tiny_dev_tsv)}}))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    export = ("export", str(config), "--mask", "self:0:1", "--store", str(tmp_path / "no-store"))
    for out in (model, model.parent):
        refused(run_cli(*export, "--out", str(out), "--force"), f"--out {out} is (or holds) {model}, which this "
                "command reads", "--force never replaces what a command reads")
    refused(run_cli(*export, "--out", str(mine), "--force"), "holds config.json, which headsweep did not write")
    assert snapshot(tmp_path) == before
    (mine / "config.json").rename(mine / "notes.json")
    ok(run_cli(*export, "--out", str(mine), "--force"))
    assert (mine / "notes.json").read_text() == "{}" and (mine / "model.safetensors").is_file()
    assert json.loads((mine / "headsweep-export.json").read_text())["heads_removed"] == ["self:0:1"]
    assert snapshot(model) == {k[len("models/bert/"):]: v for k, v in before.items() if k.startswith("models/bert/")}


def test_submit_makes_no_folder_beside_a_cluster_path(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                                      "data": {"path": str(tiny_dev_tsv)}}))
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    refused(run_cli("submit", str(config), "--store", str(cluster / "store"), "--address", "http://127.0.0.1:9"),
            "cannot reach the Ray job API")
    assert list(cluster.iterdir()) == []  # before: cluster/headsweep-logs, the log folder beside a local store


BAD = b"\xff\xfe"


@pytest.mark.parametrize("args, fragments", [
    (["query", "SELECT 1; SELECT 2"], ["query holds 2 statements", "give one SELECT per command"]),
    (["query", "SELECT * FROM sqlite_scan('x.db', 't')"],
     ["required extension 'sqlite_scanner: Cannot access directory", "file system operations are disabled"]),
    (["query", "SELECT nosuch FROM runs"], ['Referenced column "nosuch" not found', "Candidate bindings:"]),
    (["query", "SELECT * FROM range(10001) t(i)"], ["more than 10000 rows", "--out FILE"]),
    (["query", b"SELECT '" + BAD + b"'"], ["the SQL is not valid UTF-8 text", "give it in UTF-8"]),
    (["runs", "--store", b"store" + BAD], ["--store is not valid UTF-8 text"]),
    (["status", CLASSIFIER, "--store", ""], ["--store is empty"]),
    (["query", "SELECT 1", "--store", "tsv"], ["no store at", "none of a store's table folders"]),
    (["runs", "--store", "tsv"], ["no store at", "none of a store's table folders"]),
])
def test_query_refusals_are_one_line(store, tmp_path, args, fragments):
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    before = snapshot(tmp_path)
    if "--store" not in args:
        args = [*args, "--store", str(store)]
    # bytes as the shell passes them: Python keeps what is not UTF-8 as surrogates
    argv = [a if isinstance(a, bytes) else a.encode() for a in args]
    proc = subprocess.run([sys.executable.encode(), b"-m", b"headsweep", *argv], capture_output=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    line = refused(proc, *fragments)
    assert "\n" not in line
    assert snapshot(tmp_path) == before


def peak_rss_mib(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a child of a fresh Python process that reports the child's peak resident memory."""
    probe = ("import resource, subprocess, sys; p = subprocess.run([sys.executable, '-m', 'headsweep', *sys.argv[1:]]);"
             " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024); sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=REPO)
    return proc, int(proc.stdout.split()[-1])


def test_a_large_result_streams_to_out_in_bounded_memory(store, tmp_path):
    """500 MB of rows written with the resident memory of a few batches (about 330 MiB here, where holding the
    result took 700 MiB for Parquet and 2.5 GB for CSV)."""
    out = tmp_path / "wide.parquet"
    proc, peak = peak_rss_mib("query", "SELECT i, repeat('x', 2000) || i AS s FROM range(250000) t(i)",
                              "--store", str(store), "--format", "parquet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pq.read_table(out)
    assert table.num_rows == 250_000 and pa.compute.sum(table.column("i")).as_py() == 250_000 * 249_999 // 2
    assert table.column("s")[7].as_py() == "x" * 2000 + "7"
    assert peak < 480, peak
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "wide.parquet"]  # no scratch or temp file left


def test_a_foreign_parquet_file_in_a_partition_is_skipped_by_every_reader(store, tmp_path):
    clean = shutil.copytree(store, tmp_path / "clean")
    foreign = {
        f"runs/run_id={CLASSIFIER}/x.parquet": pa.table({"a": [1, 2], "b": ["x", "y"]}),
        # run-like columns under a new partition: no phantom run
        "runs/run_id=20270101-000000-phantom/y.parquet": pa.table({"status": ["complete"], "name": ["ghost"]}),
        f"evaluations/run_id={CLASSIFIER}/z.parquet": pa.table({"a": [1]}),
    }
    for relative, table in foreign.items():
        (store / relative).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, store / relative)
    def warned(proc: subprocess.CompletedProcess, *relatives: str) -> None:
        warnings = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")]
        for relative in relatives:
            table = relative.split("/")[0]
            assert sum(f"skipping {relative} (not a file of table {table}:" in w for w in warnings) == 1, warnings

    clean_store = ResultStore(str(clean))
    proc = run_cli("runs", "--format", "json", "--store", str(store))
    runs = [json.loads(x) for x in ok(proc).splitlines()]
    warned(proc, *foreign)
    assert sorted(r["run_id"] for r in runs) == sorted([CLASSIFIER, TRANSLATION, GLOBAL])
    assert all(r["name"] and r["model"] and r["n_done"] for r in runs), runs
    status = ok(proc := run_cli("status", CLASSIFIER, "--store", str(store)))
    warned(proc, *(r for r in foreign if CLASSIFIER in r))  # status reads its run's partitions
    assert status.startswith(f"run {CLASSIFIER} (v1-classifier): complete\nmodel bert-b, data dev, metric accuracy")
    n = clean_store.read("evaluations").num_rows
    counts = ok(run_cli("query", "SELECT count(*) AS n, count(eval_id) AS e FROM evaluations", "--format", "csv",
                        "--store", str(store)))
    assert counts == f"n,e\n{n},{n}\n"
    compare = ("compare", TRANSLATION, GLOBAL, "--format", "csv")
    assert ok(run_cli(*compare, "--store", str(store))) == ok(run_cli(*compare, "--store", str(clean)))
    page = Path(ok(run_cli("report", CLASSIFIER, "--store", str(store), "--out", str(tmp_path / "r"))).strip())
    assert f"headsweep report: v1-classifier ({CLASSIFIER})" in page.read_text()
