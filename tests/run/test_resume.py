"""Resume: a driver killed or stopped mid-sweep loses only in-flight work; a rerun computes only what is missing.

``headsweep status`` tells a run whose driver is gone (stale) from a live one, and counts what is stored.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from conftest import REPO, error_line, folder_taking_no_files, run_cli

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.run.runs import STALE_AFTER_S
from headsweep.sweep.run.status import runs_listing, status_lines


def status_of(run_id: str, store) -> list[str]:
    proc = run_cli("status", run_id, "--store", str(store))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout.splitlines()


def listed(run_id: str, store) -> dict:
    """The run's line as ``headsweep runs`` lists it."""
    proc = run_cli("runs", "--store", str(store), "--format", "json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    [row] = [r for r in map(json.loads, proc.stdout.splitlines()) if r["run_id"] == run_id]
    return row


def listed_status(run_id: str, store) -> str:
    return listed(run_id, store)["status"]


def report_facts(run_id: str, store, out) -> str:
    """The facts table of the run's report page, as ``headsweep report`` writes it."""
    proc = run_cli("report", run_id, "--store", str(store), "--out", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    page = (out / "index.html").read_text()
    return page[page.index("<table><tr><th>status</th>"):][:2000]


def check_status_of_a_killed_run(reader: ResultStore, killed: dict, stored: int) -> None:
    """The row still says running: status calls it stale (its driver's process is gone) with the stored count, and
    the heartbeat rule decides for a driver on another host (or a store read from elsewhere)."""
    store, run_id = reader.root, killed["run_id"]
    lines = status_of(run_id, store)
    assert lines[0].startswith(f"run {run_id} (sweep): stale: its driver {json.loads(killed['facts'])['driver']} "
                               "is not running (last heartbeat "), lines
    assert f"evaluations stored: {stored} of {killed['n_planned']} planned so far" in lines
    assert stored < killed["n_planned"]  # the plan was in the row before the first evaluation landed
    assert f"run the same command again to continue it (or headsweep run CONFIG --resume {run_id})" in lines
    assert not any(line.startswith("ETA") for line in lines)
    # runs and the report say what status says (the row itself still says running), and count what is stored (the
    # row's own n_done is 0: written when the run started, never again by the killed driver)
    row = listed(run_id, store)
    assert (row["status"], row["n_done"], killed["n_done"]) == ("stale", stored, 0)
    facts = report_facts(run_id, store, Path(store).parent / "report")
    assert '<tr><th>status</th><td class="text">stale</td></tr>' in facts, facts
    assert f'<tr><th>evaluations done / planned</th><td class="text">{stored} / {killed["n_planned"]}</td>' in facts
    assert reader.read("runs").column("status").to_pylist() == ["running"]
    elsewhere = {**killed, "facts": json.dumps({**json.loads(killed["facts"]), "driver": "elsewhere:1"})}
    reader.write_rows("runs", run_id, [{**elsewhere, "updated_at": datetime.now(UTC) - timedelta(seconds=5)}], "run")
    lines = status_of(run_id, store)
    assert lines[0] == f"run {run_id} (sweep): running" and any(x.startswith("ETA of the pass") for x in lines), lines
    live = listed(run_id, store)
    assert (live["n_done"], live["status"]) == (stored, "running")  # live: as stored
    old = datetime.now(UTC) - timedelta(seconds=STALE_AFTER_S + 60)
    reader.write_rows("runs", run_id, [{**elsewhere, "updated_at": old}], "run")
    lines = status_of(run_id, store)
    assert lines[0].startswith(f"run {run_id} (sweep): stale: its driver elsewhere:1 has written no heartbeat since "
                               f"{old:%Y-%m-%d %H:%M:%S} UTC (0:11:"), lines
    assert lines[0].endswith("a running driver writes one every 60 s and is taken for gone after 600 s without)")
    assert listed_status(run_id, store) == "stale"
    # Read from a process on the run's Ray cluster (this one): the killed driver's Ray job has ended there, which
    # decides at once, fresh heartbeat or not, as it does for a driver resuming the run (runs.refuse_if_live).
    assert json.loads(killed["facts"])["ray_job"]
    reader.write_rows("runs", run_id, [{**elsewhere, "updated_at": datetime.now(UTC) - timedelta(seconds=5)}], "run")
    line = status_lines(reader, run_id)[0]
    assert line.startswith(f"run {run_id} (sweep): stale: its driver elsewhere:1's Ray job has ended on this "
                           "cluster (last heartbeat "), line
    assert runs_listing(reader, "SELECT run_id, status FROM runs").column("status").to_pylist() == ["stale"]


def start_run(argv: list[str]) -> subprocess.Popen:
    """``headsweep run`` (``argv``) as a driver process of its own, to be signalled."""
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_at(proc: subprocess.Popen, reader: ResultStore, rows: int, signum: int) -> str:
    """Send ``signum`` to the driver once the store holds ``rows`` evaluations; returns its stderr."""
    deadline = time.monotonic() + 600  # left as soon as the rows are there; a loaded machine is slow to start
    while time.monotonic() < deadline and reader.read("evaluations").num_rows < rows:
        time.sleep(0.2)
    proc.send_signal(signum)
    return proc.communicate(timeout=120)[1]


def test_killed_or_stopped_then_rerun_computes_only_the_missing(tmp_path, wide_bert_dir, tiny_dev_tsv, ray_address):
    """SIGKILL leaves the row running (status says stale); SIGTERM, a scheduler's stop, marks it interrupted as
    Ctrl-C does (exit 143, one line). Either way the same command resumes it. One run takes both in turn (each
    run of this config costs a driver and a worker start): killed, then its resumption stopped by SIGTERM, then
    resumed to the end."""
    # Stopped after 4 rows of 33 (40 examples each), and its resumption after 4 more: long in masks, so that the
    # run is still going when the signal comes even on a fast machine; short per mask, so that the runs are quick.
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(wide_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one"], "batch_size": 8,
                  "masks_per_batch": 1, "flush_every": 1, "workers": 1},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "headsweep", "run", str(tmp_path / "c.yaml"), "--store", str(store),
            "--address", ray_address, "--quiet"]
    reader = ResultStore(str(store))

    # SIGKILL: nobody could mark the row, the driver died.
    proc = start_run(argv)
    err = signal_at(proc, reader, 4, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    [killed] = reader.read("runs").to_pylist()
    assert killed["status"] == "running" and killed["error"] is None
    before = set(reader.read("evaluations").column("eval_id").to_pylist())
    assert 4 <= len(before) < 33
    check_status_of_a_killed_run(reader, killed, len(before))

    # The store refuses the rerun's first write: one line, and still resumable.
    partition = store / "evaluations" / f"run_id={killed['run_id']}"
    with folder_taking_no_files(partition):
        refused = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address,
                          "--quiet")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = error_line(refused.stderr)  # the reason: not permitted (immutable), or permission denied
    assert line.startswith(f"headsweep: error: store {store}: cannot write into {partition} ("), line
    assert line.endswith("); what was stored before stays: make the store writable and run the same command "
                         "again to continue the run"), line
    failed = reader.run(killed["run_id"])
    assert failed["status"] == "failed" and "cannot write into" in failed["error"]
    assert set(reader.read("evaluations").column("eval_id").to_pylist()) == before

    # The same command resumes it, computing only what is missing; SIGTERM stops it after 4 more rows.
    proc = start_run(argv)
    err = signal_at(proc, reader, len(before) + 4, signal.SIGTERM)
    assert proc.returncode == 143, err[-2000:]
    assert f"resuming run {killed['run_id']}: {len(before)} evaluations already stored" in err
    [stopped] = reader.read("runs").to_pylist()
    assert stopped["status"] == "interrupted" and stopped["error"] is None
    resumed = reader.read("evaluations").column("eval_id").to_pylist()
    assert len(resumed) == len(set(resumed)) and before < set(resumed)  # nothing stored before computed again
    resumed = set(resumed)
    assert len(before) + 4 <= len(resumed) < 33
    assert err.splitlines()[-1] == (f"headsweep: interrupted (SIGTERM): run {killed['run_id']} is marked "
                                    f"interrupted in {store}; run the same command again to continue it"), err
    assert "Traceback" not in err and stopped["n_done"] == len(resumed)
    lines = status_of(killed["run_id"], store)
    assert lines[0] == f"run {killed['run_id']} (sweep): interrupted"
    assert f"evaluations stored: {len(resumed)} of {killed['n_planned']} planned so far" in lines

    started = datetime.now(UTC)
    rerun = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.strip() == killed["run_id"]
    assert f"resuming run {killed['run_id']}: {len(resumed)} evaluations already stored" in rerun.stderr
    evals = reader.read("evaluations").to_pylist()
    ids = [e["eval_id"] for e in evals]
    assert len(ids) == len(set(ids)) == 33  # baseline + 16 single-head + 16 all-but-one, each once
    new = {e["eval_id"] for e in evals if e["finished_at"] >= started}
    assert new == set(ids) - resumed
    assert reader.read("examples").num_rows == 33 * 40
    [run] = reader.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_done"] == 33
    sig = reader.read("significance").to_pylist()
    assert sorted(s["eval_id"] for s in sig if s["test"] == "paired_ttest") == sorted(set(ids) - {"baseline"})
    # Complete: the same command again says so and writes nothing (a second run would double every query's counts).
    files = sorted(p for p in store.rglob("*") if p.is_file())
    again = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert again.returncode == 0 and again.stdout.strip() == killed["run_id"], again.stderr
    assert f"run {killed['run_id']} of this config is complete in store {store}: nothing to do" in again.stderr
    assert sorted(p for p in store.rglob("*") if p.is_file()) == files


@pytest.fixture(scope="module")
def pruning_run(tmp_path_factory, tiny_bert_dir, tiny_dev_tsv, ray_address) -> tuple[Path, str]:
    """A complete run of baseline, importance and four pruning levels on the tiny BERT, made once for the tests
    that continue or repeat a complete run: (its config, its run id); ``store_copy`` gives each its own store."""
    folder = tmp_path_factory.mktemp("pruning_run")
    train = write_tsv(generate(60, seed=11), folder / "train.tsv")
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline", "importance", "prune_level"], "flush_every": 1, "workers": 1},
           "importance": {"data": {"path": str(train)}}, "prune": {"levels": [0.0, 0.25, 0.5, 0.75]}}
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    first = run_cli("run", str(folder / "c.yaml"), "--store", str(folder / "store"), "--address", ray_address,
                    "--quiet")
    assert first.returncode == 0, first.stderr
    return folder / "c.yaml", first.stdout.strip()


def store_copy(config: Path, tmp_path: Path) -> str:
    """A copy of the store of ``pruning_run`` (whose ``config`` is given) that a test may change."""
    shutil.copytree(config.parent / "store", tmp_path / "store")
    return str(tmp_path / "store")


def test_resume_refuses_another_config(tmp_path, pruning_run, ray_address):
    config, run_id = pruning_run
    store = store_copy(config, tmp_path)
    other = run_cli("run", str(config), "sweep.batch_size=7", "--resume", run_id, "--store", store,
                    "--address", ray_address, "--quiet")
    assert other.returncode == 2 and "made with another config" in other.stderr
    again = run_cli("run", str(config), "--store", store, "--address", ray_address, "--quiet")
    assert again.returncode == 0 and again.stdout.strip() == run_id and "is complete in store" in again.stderr
    assert ResultStore(store).read("runs").num_rows == 1  # a complete run is neither resumed nor run again
    second = run_cli("run", str(config), "--new", "--store", store, "--address", ray_address, "--quiet")
    assert second.returncode == 0 and second.stdout.strip() != run_id  # --new: a deliberate second run
    assert {r["run_id"]: r["status"] for r in ResultStore(store).read("runs").to_pylist()} == {
        run_id: "complete", second.stdout.strip(): "complete"}


def test_a_run_whose_driver_lives_is_never_resumed_by_a_second_driver():
    import json
    import socket
    from datetime import timedelta

    import pytest

    from headsweep.errors import HeadsweepError
    from headsweep.sweep.run.runs import STALE_AFTER_S, refuse_if_live

    def row(driver: str, age_s: float, status: str = "running") -> dict:
        return {"run_id": "r1", "status": status, "facts": json.dumps({"driver": driver}),
                "updated_at": datetime.now(UTC) - timedelta(seconds=age_s)}

    here = socket.gethostname()
    with subprocess.Popen(["sleep", "30"]) as live:
        with pytest.raises(HeadsweepError, match=f"run r1 of this config is still being written by the driver "
                                                 f"{here}:{live.pid}"):
            refuse_if_live(row(f"{here}:{live.pid}", age_s=3600))  # alive, however old its heartbeat
        live.kill()
    refuse_if_live(row(f"{here}:{live.pid}", age_s=1))  # its process is gone: resumable at once
    with pytest.raises(HeadsweepError, match="still being written"):
        refuse_if_live(row("other-host:123", age_s=5))
    refuse_if_live(row("other-host:123", age_s=STALE_AFTER_S + 1))
    refuse_if_live(row(f"{here}:{live.pid}", age_s=1, status="interrupted"))


def test_the_heartbeat_goes_on_while_nothing_lands_and_never_outlives_the_last_row(tmp_path, tiny_bert_dir,
                                                                                     tiny_dev_tsv, monkeypatch):
    """A driver busy for long without a result (a training step, one evaluation of a large model) still beats, so a
    reader elsewhere never takes it for gone; once the row says how the run ended, no beat says running again."""
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.run import runs
    from headsweep.sweep.run.chunks import ChunkWriter
    from headsweep.workers.core.family import DatasetInfo
    from headsweep.workers.core.heads import HeadInventory

    monkeypatch.setattr(runs, "HEARTBEAT_S", 0.2)
    store = ResultStore(str(tmp_path / "store"))
    inventory = HeadInventory.from_json([{"attention": "self", "layer": 0, "num_heads": 2}])
    info = DatasetInfo("m", "d", "accuracy", ["correct"], ["0"], [""], inventory)
    cfg = build_config({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                        "data": {"path": str(tiny_dev_tsv)}})
    record = runs.RunRecord(cfg, store, "r1", runs.now(), info, ChunkWriter(store, "r1", info, 10, 10.0))
    record.write("running")
    first = store.run("r1")["updated_at"]
    record.start_heartbeat()
    try:
        time.sleep(1.0)  # nothing written from this thread meanwhile
        beaten = store.run("r1")
        assert beaten["status"] == "running" and beaten["updated_at"] > first
        record.write("interrupted")
        ended = store.run("r1")
        time.sleep(1.0)
        assert store.run("r1") == ended
    finally:
        record.stop_heartbeat()


def test_resumed_pruning_levels_follow_the_importance_the_run_stored(tmp_path, pruning_run, ray_address):
    """Pending pruning levels of a resumed run are ordered by the run's stored importance, never by a new
    estimate: shown by altering the stored scores before resuming."""
    import json

    import pyarrow.parquet as pq

    from headsweep.sweep.pruning.levels import level_masks
    from headsweep.workers.core.heads import Head, HeadInventory

    config, run_id = pruning_run
    argv = ("run", str(config), "--store", store_copy(config, tmp_path), "--address", ray_address, "--quiet")
    store = ResultStore(str(tmp_path / "store"))

    # As if the driver had died before the two last levels landed ...
    pending = {"prune_level/global/0.5000", "prune_level/global/0.7500"}
    for fragment in store.dataset("evaluations").get_fragments():
        if set(pq.read_table(fragment.path, columns=["eval_id"]).column("eval_id").to_pylist()) & pending:
            store.fs.delete_file(fragment.path)
    [run] = store.read("runs").to_pylist()
    store.write_rows("runs", run_id, [{**run, "status": "interrupted"}], "run")
    # ... and with the stored importance reversed, so that a fresh estimate would order the heads otherwise.
    rows = store.read("importance", run_id).to_pylist()
    for r in rows:
        r["score"], r["score_normalized"] = -r["score"], -r["score_normalized"]
    store.write_rows("importance", run_id, rows, name="gradient")

    rerun = run_cli(*argv)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.strip() == run_id
    inventory = HeadInventory.from_json(json.loads(run["heads"]))
    stored = {Head(r["attention"], r["layer"], r["head"]): r["score_normalized"] for r in rows}
    expected = {f"prune_level/global/{p:.4f}": sorted(map(str, m))
                for p, m in level_masks(stored, inventory, [0.0, 0.25, 0.5, 0.75])}
    evals = {e["eval_id"]: e for e in store.read("evaluations", run_id).to_pylist()}
    assert len(evals) == 5  # baseline + 4 levels, each once
    for eval_id in pending:
        assert sorted(evals[eval_id]["heads_masked"]) == expected[eval_id]
    assert sorted(evals["prune_level/global/0.2500"]["heads_masked"]) != expected["prune_level/global/0.2500"]
    assert store.read("importance", run_id).num_rows == len(rows)
