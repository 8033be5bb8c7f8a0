"""The results store's part of the bad-input probe, through the real CLI.

- Significance: with ``significance.tests`` lacking the metric's primary test, the views, ``runs``, ``status`` and
  the report show the test the run computed (the first it names), equal to the ``significance`` table.
- A run stopped by ``sweep.budget`` or Ctrl-C keeps its stored baseline in ``runs.baseline_score``; a row
  written when a run ends holds no live ``progress``.
- Refused: ``--out`` inside the store (query, runs, report, export), a ``--store`` where nothing (or a file)
  is, a run into a store holding a foreign or damaged Parquet file; a refused run leaves the store as it was
  (no empty folder).
- Ctrl-C stops a query running inside DuckDB, every time.
- ``gates.lambda`` is ``l0_lambda`` (schema 8); files written before read as such.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, default_sigint, error_line, folder_taking_no_files, run_cli, sweep_in_process

from headsweep.errors import HeadsweepError
from headsweep.results.schema import COMPLETE, RUNNING, TABLES
from headsweep.results.store import ResultStore

STORE_V1 = Path(__file__).resolve().parents[1] / "data" / "store_v1"
V1_CLASSIFIER, V1_TRANSLATION = "20261122-180235-883e36", "20261122-180259-b00d8e"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``: equal snapshots mean nothing was written."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2 with one ``headsweep: error:`` line holding ``fragments``, nothing on stdout, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    line = error_line(proc.stderr)
    for fragment in fragments:
        assert fragment in line, line
    return line


def config(model_dir: Path, data: Path, tests: list[str] | None = None, **sweep) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
            "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 20, "workers": 1, **sweep},
            "significance": {"tests": tests, "alpha": 0.4, "correction": "none", "n_resamples": 200, "seed": 5}}


def run(folder: Path, name: str, cfg: dict, store: Path, ray_address: str) -> subprocess.CompletedProcess:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return run_cli("run", str(path), "--store", str(store), "--address", ray_address, "--quiet")


@pytest.fixture(scope="module")
def sig_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv) -> tuple[Path, dict[str, str]]:
    """Two complete runs without the accuracy's primary test (paired_ttest): ``[mcnemar_exact]`` alone, and
    ``[paired_bootstrap, mcnemar_exact]`` (shown: paired_bootstrap, the first named, not the first by name).
    Run in this process: the tests read them through the CLI."""
    tmp = tmp_path_factory.mktemp("probe")
    store = tmp / "store"
    shown = {}
    for name, tests in (("mcnemar", ["mcnemar_exact"]), ("bootstrap_first", ["paired_bootstrap", "mcnemar_exact"])):
        run_id = sweep_in_process(config(tiny_bert_dir, tiny_dev_tsv, tests), tmp, name, store, ray_address)
        shown[run_id] = tests[0]
    return store, shown


def json_rows(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_views_status_and_report_show_the_test_the_run_computed(sig_store, tmp_path):
    store_dir, shown = sig_store
    store = ResultStore(str(store_dir))
    summary = {r["run_id"]: r for r in json_rows(run_cli("runs", "--store", str(store_dir), "--format", "json"))}
    assert set(summary) == set(shown)
    for run_id, test in shown.items():
        names = {r["eval_id"]: f"{r['attention']}:{r['layer']}:{r['head']}"
                 for r in store.read("evaluations", run_id).to_pylist() if r["experiment"] == "single_head"}
        table = {names[r["eval_id"]]: r for r in store.read("significance", run_id).to_pylist()
                 if r["test"] == test}
        assert len(table) == len(names) == 8
        heads = json_rows(run_cli("query", "SELECT name, test, p_value, p_adjusted, significant FROM heads "
                                  f"WHERE run_id = '{run_id}'", "--store", str(store_dir), "--format", "json"))
        assert {h["name"]: (h["test"], h["p_value"], h["p_adjusted"], h["significant"]) for h in heads} == \
            {n: (test, r["p_value"], r["p_adjusted"], r["significant"]) for n, r in table.items()}
        n_significant = sum(r["significant"] for r in table.values())
        assert summary[run_id]["n_significant"] == n_significant
        status = run_cli("status", run_id, "--store", str(store_dir))
        assert status.returncode == 0, status.stderr
        assert f"heads significant: {n_significant} of 8" in status.stdout, status.stdout
        facts = json.loads(store.read("runs", run_id).to_pylist()[0]["facts"])
        assert "progress" not in facts  # a complete run's row holds no live snapshot
    # the report counts the same heads significant (the tiny random model: some are, at alpha 0.4)
    run_id = next(r for r, t in shown.items() if t == "mcnemar_exact")
    n_significant = summary[run_id]["n_significant"]
    assert n_significant > 0
    report = run_cli("report", run_id, "--store", str(store_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    page = Path(report.stdout.strip()).read_text()
    assert f"8 heads evaluated, {n_significant} significant at adjusted p" in page


def test_stopped_runs_keep_their_baseline(tmp_path, ray_address, tiny_bert_dir, wide_bert_dir, tiny_dev_tsv):
    store_dir = tmp_path / "store"
    store = ResultStore(str(store_dir))
    # stopped by its budget (the driver's doing, run in this process); a budget-stopped run computes no
    # significance, so it cannot stand in for one of sig_store's complete runs
    partial = sweep_in_process(config(tiny_bert_dir, tiny_dev_tsv, budget={"evaluations": 3}), tmp_path, "budget",
                               store_dir, ray_address)
    stored = store.read("evaluations").num_rows
    # Ctrl-C once the baseline and more evaluations are stored: 2 rows of 33 (40 examples each), a run long in
    # masks, so that it is still going when the signal comes
    cfg = config(wide_bert_dir, tiny_dev_tsv, batch_size=8, masks_per_batch=1, flush_every=1,
                 experiments=["baseline", "single_head", "all_but_one"])
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(tmp_path / "long.yaml"), "--store",
                             str(store_dir), "--address", ray_address, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 600  # left as soon as the rows are there; a loaded machine is slow to start
    while time.monotonic() < deadline and store.read("evaluations").num_rows < stored + 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    runs = {r["run_id"]: r for r in store.read("runs").to_pylist()}
    [interrupted] = set(runs) - {partial}
    for run_id, status in ((partial, "partial"), (interrupted, "interrupted")):
        evaluations = store.read("evaluations", run_id).to_pylist()
        [baseline] = [r["score"] for r in evaluations if r["experiment"] == "baseline"]
        row = runs[run_id]
        assert (row["status"], row["baseline_score"]) == (status, baseline)
        assert "progress" not in json.loads(row["facts"])
        lines = run_cli("status", run_id, "--store", str(store_dir))
        assert lines.returncode == 0 and f"baseline {baseline}\n" in lines.stdout, lines.stdout


def test_a_row_written_when_the_run_ends_drops_the_live_progress(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    """A heartbeat's snapshot (written only after a minute of running) is not left in the final row."""
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.run.chunks import ChunkWriter
    from headsweep.sweep.run.runs import RunRecord, now
    from headsweep.workers.core.family import DatasetInfo
    from headsweep.workers.core.heads import HeadInventory

    store = ResultStore(str(tmp_path / "store"))
    inventory = HeadInventory.from_json([{"attention": "self", "layer": 0, "num_heads": 2}])
    info = DatasetInfo("m", "d", "accuracy", ["correct"], ["0"], [""], inventory)
    record = RunRecord(build_config(config(tiny_bert_dir, tiny_dev_tsv)), store, "r1", now(), info,
                       ChunkWriter(store, "r1", info, 10, 10.0))
    record.progress = {"stored": 41, "pass_left": 32, "eta_s": 128.4, "significant_so_far": 1}
    record.write(RUNNING)
    assert json.loads(store.run("r1")["facts"])["progress"] == record.progress
    record.write(COMPLETE)
    assert "progress" not in json.loads(store.run("r1")["facts"])


def test_out_inside_the_store_is_refused(sig_store, tmp_path, tiny_bert_dir, tiny_dev_tsv):
    store_dir = tmp_path / "store"
    shutil.copytree(sig_store[0], store_dir)
    run_id = next(iter(sig_store[1]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_bert_dir, tiny_dev_tsv)))
    before = snapshot(store_dir)
    for args, out, what in [
        (("query", "SELECT * FROM runs", "--format", "parquet"), f"runs/run_id={run_id}/extra.parquet", "file"),
        (("query", "SELECT 1 AS x", "--format", "csv"), "x.csv", "file"),
        (("runs", "--format", "parquet"), "evaluations/runs.parquet", "file"),
        (("runs",), "", "file"),
        (("report", run_id), "report", "folder"),
        (("report", run_id), f"runs/run_id={run_id}", "folder"),  # a folder that exists: checked before any write
        (("export", str(cfg), "--mask", "self:0:1"), "exported", "folder"),
        (("export", str(cfg), "--from-run", run_id, "--eval-id", "single_head/self:0:1"), "", "folder"),
    ]:
        proc = run_cli(*args, "--store", str(store_dir), "--out", str(store_dir / out))
        line = refused(proc, "is inside the store", f"give --out a {what} outside it")
        assert line == (f"headsweep: error: --out {store_dir / out} is inside the store {store_dir}, which holds only "
                        f"what headsweep runs write: give --out a {what} outside it"), args
        assert snapshot(store_dir) == before, args
    assert sorted(r["run_id"] for r in json_rows(run_cli("runs", "--store", str(store_dir), "--format", "json"))) \
        == sorted(sig_store[1])


def test_reading_commands_refuse_a_store_path_where_no_store_is(tmp_path):
    typo, file = tmp_path / "typo", tmp_path / "file.txt"
    file.write_text("not a store\n")
    calls = [(typo, ("runs",)), (typo, ("query", "SELECT 1")), (typo, ("status", "RUN")),
             (typo, ("report", "RUN", "--out", str(tmp_path / "r"))), (typo, ("compare", "RUN_A", "RUN_B")),
             (file, ("runs",)), (file, ("status", "RUN"))]
    for where, args in calls:  # one at a time: commands running at once race on their shared log folder
        line = refused(run_cli(*args, "--store", str(where)))
        why = "nothing is there" if where == typo else "it is a file, not a store folder"
        assert line.startswith(f"headsweep: error: no store at {where}: {why}; give --store the folder a run wrote "
                               "into"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_a_refused_run_leaves_the_store_as_it_was(sig_store, tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """Errors found once the model or the data is read: no store folder made, an existing store untouched.

    Each error, and each kind of store, is refused once through the CLI (one line, exit 2) and once by the driver
    in this process (``headsweep.run``): the store is the driver's to leave alone, and the CLI writes its log
    folder beside a store, never in it."""
    bad_labels = tmp_path / "labels.tsv"
    bad_labels.write_text("sentence\tlabel\nthe film was good\t1\nthe film was bad\t7\n")
    existing = tmp_path / "existing"
    shutil.copytree(sig_store[0], existing)
    before = snapshot(existing)
    cases = [(config(tiny_bert_dir, tiny_dev_tsv, masks=[["self:0:1", "self:1:9"]]), "head 9 out of range"),
             (config(tiny_bert_dir, bad_labels), "labels outside the model's label set")]
    for index, (cfg, message) in enumerate(cases):
        new = tmp_path / f"new-{index}" / "store"
        # the CLI for the new store of the first error and the existing store of the second; the driver for the rest
        for store, through_cli in ((new, index == 0), (existing, index == 1)):
            if through_cli:
                refused(run(tmp_path, f"bad{index}", cfg, store, ray_address), message)
            else:
                with pytest.raises(HeadsweepError, match=re.escape(message)):
                    sweep_in_process(cfg, tmp_path, f"bad{index}", store, ray_address)
            assert not new.exists()
            assert snapshot(existing) == before


def test_a_run_refuses_a_store_with_foreign_or_damaged_files(sig_store, tmp_path, tiny_bert_dir, tiny_dev_tsv):
    other, run_id = "20260101-000000-abcdef", next(iter(sig_store[1]))
    foreign = pa.table({"a": [1, 2], "b": ["x", "y"]})
    exported = ResultStore(str(sig_store[0])).read("runs", run_id)  # a query's export: run_id as a column
    chunk = next(p for p in sorted((sig_store[0] / "evaluations").rglob("*.parquet")) if run_id in str(p))
    cases = {
        "another tool's file in a table's partition": (f"evaluations/run_id={other}/theirs.parquet",
                                                       lambda p: pq.write_table(foreign, p), "columns a, b are not"),
        "a query's export in a run's partition": (f"runs/run_id={run_id}/extra.parquet",
                                                  lambda p: pq.write_table(exported, p), "column run_id is not"),
        "a damaged chunk of another run": (f"evaluations/run_id={other}/{chunk.name}",
                                           lambda p: p.write_bytes(chunk.read_bytes()[:60]),
                                           "is not a readable Parquet file"),
        "another tool's file at the store's root": ("data.parquet", lambda p: pq.write_table(foreign, p),
                                                    "a Parquet file headsweep did not write"),
    }
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_bert_dir, tiny_dev_tsv)))
    for case, (relative, write, message) in cases.items():
        store = tmp_path / case.replace(" ", "-").replace("'", "")
        shutil.copytree(sig_store[0], store)
        (store / relative).parent.mkdir(parents=True, exist_ok=True)
        write(store / relative)
        before = snapshot(store)
        # refused before Ray starts: no --address needed
        line = refused(run_cli("run", str(cfg), "--store", str(store)), str(store / relative), message)
        assert "move it out of the store" in line, (case, line)
        assert snapshot(store) == before, case


def test_a_run_refuses_a_store_with_a_table_folder_that_takes_no_files(sig_store, tmp_path, tiny_bert_dir,
                                                                     tiny_dev_tsv):
    """Was: ``unexpected PermissionError`` after runs, inputs and two examples chunks were written. Every table
    folder is tried before anything is written (and before Ray starts)."""
    store = tmp_path / "store"
    shutil.copytree(sig_store[0], store)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_bert_dir, tiny_dev_tsv)))
    before = snapshot(store)
    with folder_taking_no_files(store / "evaluations"):
        line = refused(run_cli("run", str(cfg), "--store", str(store)),
                       f"store {store} is not writable: its folder evaluations/ takes no files (")
    assert line.endswith("): make it writable (chmod, chattr -i) or run with another --store"), line
    assert snapshot(store) == before


def test_ctrl_c_stops_a_query_inside_duckdb_every_time(tmp_path):
    store = tmp_path / "store"
    store.mkdir()

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "headsweep", "query",
                                 "SELECT sum(hash(i)) FROM range(100000000000) t(i)", "--store", str(store)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_sigint)

    def interrupt(proc: subprocess.Popen, started: float, delay: float) -> None:
        time.sleep(max(0.0, started + delay - time.monotonic()))
        assert proc.poll() is None  # still running: the sum takes minutes
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        assert (proc.returncode, out, err) == (130, "", "headsweep: interrupted\n"), (delay, err[-2000:])
        assert took < 5.0, (delay, took)

    # Ctrl-C 2 s after the start (alone: no other start competes for the cores in those 2 s), then two commands
    # started together and stopped 4 s and 6 s (or a little more) after their start: 8 s in all rather than 12.
    first, started = start(), time.monotonic()
    interrupt(first, started, 2.0)
    later, started = [start(), start()], time.monotonic()
    try:
        for proc, delay in zip(later, (4.0, 6.0), strict=True):
            interrupt(proc, started, delay)
    finally:
        for proc in later:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_gates_lambda_is_l0_lambda_and_older_files_read_as_such(tmp_path):
    store_dir = tmp_path / "store"
    shutil.copytree(STORE_V1, store_dir)
    gates = TABLES["gates"]
    v7 = pa.schema([pa.field("lambda", pa.float64()) if f.name == "l0_lambda" else f for f in gates])
    assert "l0_lambda" in gates.names and "lambda" not in gates.names
    row = {"attention": "self", "layer": 0, "head": 1, "log_alpha": -2.5, "p_open": 0.1, "closed": True, "step": 30,
           "train": "gates", "checkpoint": None}
    # a file as schema versions 6 and 7 wrote it, and one of today's (another run)
    old = store_dir / "gates" / f"run_id={V1_CLASSIFIER}" / "l0-lambda-0.5.parquet"
    old.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{**row, "lambda": 0.5}], schema=v7), old)
    store = ResultStore(str(store_dir))
    store.write_rows("gates", V1_TRANSLATION, [{**row, "l0_lambda": 2.0}], "l0-lambda-2.0")
    assert pq.read_schema(old).names[0] == "lambda"
    read = store.read("gates")
    assert read.column_names == ["run_id", *gates.names]
    assert sorted(zip(read.column("run_id").to_pylist(), read.column("l0_lambda").to_pylist(), strict=True)) == \
        [(V1_CLASSIFIER, 0.5), (V1_TRANSLATION, 2.0)]
    assert store.read("gates", V1_CLASSIFIER, columns=["l0_lambda", "closed"]).to_pylist() == \
        [{"l0_lambda": 0.5, "closed": True}]
    store.check_files()  # an older gates file is the store's own: a run adds to this store
    proc = run_cli("query", "SELECT run_id, l0_lambda, head FROM gates ORDER BY l0_lambda", "--store", str(store_dir),
                   "--format", "json")
    assert json_rows(proc) == [{"run_id": V1_CLASSIFIER, "l0_lambda": 0.5, "head": 1},
                               {"run_id": V1_TRANSLATION, "l0_lambda": 2.0, "head": 1}]
    bad = store_dir / "gates" / "run_id=x" / "part-1.parquet"  # the old name, but text: not the table's
    bad.parent.mkdir()
    pq.write_table(pa.table({"lambda": ["high"]}), bad)
    with pytest.raises(HeadsweepError, match="part-1.parquet is not a file of table gates .its column lambda is not"):
        store.check_files()
