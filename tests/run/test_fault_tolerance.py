"""Losing a worker mid-sweep: its in-flight evaluations are re-run elsewhere, each stored exactly once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import yaml
from conftest import REPO, error_line, run_cli
from local_cluster import LocalCluster, alive

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv

N_UNITS = 17  # baseline + 8 single-head + 8 all-but-one of the tiny 2x4 BERT
# Sentences per evaluation: after a kill at the third stored row, the rows left take worker-0 alone longer than Ray
# takes to restart the killed worker (model loaded), so that the restart lands mid-run.
SENTENCES = 2000


def start_sweep(tmp_path, model_dir, ray_address, sections: dict | None = None, sentences: int = SENTENCES,
                **sweep) -> tuple[subprocess.Popen, list[str], list[str]]:
    """Start `headsweep run` on ``sentences`` sentences (slow enough to interrupt), with more config ``sections`` if
    given; returns the process and its argv."""
    data = write_tsv(generate(sentences, seed=3), tmp_path / "dev.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(model_dir)},
        "data": {"path": str(data)},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one"], "batch_size": 8,
                  "masks_per_batch": 1, "flush_every": 1, **sweep},
        **(sections or {}),
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "headsweep", "run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "store"),
            "--address", ray_address, "--quiet"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    proc.stamps = []  # when each line was read (time.time())

    def read_stderr() -> None:
        for line in proc.stderr:
            proc.stamps.append(time.time())
            lines.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    proc.reader = reader
    return proc, lines, argv


def finish(proc: subprocess.Popen) -> str:
    """Wait for the driver; returns its stdout (stderr is collected by the reader thread)."""
    out = proc.stdout.read()
    proc.wait(timeout=300)
    proc.reader.join(timeout=10)
    return out


def worker_pids(lines: list[str], timeout: float = 120) -> dict[str, int]:
    """PIDs of the worker actors, from the driver's `workers ready` line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            if "workers ready:" in line:
                return {m[0]: int(m[1]) for m in re.findall(r"(worker-\d+)@[^:,\s]+:(\d+)", line)}
        time.sleep(0.1)
    raise AssertionError("driver never reported its workers: " + "".join(lines))


def wait_for_evaluations(store: ResultStore, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while store.read("evaluations").num_rows < n:
        assert time.monotonic() < deadline, "sweep made no progress"
        time.sleep(0.1)


def test_killed_worker_is_restarted_with_the_optimal_constants_and_its_masks_rerun(tmp_path, tiny_bert_dir,
                                                                                 ray_address):
    """A worker killed mid-grid is restarted by Ray and its masks are re-run; each evaluation is stored once, with
    all its example rows. Under optimal ablation a worker holds constants the driver trained and installed; Ray's
    restart of a killed worker brings back the bare actor, which refuses any gated head until the driver installs
    them again (``WorkerPool.on_restart``): the run completes, all under optimal ablation. (The same restart under
    zero ablation, on a node lost rather than a process killed: test_a_node_lost_mid_grid_changes_no_stored_number;
    one run here takes both the restart and the constants, each run costing two worker starts and a restart.)"""
    reference = write_tsv(generate(40, seed=11), tmp_path / "reference.tsv")
    proc, lines, _ = start_sweep(tmp_path, tiny_bert_dir, ray_address,
                                 {"ablation": {"reference": {"path": str(reference)}, "steps": 3}},
                                 workers=2, ablation="optimal")
    pids = worker_pids(lines)
    store = ResultStore(str(tmp_path / "store"))
    wait_for_evaluations(store, 3)
    os.kill(pids["worker-1"], signal.SIGKILL)  # what a lost node looks like to Ray: the process is gone
    out = finish(proc)
    log = "".join(lines)
    assert proc.returncode == 0, log
    assert re.search(r"worker worker-1@\S+ lost \(\w+\); re-running 1 evaluations", log)
    assert re.search(r"worker worker-1@\S+ restarted as worker-1@\S+", log)
    evals = store.read("evaluations").to_pylist()
    ids = [e["eval_id"] for e in evals]
    assert len(ids) == len(set(ids)) == N_UNITS
    assert {e["ablation"] for e in evals} == {"optimal"}
    assert store.read("examples").num_rows == N_UNITS * SENTENCES
    [run] = store.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_done"] == N_UNITS and run["run_id"] == out.strip()


def test_retries_are_bounded_then_the_run_fails_naming_the_masks_and_resumes(tmp_path, tiny_bert_dir, ray_address):
    # No restart to wait for (max_retries 0): 600 sentences, the run still long enough to be killed after 3 rows of 17
    proc, lines, argv = start_sweep(tmp_path, tiny_bert_dir, ray_address, sentences=600, workers=1, max_retries=0)
    pids = worker_pids(lines)
    store = ResultStore(str(tmp_path / "store"))
    wait_for_evaluations(store, 3)
    os.kill(pids["worker-0"], signal.SIGKILL)
    finish(proc)
    log = "".join(lines)
    assert proc.returncode == 2, log
    error = error_line(lines)
    assert re.search(r"1 evaluations failed 1 times, their worker lost each time \(last: \w+\): "
                     r"(single_head|all_but_one)/self:\d:\d", error), error
    [failed] = store.read("runs").to_pylist()
    assert failed["status"] == "failed" and "worker lost" in failed["error"]
    before = store.eval_ids(failed["run_id"])
    assert 3 <= len(before) < N_UNITS

    rerun = run_cli(*argv[3:])
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.strip() == failed["run_id"]
    ids = store.read("evaluations").column("eval_id").to_pylist()
    assert len(ids) == len(set(ids)) == N_UNITS
    [run] = store.read("runs").to_pylist()
    assert run["status"] == "complete"



def stored_numbers(store: ResultStore) -> dict[str, list[str]]:
    """What a run stored that a rerun must reproduce: its evaluations, per-example rows and tests, without what
    differs between runs by design (run id, worker, timings); each row as its repr, sorted. A float's repr
    round-trips, so equal reprs are equal bits (and a NaN equals a NaN, as == would not have it)."""
    differs = {"run_id", "worker", "seconds", "finished_at"}
    return {table: sorted(repr({k: v for k, v in row.items() if k not in differs})
                          for row in store.read(table).to_pylist())
            for table in ("evaluations", "examples", "significance")}


def test_a_node_lost_mid_grid_changes_no_stored_number(tmp_path, tiny_bert_dir, ray_address):
    """A multi-node cluster on this machine (``tests/local_cluster.py``: a head without CPUs and two worker nodes,
    each with its own raylet); the node holding worker-1 is taken away, processes and all, in the middle of a
    single-head grid. worker-0 goes on while Ray places worker-1 again on the node left; the sweep finishes there,
    each evaluation stored once, and every stored number equals that of an uninterrupted run of the same grid (on
    the session's single-node instance, on one worker) bit for bit."""
    grid = {"experiments": ["baseline", "single_head"], "workers": 2, "threads_per_worker": 1}
    (tmp_path / "lost").mkdir()
    (tmp_path / "whole").mkdir()
    with LocalCluster(worker_nodes=2, cpus=2) as cluster:
        proc, lines, _ = start_sweep(tmp_path / "lost", tiny_bert_dir, cluster.address, **grid)
        pids = worker_pids(lines)
        lost = ResultStore(str(tmp_path / "lost" / "store"))
        wait_for_evaluations(lost, 3)
        cluster.remove_node_of(pids["worker-1"])
        # Ray's default placement spreads the two workers over the two nodes (a node half used is not packed more).
        assert alive(pids["worker-0"]), "worker-0 was on the removed node too"
        finish(proc)
    log = "".join(lines)
    assert proc.returncode == 0, log
    # One loss, one restart on the node left, no worker given up: Ray answers ActorUnavailableError while it places
    # the worker again, which is no reason to give it up.
    assert "gone for good" not in log, log
    [(lost_at, lost_line)] = [(t, x) for t, x in zip(proc.stamps, lines, strict=True) if " lost (" in x]
    [(back_at, back_line)] = [(t, x) for t, x in zip(proc.stamps, lines, strict=True) if " restarted as " in x]
    assert re.match(r"worker worker-1@\S+ lost \(\w+\); re-running \d+ evaluations", lost_line), log
    assert re.match(r"worker worker-1@\S+ restarted as worker-1@\S+", back_line), log
    rows = lost.read("evaluations").to_pylist()
    # worker-0 went on while worker-1 was being placed again.
    meanwhile = [e["eval_id"] for e in rows
                 if e["worker"].startswith("worker-0@") and lost_at < e["finished_at"].timestamp() < back_at]
    assert meanwhile, log
    # The uninterrupted run on one worker (one worker start less; which worker ran a mask is no stored number).
    whole_proc, whole_lines, _ = start_sweep(tmp_path / "whole", tiny_bert_dir, ray_address,
                                             **{**grid, "workers": 1})
    finish(whole_proc)
    assert whole_proc.returncode == 0, "".join(whole_lines)
    whole = ResultStore(str(tmp_path / "whole" / "store"))
    ids = lost.read("evaluations").column("eval_id").to_pylist()
    assert len(ids) == len(set(ids)) == 9  # baseline + 8 single heads of the tiny 2x4 BERT
    [run] = lost.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_done"] == 9
    assert stored_numbers(lost) == stored_numbers(whole)
