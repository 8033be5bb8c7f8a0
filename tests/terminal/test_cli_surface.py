"""The whole CLI surface against empty, missing, cluttered and damaged stores: never a traceback.

Every command's ``--help`` works; every command that reads a store gets, for each kind of store,
either a normal answer (exit 0) or exactly one ``headsweep: error:`` line (exit 2), and leaves the
store as it found it. Closed pipes and Ctrl-C end a query as Unix tools do (0 and 130).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import REPO, default_sigint, error_line, run_cli
from small_store import small_store

COMMANDS = ["run", "query", "runs", "status", "report", "submit", "jobs", "compare", "export", "demo"]


def test_every_help_page():
    pages = [("--help",), *((c, "--help") for c in COMMANDS), ("jobs", "list", "--help"), ("jobs", "wait", "--help")]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda args: run_cli(*args), pages))
    for args, proc in zip(pages, procs, strict=True):
        assert proc.returncode == 0, (args, proc.stderr)
        assert proc.stdout.startswith("usage: headsweep"), (args, proc.stdout[:200])
        assert "Traceback" not in proc.stderr and proc.stderr.strip() == "", (args, proc.stderr)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv) -> dict[str, Path]:
    """An empty folder, a missing one, a real store with a stray file and a real store with a damaged file."""
    real, _, _ = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    root = tmp_path_factory.mktemp("surface")
    (root / "empty").mkdir()
    stray = shutil.copytree(real, root / "stray")
    (stray / "runs" / "NOTES.txt").write_text("notes\n")
    corrupt = shutil.copytree(real, root / "corrupt")
    [run_file] = (corrupt / "runs").rglob("*.parquet")
    run_file.write_bytes(run_file.read_bytes()[:64])
    return {"empty": root / "empty", "missing": root / "missing", "stray": stray, "corrupt": corrupt}


def listing(root: Path) -> dict[str, bytes]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_command_against_every_kind_of_store(stores, tmp_path, tiny_bert_dir, tiny_dev_tsv):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                                      "data": {"path": str(tiny_dev_tsv)}}))
    for kind, store in stores.items():
        before = listing(store)
        calls = [
            ("query", "SELECT count(*) FROM evaluations"),
            ("query", "SELECT * FROM heads LIMIT 3"),
            ("runs",),
            ("status", "no-such-run"),
            ("report", "no-such-run", "--out", str(tmp_path / "report")),
            ("compare", "run-a", "run-b"),
            ("export", str(config), "--from-run", "no-such-run", "--level", "0.5", "--out", str(tmp_path / "x")),
        ]
        with ThreadPoolExecutor(2) as pool:
            procs = list(pool.map(lambda args, s=store: run_cli(*args, "--store", str(s)), calls))
        for args, proc in zip(calls, procs, strict=True):
            where = (kind, args, proc.returncode, proc.stderr[-2000:])
            assert "Traceback" not in proc.stderr + proc.stdout, where
            assert proc.returncode in (0, 2), where
            if proc.returncode == 2:
                line = error_line(proc.stderr)
                # Commands that read every run name the damaged file; those that look up one run by id
                # read only its partition and answer as for any unknown run.
                if kind == "corrupt" and args[0] in ("query", "runs"):
                    assert "not a readable Parquet file" in line, where
        assert listing(store) == before, kind
    for args in (("submit", str(config)), ("jobs", "list")):
        proc = run_cli(*args, env={"RAY_API_SERVER_ADDRESS": ""})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        error_line(proc.stderr)


def test_run_against_a_damaged_store_names_the_file(stores, tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                                      "data": {"path": str(tiny_dev_tsv)}, "sweep": {"experiments": ["baseline"]}}))
    store = stores["corrupt"]
    before = listing(store)
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "not a readable Parquet file" in error_line(proc.stderr)
    assert listing(store) == before


def cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "headsweep", *args], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "default"}, **kwargs)


def test_a_closed_pipe_ends_a_query_quietly(tmp_path):
    (tmp_path / "s").mkdir()  # an empty store: a store path where nothing is gets "no store at"
    reader = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc = cli("query", "SELECT * FROM range(300000) t(i)", "--format", "csv", "--store", str(tmp_path / "s"),
               stdout=reader.stdin, stderr=subprocess.PIPE)
    reader.stdin.close()
    _, err = proc.communicate(timeout=120)
    first = reader.stdout.read()
    reader.wait(timeout=30)
    assert first == "i\n"
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_ctrl_c_during_a_query_is_exit_130(tmp_path):
    (tmp_path / "s").mkdir()
    proc = cli("query", "SELECT count(*) FROM range(100000000000) a", "--store", str(tmp_path / "s"),
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    time.sleep(6)  # past start-up: the query is running
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "headsweep: interrupted" and "Traceback" not in err, err
    assert out == ""
