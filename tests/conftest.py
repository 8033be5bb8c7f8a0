"""Shared fixtures: one local Ray instance per test session, tiny models saved to disk."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

# The tests' Ray head is private to the session: no token auth, and nothing written to ~/.ray.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Hub ids resolve in a Hugging Face cache private to the session (test_hub_cache lays models out in it), never
# the user's; set before the session's Ray instance starts, so that its workers resolve in it too.
HUB_CACHE = Path(tempfile.mkdtemp(prefix="headsweep-test-hub-"))
os.environ["HF_HUB_CACHE"] = str(HUB_CACHE)
atexit.register(shutil.rmtree, HUB_CACHE, True)
# Runs on the session's Ray instance (--address) keep their workers warm for the next run of the same shape
# (headsweep.sweep.cluster.warm_workers): ~150 worker starts of 7-9 CPU-s each were a third of the suite's time.
# Tests about workers that end with their run set it to 0; embedded instances (no --address) never keep any.
os.environ.setdefault("HEADSWEEP_KEEP_WORKERS", "600")

# The experiment kinds' tables and views, registered as every headsweep entry point registers them (the CLI, the
# driver, headsweep.open_store), for the tests that query a store through headsweep.results directly.
import headsweep.sweep.experiments  # noqa: E402, F401

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config):
    """Byte-compile headsweep's modules once, before the test processes start (only stale files: a second session
    finds them current). The suite starts several hundred Python processes (CLI drivers, Ray workers) that import
    headsweep; where ``PYTHONDONTWRITEBYTECODE`` is set, as on the development machine, none of them writes a
    ``.pyc``, and each compiled the modules it imports from source again (0.4-0.8 CPU-s a process)."""
    if hasattr(config, "workerinput"):  # an xdist test process: its controller compiled them
        return
    import compileall

    for package in ("sweep", "workers", "results", "headsweep"):
        compileall.compile_dir(REPO / package, quiet=1)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` handing out files in the order collected (:func:`pytest_collection_modifyitems`), not
    xdist's default of the most tests first: a file of a few long CLI runs handed out last kept one process busy
    for a minute while the other had finished."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest files first (``tests/file_seconds.json``, the last full run's times), each file's tests in their
    own order: longest-first list scheduling leaves only short files for the end."""
    from file_seconds import UNKNOWN_S, read_table

    seconds = read_table()
    files = {item.nodeid.split("::")[0] for item in items}
    order = {path: rank for rank, path in enumerate(sorted(files, key=lambda f: (-seconds.get(f, UNKNOWN_S), f)))}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module: tiny models run fastest so, and two threads per process
    thrash when other processes share the two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_address():
    """Address of the session's local Ray instance (started once, ~5 s)."""
    import ray

    # Three logical CPUs: two workers plus headroom (headsweep refuses workers that hold every CPU).
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A tiny BERT classifier (random weights, word-level tokenizer) saved with save_pretrained."""
    from tiny_models import save_tiny_classifier

    return save_tiny_classifier(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="session")
def wide_bert_dir(tmp_path_factory) -> Path:
    """The tiny BERT classifier with 4 layers of 4 heads: 33 evaluations for baseline, single-head and all-but-one.
    Tests that stop a run after its first few rows use it with few examples: a long run in masks (what they
    interrupt between) rather than in examples per mask (what an interrupt waits for)."""
    from tiny_models import save_tiny_classifier

    return save_tiny_classifier(tmp_path_factory.mktemp("models") / "wide-bert", layers=4)


@pytest.fixture(scope="session")
def tiny_dev_tsv(tmp_path_factory) -> Path:
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    return write_tsv(generate(40, seed=7), tmp_path_factory.mktemp("data") / "dev.tsv")


@pytest.fixture(scope="session")
def trained_tiny_fairseq(tmp_path_factory):
    """tests/tiny_fairseq.py's trained translation model (``TinyFairseq``), trained once per test process (~4 s)
    and shared by the modules that only read it: never write into its folders."""
    import torch
    from tiny_fairseq import train_tiny

    # one thread: the same weights whichever module asks first, whatever thread count it runs with
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_tiny(tmp_path_factory.mktemp("tiny_fairseq_shared"))
    finally:
        torch.set_num_threads(before)


def install_entry_point(folder: Path, group: str, name: str, value: str) -> Path:
    """Declare entry point ``name = value`` in ``group`` for the distribution on path entry ``folder``, as pip
    installs one (a ``.dist-info`` folder beside the code): ``importlib.metadata`` finds it wherever ``folder`` is
    on ``sys.path`` or ``PYTHONPATH``. Returns ``folder``."""
    dist = folder / f"{name}_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")
    return folder


def default_sigint() -> None:
    """``preexec_fn`` for a CLI the test will interrupt: Ctrl-C back to its default.

    A shell that starts the suite in the background (no job control) starts it with SIGINT
    ignored, children inherit that, and Python then never raises KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real ``headsweep`` CLI as a subprocess."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "headsweep", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def sweep_in_process(config: dict, folder: Path, name: str, store: Path | str, ray_address: str) -> str:
    """Run ``config`` (written to ``folder/name.yaml``) into ``store`` with ``headsweep.run`` in the test's own
    process, on the session's Ray instance; returns the run id.

    For a store a test only reads: ``headsweep run`` as a subprocess costs a driver process (Python, Ray and
    pyarrow started, ~3 CPU-s) on top of the run. The tests about the ``run`` command itself run the CLI."""
    import headsweep

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return headsweep.run(str(path), store=str(store), address=ray_address, show_progress=False)


def run_refused(config: Path, store: Path, ray_address: str, *parts: str) -> str:
    """``headsweep run config`` into ``store``: exit 2, one error line holding every one of ``parts``, no
    traceback, nothing on stdout, and no store folder; returns the line."""
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == "", proc.stderr
    for part in parts:
        assert part in line, line
    assert not store.exists()
    return line


@contextlib.contextmanager
def folder_taking_no_files(folder: Path):
    """``folder`` made immutable (``chattr +i``: root too is refused) or, where that is not allowed (no
    CAP_LINUX_IMMUTABLE), read-only, inside the block; as it was after."""
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    mode = folder.stat().st_mode
    if not immutable:
        folder.chmod(0o555)
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        else:
            folder.chmod(mode)


def error_line(stderr: str | list[str]) -> str:
    """The one ``headsweep: error: ...`` line a failed command printed (asserts there is exactly one)."""
    lines = stderr.splitlines() if isinstance(stderr, str) else [x.rstrip("\n") for x in stderr]
    errors = [x for x in lines if x.startswith("headsweep: error:")]
    assert len(errors) == 1, "\n".join(lines[-20:])
    return errors[0]
