"""Workers kept warm between runs on a running cluster (``headsweep run --keep-workers``): the next run of the same
shape takes them over without a process start, answers exactly as fresh workers do, and nothing is left holding the
cluster (an idle one ends after its keep time, one whose code changed is not reused, a driver killed mid-run lets
its workers go)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml
from conftest import REPO, error_line, run_cli

import headsweep
from headsweep.sweep.cluster import warm_workers
from headsweep.workers.actor import warm

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path: Path, model_dir: Path, data: Path, name: str = "c", workers: int = 2, **sweep) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
        "sweep": {"experiments": ["baseline", "single_head"], "workers": workers, "batch_size": 16, **sweep}}))
    return path


def warm_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == warm_workers.NAMESPACE}


def worker_pids(stderr: str) -> list[int]:
    """The pids of the ``N workers ready: worker-0@host:pid, ...`` line."""
    [line] = [x for x in stderr.splitlines() if "workers ready:" in x]
    return sorted(int(p) for p in re.findall(r":(\d+)", line))


def warm_pids() -> list[int]:
    """The pids of the warm workers (``where``: ``worker-0@host:pid``)."""
    where = [ray.get(ray.get_actor(n, namespace=warm_workers.NAMESPACE).where.remote()) for n in warm_names()]
    return sorted(int(w.rsplit(":", 1)[1]) for w in where)


def sweep(cfg: Path, store: Path, ray_address: str, keep: float) -> None:
    """A run in this process (no driver started), workers kept ``keep`` seconds."""
    headsweep.run(str(cfg), store=str(store), address=ray_address, show_progress=False, keep_workers=keep)


def scores(store: Path) -> list[tuple]:
    with headsweep.open_store(str(store)) as s:
        return s.sql("SELECT eval_id, score, n_examples FROM evaluations ORDER BY eval_id").fetchall()


def end_warm_workers() -> None:
    """No warm worker left from an earlier test of the session (each would be claimed or ended by the next run)."""
    for name in warm_names():
        ray.kill(ray.get_actor(name, namespace=warm_workers.NAMESPACE), no_restart=True)
    deadline = time.monotonic() + 30
    while warm_names() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_the_next_run_takes_the_warm_workers_and_its_numbers_equal_fresh_workers(tmp_path, ray_address,
                                                                                 tiny_bert_dir, tiny_dev_tsv):
    end_warm_workers()
    cfg = config(tmp_path, tiny_bert_dir, tiny_dev_tsv)
    sweep(cfg, tmp_path / "cold", ray_address, 0)
    assert warm_names() == set()  # keep time 0: the workers ended with the run
    # another config of the same shape starts the workers and keeps them
    other = config(tmp_path, tiny_bert_dir, tiny_dev_tsv, name="other", experiments=["baseline", "all_but_one"])
    sweep(other, tmp_path / "first", ray_address, 120)
    kept, pids = warm_names(), warm_pids()
    assert len(kept) == 2
    second = run_cli("run", str(cfg), "--store", str(tmp_path / "second"), "--address", ray_address, "--quiet",
                     "--keep-workers", "120")
    assert second.returncode == 0, second.stderr
    assert "2 of 2 workers kept warm by an earlier run: no process start" in second.stderr
    assert worker_pids(second.stderr) == pids
    # a warm worker answers as a fresh one: the same numbers, bit for bit, as the run whose workers ended with it
    assert scores(tmp_path / "second") == scores(tmp_path / "cold")
    assert len(scores(tmp_path / "cold")) == 9

    # another shape (half a CPU per worker): the idle warm workers of the first shape are ended, not left holding
    # CPUs, and one new worker is kept
    half = config(tmp_path, tiny_bert_dir, tiny_dev_tsv, name="half", workers=1, num_cpus_per_worker=0.5)
    sweep(half, tmp_path / "third", ray_address, 120)
    [name] = warm_names()
    assert name not in kept and name[:20] != sorted(kept)[0][:20]  # worker-<shape>-<number>: another shape
    assert warm_pids()[0] not in pids
    end_warm_workers()


def test_an_idle_warm_worker_ends_after_its_keep_time(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    end_warm_workers()
    cfg = config(tmp_path, tiny_bert_dir, tiny_dev_tsv, workers=1)
    headsweep.run(str(cfg), store=str(tmp_path / "s"), address=ray_address, show_progress=False, keep_workers=3)
    assert len(warm_names()) == 1
    deadline = time.monotonic() + 3 + 2 * warm.WATCH_EVERY_S + 20
    while warm_names() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert warm_names() == set()
    # its CPU is the cluster's again (Ray gives an ended actor's resources back a moment later)
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_a_worker_whose_code_changed_is_not_reused(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """(The suite runs a file's tests in one process, --dist loadfile: no other test of this file, the only ones
    that count on reuse, runs while this one changes headsweep's files.)"""
    end_warm_workers()
    cfg = config(tmp_path, tiny_bert_dir, tiny_dev_tsv, workers=1)
    sweep(cfg, tmp_path / "a", ray_address, 120)
    first = warm_pids()
    # headsweep's files as a reinstall leaves them: the same text, a new modification time
    source = Path(headsweep.__file__).parent / "errors.py"
    before = source.stat()
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    try:
        sweep(cfg, tmp_path / "b", ray_address, 120)
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert len(warm_pids()) == 1 and warm_pids() != first  # the stale worker ended, a new one kept
    assert scores(tmp_path / "a") == scores(tmp_path / "b")
    end_warm_workers()


def test_a_killed_driver_lets_its_warm_workers_go(tmp_path, ray_address, wide_bert_dir, tiny_dev_tsv):
    """SIGKILL leaves no `release`: the workers see their driver's Ray job end, and end."""
    end_warm_workers()
    cfg = config(tmp_path, wide_bert_dir, tiny_dev_tsv, workers=1, experiments=["baseline", "single_head",
                                                                                "all_but_one"], batch_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(cfg), "--store", str(tmp_path / "s"),
                             "--address", ray_address, "--keep-workers", "600"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        for line in proc.stderr:
            if "workers ready:" in line:
                break
        assert len(warm_names()) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while warm_names() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert warm_names() == set()


def test_a_warm_worker_lost_mid_run_is_restarted_for_the_run_holding_it(tmp_path, ray_address, tiny_bert_dir,
                                                                        tiny_dev_tsv):
    """Ray restarts a lost warm worker with the arguments of the run that started it, an earlier one: the run holding it
    takes it back (its own config), the run completes with every evaluation once, and the worker stays warm."""
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    end_warm_workers()
    # started by a run of its own (this process's Ray job: it stays; a driver gone would be the same to the worker)
    sweep(config(tmp_path, tiny_bert_dir, tiny_dev_tsv, name="first"), tmp_path / "first", ray_address, 600)
    slow = write_tsv(generate(800, seed=3), tmp_path / "slow.tsv")  # long enough to lose a worker mid-run
    cfg = config(tmp_path, tiny_bert_dir, slow, experiments=["baseline", "single_head", "all_but_one"], batch_size=8,
                 masks_per_batch=1, flush_every=1)
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(cfg), "--store", str(tmp_path / "s"),
                             "--address", ray_address, "--quiet", "--keep-workers", "600"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "workers ready:" in line:
                break
        assert "2 of 2 workers kept warm" in "".join(lines)
        pid = max(worker_pids("".join(lines)))
        store = tmp_path / "s"
        deadline = time.monotonic() + 120
        while not (store / "evaluations").exists() or len(scores(store)) < 3:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + err
    assert proc.returncode == 0, log
    assert re.search(r"worker worker-\d@\S+ restarted as worker-\d@\S+", log), log
    rows = scores(tmp_path / "s")
    assert len(rows) == len({r[0] for r in rows}) == 17 and {r[2] for r in rows} == {800}
    time.sleep(2 * warm.WATCH_EVERY_S)  # the restarted worker's first run is gone: it must not end on that
    assert len(warm_names()) == 2
    end_warm_workers()


def _warn(worker, text: str) -> None:
    logging.getLogger("headsweep.workers.test").warning("%s", text)


def test_a_warm_workers_warnings_reach_the_run_holding_it(tiny_bert_dir, tiny_dev_tsv, ray_address):
    """Ray forwards a detached actor's output to the driver that started it only: the run holding a warm worker
    fetches its warnings."""
    from ray import cloudpickle

    from headsweep.sweep.configuration.config import build_config
    from headsweep.workers.families.registry import model_family

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _warn runs in the worker
    end_warm_workers()
    cfg = build_config({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                        "data": {"path": str(tiny_dev_tsv)}})

    runtime = model_family("hf_classifier").runtime(device="cpu", threads=1)
    setup = [("worker-0", "hf_classifier", cfg.model, cfg.data, runtime)]
    [actor], kept = warm_workers.take_workers(1, warm_workers.Shape(1.0, 0.0, 0), setup, 60)
    assert kept == 0
    ray.get(actor.run.remote(_warn, "a note from the worker"))
    assert warm_workers.notes([actor]) == ["headsweep: warning: a note from the worker"]
    assert warm_workers.notes([actor]) == []
    assert warm_workers.release([actor]) == []
    [again], kept = warm_workers.take_workers(1, warm_workers.Shape(1.0, 0.0, 0), setup, 60)
    assert kept == 1
    ray.get(again.run.remote(_warn, "a second note"))
    assert warm_workers.release([again]) == ["headsweep: warning: a second note"]
    end_warm_workers()


def test_process_start_puts_back_what_a_run_changed():
    """Threads, the random generators and the environment as the worker's process started, whatever a run did."""
    import random

    import numpy as np
    import torch

    start = warm.ProcessStart.now()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    start.restore()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    os.environ["HEADSWEEP_TEST_LEFT_BEHIND"] = "1"
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    start.restore()
    assert torch.get_num_threads() == threads
    assert "HEADSWEEP_TEST_LEFT_BEHIND" not in os.environ
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--keep-workers", "-1"], {}, "--keep-workers must be 0 or more seconds (0: workers end with the run), got '-1'"),
    (["--keep-workers", "soon"], {}, "--keep-workers must be a number of seconds, got 'soon'"),
    ([], {"HEADSWEEP_KEEP_WORKERS": "nan"}, "$HEADSWEEP_KEEP_WORKERS must be 0 or more seconds"),
])
def test_a_bad_keep_time_is_refused_before_anything_starts(tmp_path, tiny_bert_dir, tiny_dev_tsv, args, env,
                                                           expected):
    cfg = config(tmp_path, tiny_bert_dir, tiny_dev_tsv)
    proc = run_cli("run", str(cfg), "--store", str(tmp_path / "s"), "--address", "127.0.0.1:1", "--quiet", *args,
                   env=env)
    assert proc.returncode == 2, proc.stderr
    assert expected in error_line(proc.stderr) and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists()


def test_keep_workers_without_a_cluster_is_refused(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    cfg = config(tmp_path, tiny_bert_dir, tiny_dev_tsv)
    proc = run_cli("run", str(cfg), "--store", str(tmp_path / "s"), "--quiet", "--keep-workers", "30")
    assert proc.returncode == 2, proc.stderr
    assert error_line(proc.stderr) == (
        "headsweep: error: --keep-workers needs --address: an embedded Ray instance ends with its run, and its "
        "workers with it (start a cluster with `ray start --head` and pass its address)")
    assert not (tmp_path / "s").exists()
