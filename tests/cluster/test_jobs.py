"""Sweeps submitted as Ray jobs to a real Ray head (``ray start --head --block``) through its job API.

The head is separate from the session's in-process Ray instance (conftest ``ray_address``): its own
ports, its own ``--temp-dir`` and ``HOME``, token auth off on both sides, and this test process never
calls ``ray.init``; it only talks HTTP to the job API.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml
from conftest import run_cli
from local_cluster import free_ports

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.cluster import jobs

HEAD_START_TIMEOUT_S = 90
JOB_TIMEOUT_S = 150


def _session_pids(sid: int) -> list[int]:
    """Processes in session ``sid``: Ray workers put themselves in their own process groups."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session ...
            pids.append(int(entry.name))
    return pids


def _stop_head(proc: subprocess.Popen) -> None:
    """End ``ray start --block`` and everything it started (``ray stop`` would also kill other Ray instances)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)  # it shuts down gracefully but slowly (10 s and more) on SIGTERM
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := _session_pids(proc.pid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_head():
    """The job API address of a private Ray head on loopback (about 10 s to start)."""
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:  # else the head starts without its job API and we wait in vain
        pytest.fail("the Ray job API needs ray[default] (aiohttp, ...): pip install 'ray[default]'")
    # A short temp dir: Ray's unix socket paths under it must stay below ~107 characters.
    scratch = Path(tempfile.mkdtemp(prefix="hs-head-", dir="/tmp"))
    home = scratch / "home"
    home.mkdir()
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(7)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HEADSWEEP_STORE")}
    env.update(
        HOME=str(home),  # nothing read from or written to the real ~/.ray (auth tokens)
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONWARNINGS="ignore",
        # Jobs run `python ...`: the cluster's python is this interpreter.
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    cmd = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}", "--num-cpus=3", "--num-gpus=0", f"--temp-dir={scratch / 'ray'}",
    ]
    log_path = scratch / "head.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=scratch, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{address}/api/jobs/", timeout=2).ok:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray job API did not answer within {HEAD_START_TIMEOUT_S} s:\n"
                            f"{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield address
    finally:
        _stop_head(proc)
        shutil.rmtree(scratch, ignore_errors=True)


def write_job_config(folder: Path, tiny_bert_dir: Path, tiny_dev_tsv: Path) -> Path:
    """A sweep config under ``folder`` that includes a base config from a sibling folder (both must travel with the
    job)."""
    base = folder / "conf" / "base.yaml"
    base.parent.mkdir(parents=True)
    base.write_text(yaml.safe_dump({
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "significance": {"tests": ["paired_ttest"]},
    }))
    config = folder / "conf" / "jobs" / "sweep.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({
        "include": ["../base.yaml"],
        "name": "submitted-sweep",
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16, "workers": 2, "flush_every": 4},
    }))
    return config


@pytest.fixture
def job_config(tmp_path, tiny_bert_dir, tiny_dev_tsv) -> Path:
    return write_job_config(tmp_path, tiny_bert_dir, tiny_dev_tsv)


def _assert_succeeded(address: str, job_id: str) -> str:
    final = jobs.wait(address, job_id, JOB_TIMEOUT_S)
    assert final == "SUCCEEDED", jobs.logs(address, job_id)[-4000:]
    return final


def _check_store(store: Path) -> str:
    """The 2-layer x 4-head grid landed in the store; returns the run id."""
    evals = ResultStore(str(store)).read("evaluations").to_pylist()
    assert len(evals) == 9
    assert sorted(e["experiment"] for e in evals) == ["baseline"] + ["single_head"] * 8
    heads = sorted((e["layer"], e["head"]) for e in evals if e["experiment"] == "single_head")
    assert heads == [(layer, head) for layer in range(2) for head in range(4)]
    assert all(e["n_examples"] == 40 for e in evals)
    (run_id,) = {e["run_id"] for e in evals}
    counted = run_query(ResultStore(str(store)), "SELECT count(*) AS n FROM evaluations "
                                                 "WHERE experiment = 'single_head'").to_pylist()
    assert counted[0]["n"] == 8
    return run_id


@pytest.fixture(scope="module")
def submitted(ray_head, tmp_path_factory, tiny_bert_dir, tiny_dev_tsv) -> tuple[str, Path]:
    """One sweep submitted through the real CLI (``headsweep submit``, which calls ``jobs.submit``) with an override
    and ``--workers``, followed until it succeeded: (job id, store). The tests below only read it: one job on the
    cluster instead of one per test (each starts a driver and a worker actor)."""
    tmp = tmp_path_factory.mktemp("submitted")
    config, store = write_job_config(tmp, tiny_bert_dir, tiny_dev_tsv), tmp / "cli-store"
    proc = run_cli("submit", str(config), "sweep.batch_size=8", "--workers", "1", "--python", sys.executable,
                   "--address", ray_head, "--store", str(store), timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    assert job_id.startswith("raysubmit_")
    _assert_succeeded(ray_head, job_id)
    return job_id, store


def test_submit_runs_the_sweep_on_the_cluster(ray_head, submitted):
    job_id, store = submitted
    assert jobs.status(ray_head, job_id) == "SUCCEEDED"

    run_id = _check_store(store)
    (run,) = ResultStore(str(store)).read("runs").to_pylist()[-1:]
    assert run["run_id"] == run_id and run["status"] == "complete"
    config = json.loads(run["config"])
    # The included base config travelled with the job; --workers and the override reached `headsweep run`.
    assert config["name"] == "submitted-sweep" and config["model"]["path"].endswith("tiny-bert")
    assert config["sweep"]["workers"] == 1 and config["sweep"]["batch_size"] == 8
    assert run_id in jobs.logs(ray_head, job_id)  # `headsweep run` prints the run id

    (listed,) = [j for j in jobs.list_jobs(ray_head) if j["job_id"] == job_id]
    assert listed["status"] == "SUCCEEDED" and listed["start_time"] and listed["end_time"]
    assert listed["metadata"] == {"headsweep_config": "sweep.yaml", "headsweep_store": str(store)}
    assert shlex.split(listed["entrypoint"])[:5] == [sys.executable, "-m", "headsweep.sweep.cluster.job_entry", "run",
                                                     "jobs/sweep.yaml"]
    assert job_id in jobs.format_jobs(jobs.list_jobs(ray_head))
    assert jobs.stop(ray_head, job_id) is False  # already over


def test_job_without_store_fails_with_a_clear_message(ray_head, job_config):
    # The head's environment has no HEADSWEEP_STORE: the job must stop before writing anywhere. One job: submit's
    # wait=True names it in its error, and wait and logs then read it.
    with pytest.raises(HeadsweepError, match=rf"^job raysubmit_\w+ ended FAILED: .*{jobs.MISSING_STORE}") as caught:
        jobs.submit(str(job_config), [], ray_head, None, None, wait=True, python=sys.executable)
    job_id = re.match(r"^job (raysubmit_\w+) ", str(caught.value)).group(1)
    assert jobs.wait(ray_head, job_id, JOB_TIMEOUT_S) == "FAILED"
    assert jobs.MISSING_STORE in jobs.logs(ray_head, job_id)


def test_stop_a_running_job(ray_head, tmp_path):
    # A "cluster python" that takes a minute to start keeps the job running long enough to stop it.
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f'#!/bin/sh\nsleep 60\nexec {shlex.quote(sys.executable)} "$@"\n')
    slow_python.chmod(0o755)
    config, store = _never_read_config(tmp_path), str(tmp_path / "store")
    job_id = jobs.submit(config, [], ray_head, store, None, python=str(slow_python))
    deadline = time.monotonic() + 30
    while jobs.status(ray_head, job_id) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.3)
    with pytest.raises(HeadsweepError, match=f"job {job_id} is still RUNNING after 1 s"):
        jobs.wait(ray_head, job_id, 1)
    assert jobs.stop(ray_head, job_id) is True
    assert jobs.wait(ray_head, job_id, 30) == "STOPPED"


def _never_read_config(tmp_path: Path) -> str:
    # Valid as a config (it is checked before submission); the job is stopped before it reads it.
    path = tmp_path / "never-read.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": "/nowhere"},
                                    "data": {"path": "/nowhere.tsv"}}))
    return str(path)


def test_unknown_job_ids_are_one_line_errors(ray_head):
    for call in (jobs.status, jobs.logs, jobs.stop):
        with pytest.raises(HeadsweepError, match="no job 'raysubmit_nope' on the Ray cluster at"):
            call(ray_head, "raysubmit_nope")
    with pytest.raises(HeadsweepError, match="no job 'raysubmit_nope'"):
        jobs.wait(ray_head, "raysubmit_nope", 5)


def test_bad_input_is_refused_before_anything_is_submitted(ray_head, job_config, tmp_path):
    before = len(jobs.list_jobs(ray_head))
    with pytest.raises(HeadsweepError, match="unknown config key 'bogus'"):
        jobs.submit(str(job_config), ["bogus=1"], ray_head, str(tmp_path / "s"), None)
    with pytest.raises(HeadsweepError, match="config file not found"):
        jobs.submit(str(tmp_path / "missing.yaml"), [], ray_head, str(tmp_path / "s"), None)
    with pytest.raises(HeadsweepError, match="relative path"):
        jobs.submit(str(job_config), [], ray_head, "results/store", None)
    with pytest.raises(HeadsweepError, match="working_dir"):
        jobs.submit(str(job_config), [], ray_head, str(tmp_path / "s"), None, runtime_env={"working_dir": "."})
    assert len(jobs.list_jobs(ray_head)) == before


def test_unreachable_address_fails_fast():
    (port,) = free_ports(1)  # nothing listens there
    start = time.monotonic()
    for call in (lambda a: jobs.list_jobs(a), lambda a: jobs.status(a, "x"), lambda a: jobs.logs(a, "x")):
        with pytest.raises(HeadsweepError, match=rf"^cannot reach the Ray job API at http://127.0.0.1:{port}: "):
            call(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 15
    with pytest.raises(HeadsweepError, match="Ray Client address"):
        jobs.list_jobs("ray://127.0.0.1:10001")


def test_unreachable_address_is_reported_before_upload(tmp_path, job_config):
    (port,) = free_ports(1)
    with pytest.raises(HeadsweepError, match=r"^cannot reach the Ray job API at http://127.0.0.1:\d+: "):
        jobs.submit(str(job_config), [], f"http://127.0.0.1:{port}", str(tmp_path / "s"), 1)


def test_entrypoint_quotes_every_argument():
    overrides = ["sweep.masks=[[self:0:1, self:1:2]]", "name=it's $HOME; rm -rf /", "data.path=/a b/c.tsv"]
    entry = jobs.build_entrypoint("my conf/sweep.yaml", overrides, "s3://bucket/x y", 3, "/opt/py 3/python")
    assert shlex.split(entry) == ["/opt/py 3/python", "-m", "headsweep.sweep.cluster.job_entry", "run",
                                  "my conf/sweep.yaml", *overrides,
                                  "--address", "auto", "--workers", "3", "--store", "s3://bucket/x y"]


def test_bundle_keeps_the_include_layout(job_config, tmp_path):
    """The configs travel as text in the job's environment and are written back with their layout (job_entry)."""
    from headsweep.sweep.cluster.job_entry import write_bundle

    bundle, rel = jobs.bundle_config(job_config)
    assert rel == "jobs/sweep.yaml"
    out = tmp_path / "bundle"
    out.mkdir()
    write_bundle(bundle, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.yaml")) == ["base.yaml", "jobs/sweep.yaml"]
    assert (out / rel).read_bytes() == job_config.read_bytes()
    with pytest.raises(HeadsweepError, match="leaves its folder"):
        write_bundle('{"files": {"../escape.yaml": "x: 1"}}', out)


def test_a_config_too_large_for_a_job_environment_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n# " + "y" * jobs.MAX_BUNDLE_BYTES + "\n")
    with pytest.raises(HeadsweepError, match=r"more than a job's environment carries \(98,304\): move large"):
        jobs.bundle_config(big)


def test_cli_submit_status_and_query(ray_head, submitted):
    job_id, store = submitted
    proc = run_cli("jobs", "status", job_id, "--address", ray_head, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "SUCCEEDED"
    proc = run_cli("jobs", "status", "raysubmit_nope", "--address", ray_head, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("headsweep: error: no job 'raysubmit_nope'")

    run_id = _check_store(store)
    proc = run_cli("query", "SELECT run_id, count(*) AS n FROM evaluations GROUP BY run_id", "--store", str(store),
                   "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [{"run_id": run_id, "n": 9}]
