"""Faults a store shared by a cluster service meets: several drivers writing one store at once (a folder, and S3),
and a store whose file system fills during a run.

Each run is compared with the same config run alone: its significance rows and its views, every column but
``run_id``, are the same.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import yaml
from conftest import REPO, error_line, run_cli
from s3_server import CREDENTIALS, s3_server, s3_store_uri

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.schema import TABLES
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.run.claim import PREFIX, store_claim
from headsweep.sweep.run.runs import check_still_resumable

# Each run lasts a few seconds on the tiny model, longer than two drivers started together take to differ.
N_EXAMPLES = 1000
EXPERIMENTS = {"heads": ["baseline", "single_head"], "layers": ["baseline", "all_but_one"]}
N_EVALS = 9  # baseline + the tiny 2x4 BERT's 8 heads (single_head), or its 8 layers' heads kept alone
VIEWS = {"deltas": "eval_id, test", "heads": "attention, layer, head", "layers": "attention, layer"}


@dataclass
class Alone:
    """A config's run made alone: its store, its id, and what it holds (``outcome``)."""

    store: ResultStore
    run_id: str
    outcome: dict


@pytest.fixture(scope="module")
def configs(tmp_path_factory, tiny_bert_dir) -> dict[str, Path]:
    """Two configs of one model and data, differing in their experiments: one worker each, one thread."""
    folder = tmp_path_factory.mktemp("configs")
    data = write_tsv(generate(N_EXAMPLES, seed=5), folder / "dev.tsv")
    paths = {}
    for name, experiments in EXPERIMENTS.items():
        cfg = {"name": name, "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
               "data": {"path": str(data)},
               "sweep": {"experiments": experiments, "workers": 1, "num_cpus_per_worker": 0.5,
                         "threads_per_worker": 1, "batch_size": 8, "masks_per_batch": 1, "flush_every": 8,
                         "flush_seconds": 600}}
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
    return paths


@pytest.fixture(scope="module")
def alone(configs, tmp_path_factory, ray_address) -> dict[str, Alone]:
    """Each config's run made alone, in a store of its own (the two drivers side by side)."""
    stores = {name: str(tmp_path_factory.mktemp(f"alone-{name}") / "store") for name in configs}
    results = finish([start(configs[name], stores[name], ray_address) for name in configs])
    found = {}
    for name, (code, out, err) in zip(configs, results, strict=True):
        assert code == 0, err
        store = ResultStore(stores[name])
        found[name] = Alone(store, out.strip(), outcome(store, out.strip()))
    return found


@pytest.fixture(scope="module")
def s3_endpoint():
    with pytest.MonkeyPatch.context() as mp, s3_server(mp) as endpoint:
        yield endpoint


def outcome(store: ResultStore, run_id: str) -> dict:
    """The run's rows of every table (counted), its significance rows and its views, without ``run_id``."""
    found: dict = {"rows": {table: store.read(table, run_id).num_rows for table in TABLES}}
    sig = store.read("significance", run_id).drop_columns(["run_id"]).to_pylist()
    found["significance"] = [comparable(r) for r in sorted(sig, key=lambda r: (r["eval_id"], r["test"]))]
    for view, order in VIEWS.items():
        sql = f"SELECT * EXCLUDE (run_id) FROM {view} WHERE run_id = ? ORDER BY {order}"
        found[view] = [comparable(r) for r in run_query(store, sql, [run_id]).to_pylist()]
    return found


def comparable(row: dict) -> dict:
    """``row`` with NaN (no interval where a test has none) as a value equal to itself."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def assert_same(found: dict, expected: dict) -> None:
    """``outcome`` of two runs equal; a difference is shown as the first row that differs, column by column."""
    assert found["rows"] == expected["rows"]
    for key in [k for k in expected if k != "rows"]:
        assert len(found[key]) == len(expected[key]), key
        for a, b in zip(found[key], expected[key], strict=True):
            assert a == b, (key, {c: (a[c], b[c]) for c in a if a[c] != b[c]})


def start(config: Path, store: str, ray_address: str, env: dict | None = None, limit_bytes: int | None = None
          ) -> subprocess.Popen:
    """``headsweep run`` as a driver process of its own; ``limit_bytes``: the largest file it may write
    (RLIMIT_FSIZE, the driver alone: the session's Ray workers are not its children)."""

    def file_size_limit() -> None:
        # Ignored, SIGXFSZ would kill the driver; so a write past the limit fails with EFBIG, as ENOSPC would.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    argv = [sys.executable, "-m", "headsweep", "run", str(config), "--store", store, "--address", ray_address,
            "--quiet"]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
                            preexec_fn=None if limit_bytes is None else file_size_limit)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Exit code, stdout and stderr of each driver, once all have ended."""
    outputs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def assert_runs_listed(store: str, run_ids: list[str], env: dict | None = None) -> None:
    listed = run_cli("runs", "--store", store, "--format", "csv", env=env)
    assert listed.returncode == 0, listed.stderr
    for run_id in run_ids:
        assert run_id in listed.stdout, listed.stdout


@pytest.mark.parametrize("where", [
    "folder",
    # Three drivers at once on S3: the claim's S3 path is test_the_claim_is_held_by_one_driver_at_a_time[s3]
    # (in-process), a sweep through the CLI into S3 tests/results/test_s3_store.py; the race through the CLI: folder
    pytest.param("s3", marks=pytest.mark.slow)])
def test_two_configs_and_one_twice_into_one_store_at_once(where, configs, alone, tmp_path, ray_address, request):
    """Three drivers started together: two configs finish as if run alone; the same config twice makes one run,
    the other driver refusing in one line, with nothing of its own left in the store."""
    env = None
    if where == "s3":
        store, env = s3_store_uri(request.getfixturevalue("s3_endpoint"), "shared", "team/store"), CREDENTIALS
    else:
        store = str(tmp_path / "store")
    heads, layers, heads_again = finish([start(configs[name], store, ray_address, env=env)
                                         for name in ("heads", "layers", "heads")])
    assert layers[0] == 0, layers[2]
    won, lost = (heads, heads_again) if heads[0] == 0 else (heads_again, heads)
    assert won[0] == 0 and lost[0] == 2, (won[2], lost[2])
    run_ids = {"heads": won[1].strip(), "layers": layers[1].strip()}
    line = error_line(lost[2])
    # the winner still writing, or (its workers kept warm from an earlier run: no process start) done already
    assert (f"run {run_ids['heads']} of this config is still being written by the driver" in line
            or f"another driver completed run {run_ids['heads']} of this config" in line), line
    assert "Traceback" not in lost[2] and lost[1] == ""

    reader = ResultStore(store)
    assert sorted(reader.read("runs").column("run_id").to_pylist()) == sorted(run_ids.values())
    assert_runs_listed(store, list(run_ids.values()), env=env)
    for name, run_id in run_ids.items():
        assert_same(outcome(reader, run_id), alone[name].outcome)
    found = [i.path[len(reader.root) + 1:] for i in reader.fs.get_file_info(pafs.FileSelector(reader.root,
                                                                                              recursive=True))]
    assert not [p for p in found if "/." in f"/{p}"]  # no claim or temporary file left behind
    partitions = {p.split("/")[1] for p in found if "/" in p}
    assert partitions == {f"run_id={run_id}" for run_id in run_ids.values()}  # the refused driver wrote nothing


def test_the_run_to_continue_is_checked_again_under_the_claim(configs, alone, tmp_path):
    """What another driver of the config wrote between a driver's choice and its first row: a run it is writing
    refuses this driver; a run it left unfinished (so the choice is stale) asks for the command again."""
    cfg = load_config(configs["heads"])
    row = alone["heads"].store.run(alone["heads"].run_id)
    assert row["config_hash"] == cfg.hash()
    store = ResultStore(str(tmp_path / "store"))
    with subprocess.Popen(["sleep", "60"]) as other:
        facts = json.dumps({"driver": f"{socket.gethostname()}:{other.pid}"})
        store.write_rows("runs", "r1", [{**row, "status": "running", "facts": facts}], "run")
        with pytest.raises(HeadsweepError, match="run r1 of this config is still being written by the driver"):
            check_still_resumable(store, cfg, None, True, before=None)
        other.kill()
    with pytest.raises(HeadsweepError, match="another driver started or stopped a run of this config"):
        check_still_resumable(store, cfg, None, True, before=None)  # r1's driver died: r1 is to be resumed now
    check_still_resumable(store, cfg, None, True, before=store.run("r1"))
    check_still_resumable(store, cfg, None, False, before=None)  # --new: a run of its own whatever is there


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_the_claim_is_held_by_one_driver_at_a_time(where, tmp_path, request):
    """Drivers racing for one config's claim enter one at a time; the claim of a driver that died is taken over."""
    if where == "s3":
        store = ResultStore(s3_store_uri(request.getfixturevalue("s3_endpoint"), f"claims-{os.getpid()}", "store"))
    else:
        store = ResultStore(str(tmp_path / "store"))
    inside, most, entries = [0], [0], [0]
    lock = threading.Lock()

    def contend() -> None:
        for _ in range(5):
            with store_claim(store, "cfg"):
                with lock:
                    inside[0] += 1
                    entries[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.01)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=contend) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert entries[0] == 20 and most[0] == 1

    with subprocess.Popen(["true"]) as gone:
        pass  # a process that has ended: its pid names no driver
    dead = f"{store.root}/{PREFIX}cfg-dead"
    store.fs.create_dir(store.root, recursive=True)
    with store.fs.open_output_stream(dead) as out:
        out.write(f'{{"owner": "{socket.gethostname()}:{gone.pid}"}}'.encode())
    started = time.monotonic()
    with store_claim(store, "cfg"):
        assert time.monotonic() - started < 5
    names = [i.base_name for i in store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))]
    assert not [n for n in names if n.startswith(PREFIX)]


def test_a_full_store_stops_in_one_line_stays_readable_and_resumes(configs, alone, tmp_path, ray_address):
    """The driver may write no file larger than the baseline's chunk: the single-head chunk after it fails as on
    a full disk. The store still reads, and the same command without the limit finishes the run."""
    store = str(tmp_path / "store")
    logs = {"HEADSWEEP_LOG_DIR": str(tmp_path / "logs")}
    [(code, out, err)] = finish([start(configs["heads"], store, ray_address, env=logs, limit_bytes=LIMIT)])
    assert code == 2 and out == "", err
    line = error_line(err)
    assert "Traceback" not in err
    assert f"store {store} is full (or past a file-size limit): " in line, line
    assert "MiB more are needed; free space and run the same command to resume" in line, line
    reader = ResultStore(store)
    [failed] = reader.read("runs").to_pylist()
    assert failed["status"] == "failed" and failed["n_done"] == 1, failed  # the baseline's chunk landed
    assert not [f for _, _, files in os.walk(store) for f in files if f.startswith(".")]  # the partial file went

    assert_runs_listed(store, [failed["run_id"]])
    query = run_cli("query", "SELECT eval_id FROM evaluations", "--store", store, "--format", "csv")
    assert query.returncode == 0 and query.stdout.split() == ["eval_id", "baseline"], query.stderr

    rerun = run_cli("run", str(configs["heads"]), "--store", store, "--address", ray_address, "--quiet", env=logs)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.strip() == failed["run_id"]
    assert f"resuming run {failed['run_id']}: 1 evaluations already stored" in rerun.stderr
    assert reader.run(failed["run_id"])["status"] == "complete"
    assert_same(outcome(reader, failed["run_id"]), alone["heads"].outcome)


# Bytes: above the run's row (18 KB) and the baseline's examples chunk (9 KB), below the examples chunk of eight
# single-head evaluations (46 KB).
LIMIT = 32 * 1024
