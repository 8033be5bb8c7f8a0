"""A node lost while ``l0`` trials train on Ray Tune: the trials resume from their checkpoints on the nodes left.

On a multi-node cluster on this machine (``tests/local_cluster.py``: a head without CPUs and two worker nodes, each
with its own raylet), the node holding a running L0 trial is taken away, processes and all. Tune sees the trial's
actor die, counts a failure (``FailureConfig(max_failures=sweep.max_retries)``) and starts the trial again on the
node left, from its last checkpoint in the store. The trainer's checkpoint holds everything its next step depends on
(step, gate parameters, Adam's moments; the noise of step t is seeded by (seed, t)), and both runs train on one
thread, so the resumed run stores the very bits of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from local_cluster import LocalCluster

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv

STEPS = 150
LAMBDAS = [0.0, 50.0]
# What differs between two runs of one config by design: ids, the worker's name, timings.
DIFFERS = {"run_id", "worker", "seconds", "finished_at"}
TABLES = ("gates", "evaluations", "examples", "significance")


def l0_config(folder: Path, model_dir: Path, dev: Path) -> Path:
    """Two L0 trials (lambda 0 and 50) of 150 steps, a checkpoint every 10, on one thread each."""
    train = write_tsv(generate(24, seed=11), folder / "train.tsv")
    cfg = {
        "name": "l0-node-loss",
        "model": {"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "eager"},
        "data": {"path": str(dev)},
        "sweep": {"experiments": ["l0"], "batch_size": 8, "workers": 1, "threads_per_worker": 1},
        "significance": {"tests": ["paired_ttest"]},
        "l0": {"data": {"path": str(train)}, "lambdas": LAMBDAS, "steps": STEPS, "lr": 0.1, "seed": 1,
               "checkpoint_every": 10},
    }
    path = folder / "l0.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_run(config: Path, store: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(config), "--store", str(store),
                             "--address", address, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def reports(result_json: Path) -> list[dict]:
    """A trial's reports so far (Tune's result.json: one JSON object a line)."""
    return [json.loads(x) for x in result_json.read_text().splitlines() if x.strip()]


def running_trial(store: Path, timeout: float = 240) -> tuple[Path, int]:
    """A trial that has stored a checkpoint and has 40 or more steps to go: its result.json and its process id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for results in store.glob("tune/*/l0/*/result.json"):
            done = reports(results) if list(results.parent.glob("checkpoint_*")) else []
            if done and done[-1]["step"] < STEPS - 40:
                return results, done[-1]["pid"]
        time.sleep(0.1)
    raise AssertionError("no trial could be caught running with a checkpoint")


def stored(store: ResultStore) -> dict[str, list[str]]:
    """Each table's rows, without what differs by design, as sorted reprs (a float's repr round-trips: equal
    reprs are equal bits, and a NaN equals a NaN)."""
    return {table: sorted(repr({k: v for k, v in row.items() if k not in DIFFERS})
                          for row in store.read(table).to_pylist())
            for table in TABLES}


# Slow (a three-node cluster, two 150-step trials twice: about 2 minutes here). The suite's faster test of the same
# path, a trial's process killed and Tune restarting it from its checkpoint to the gates of an uninterrupted
# training, is tests/experiments/test_l0_gates.py::test_two_lambda_tune_run_through_the_cli_with_a_killed_trial;
# a lost node under a sweep's workers is tests/run/test_fault_tolerance.py::test_a_node_lost_mid_grid_...
@pytest.mark.slow
def test_a_node_lost_while_l0_trials_train_changes_no_stored_number(tmp_path, tiny_bert_dir, tiny_dev_tsv,
                                                                    ray_address):
    (tmp_path / "lost").mkdir()
    (tmp_path / "whole").mkdir()
    config = l0_config(tmp_path, tiny_bert_dir, tiny_dev_tsv)
    with LocalCluster(worker_nodes=2, cpus=2) as cluster:
        proc = start_run(config, tmp_path / "lost" / "store", cluster.address)
        try:
            results, pid = running_trial(tmp_path / "lost" / "store")
            cluster.remove_node_of(pid)
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-3000:]
    run_id = out.strip().splitlines()[-1]
    trial = reports(results)
    restarted = [r["step"] for r in trial if r["pid"] != pid]
    # The trial ran again in another process (on the node left), from a checkpoint: not from step 0, to the end.
    assert trial[0]["pid"] == pid and restarted and restarted[-1] == STEPS, trial
    assert 10 < restarted[0] < STEPS, trial
    assert re.search(r"l0 lambda=\S+: trial failed at step \d+ \(failure 1\); Tune restarts it from its last "
                     r"checkpoint", err), err[-3000:]

    whole = start_run(config, tmp_path / "whole" / "store", ray_address)
    whole_out, whole_err = whole.communicate(timeout=300)
    assert whole.returncode == 0, whole_err[-3000:]

    lost = ResultStore(str(tmp_path / "lost" / "store"))
    [run] = lost.read("runs").to_pylist()
    assert run["run_id"] == run_id and run["status"] == "complete"
    # Nothing stored twice: one gate row per lambda and head, one evaluation per eval id.
    gates = [(g["l0_lambda"], g["attention"], g["layer"], g["head"]) for g in lost.read("gates").to_pylist()]
    assert len(gates) == len(set(gates)) == len(LAMBDAS) * 8  # the tiny BERT's 2 layers x 4 heads
    ids = lost.read("evaluations").column("eval_id").to_pylist()
    assert sorted(ids) == ["baseline", "l0_gates/global/0.0", "l0_gates/global/50.0"]
    assert {g["step"] for g in lost.read("gates").to_pylist()} == {STEPS}
    assert stored(lost) == stored(ResultStore(str(tmp_path / "whole" / "store")))
