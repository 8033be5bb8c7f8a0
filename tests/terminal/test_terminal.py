"""A quiet terminal: commands print only headsweep's own lines; other libraries' output goes to a log file.

The real CLI as a subprocess, with Python's warnings switched on (``PYTHONWARNINGS=default``; ``run_cli``
would otherwise set ``ignore``), so that the capture, not a warnings filter, keeps them off the console.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli

# Every line headsweep itself writes on stderr (sweeps and the demo). A line of any other shape on a
# command's stderr is another library's, and fails these tests.
STDERR_SHAPES = {
    "log file": r"log: \S+\.log \(other libraries' messages; --verbose shows them here\)",
    "workers ready": r"\d+ workers ready: \S+(, \S+)*",
    "workers waiting": r"\d+ of \d+ workers ready after \d+ s: .+",
    "warm workers": r"\d+ of \d+ workers kept warm by an earlier run: no process start",
    "progress": r"evaluations: \d+/\d+ \(\d+%\) \d+\.\d\d/s elapsed \d+:\d\d:\d\d ETA (\d+:\d\d:\d\d|\?)( \[\S+\])?",
    "worker state": r"workers: \S+ \d+ done, (busy|idle|lost)(; \S+ \d+ done, (busy|idle|lost))*",
    "resumed": r"resuming run \S+: \d+ evaluations already stored",
    "lost worker": r"worker \S+ lost \(\w+\), .+",
    "long step starts": r"[a-z][\w /-]* \.\.\.",
    "long step ends": r"[a-z][\w /-]*: done in \d+\.\d s",
    "warning": r"headsweep: warning: .+",
    "error": r"headsweep: (error: .+|interrupted.*)",
    # the demo
    "demo training": r"training the demo [\w ]+ \(once; cached in \S+\) \.\.\.",
    "demo epochs": r"training the demo [\w ]+: \d+/\d+ \(\d+%\) \S+ \S+ elapsed \d+:\d\d:\d\d ETA \S+( .+)?",
    "demo model": r"training fairseq transformer: .+",
    "demo sweep": r"sweeping the heads of the demo [\w ]+ on \d+ worker\(s\) \.\.\.",
}
ALLOWED = re.compile("|".join(f"(?:{shape})" for shape in STDERR_SHAPES.values()))
RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")
# The live line on a terminal: phase, count, bar, percent, rate, elapsed, ETA, worker state.
LIVE = re.compile(r"[\w/ ]+ \d+/\d+ .{16} +\d+% (\S+ evals/s|\d+\.\d s/eval) "
                  r"elapsed \d\d:\d\d ETA (\?|\d\d:\d\d)(, .+)?")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Warnings on: the capture must hold without run_cli's PYTHONWARNINGS=ignore.
LOUD = {"PYTHONWARNINGS": "default"}


def foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not ALLOWED.fullmatch(line)]


def log_file(stderr: str) -> Path:
    [line] = [x for x in stderr.splitlines() if x.startswith("log: ")]
    return Path(line.split()[1])


@pytest.fixture(scope="module")
def classifier_config(tmp_path_factory, tiny_bert_dir, tiny_dev_tsv) -> Path:
    path = tmp_path_factory.mktemp("terminal") / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "terminal",
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one"], "batch_size": 16, "workers": 2},
    }))
    return path


def test_a_sweep_prints_only_headsweep_lines(classifier_config, ray_address):
    store = classifier_config.parent / "store"
    proc = run_cli("run", str(classifier_config), "--store", str(store), "--address", ray_address, env=LOUD)
    assert proc.returncode == 0, proc.stderr
    assert RUN_ID.fullmatch(proc.stdout.strip()), proc.stdout
    assert foreign_lines(proc.stderr) == [], proc.stderr
    assert any(line.startswith("evaluations: ") for line in proc.stderr.splitlines()), proc.stderr
    # Other libraries' messages are in the log file beside the store, named once on stderr.
    log = log_file(proc.stderr)
    assert log.parent == store.parent / "headsweep-logs" and proc.stderr.count("log: ") == 1
    text = log.read_text()
    assert "Connecting to existing Ray cluster" in text  # Ray's driver-side INFO record
    assert "workers ready:" in text  # with headsweep's own lines for context


def test_verbose_shows_what_the_log_file_holds(classifier_config, ray_address):
    """The baseline alone on one worker: what --verbose shows (Ray's driver-side records) comes with any run, and a
    second worker and the grid would only add an actor's start and evaluations."""
    store = classifier_config.parent / "store-verbose"
    logs = store.parent / "headsweep-logs"
    before = set(logs.glob("*.log"))
    proc = run_cli("run", str(classifier_config), "sweep.experiments=[baseline]", "sweep.workers=1", "--store",
                   str(store), "--address", ray_address, "--verbose", env=LOUD)
    assert proc.returncode == 0, proc.stderr
    assert RUN_ID.fullmatch(proc.stdout.strip()), proc.stdout
    foreign = foreign_lines(proc.stderr)
    assert any("Connecting to existing Ray cluster" in line for line in foreign), proc.stderr
    assert not [x for x in proc.stderr.splitlines() if x.startswith("log: ")]
    assert set(logs.glob("*.log")) == before  # nothing captured, so no log file


def test_short_commands_leave_no_empty_log(tmp_path):
    proc = run_cli("runs", "--store", str(tmp_path / "store"), env=LOUD)
    assert proc.returncode == 2 and proc.stderr.startswith(f"headsweep: error: no store at {tmp_path / 'store'}: "), \
        proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # neither a store nor an empty log folder


def run_on_terminal(*args: str, columns: int = 120, timeout: float = 300) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal (stdout a pipe): exit code, stdout, and what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, **LOUD}
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", *args], stdout=subprocess.PIPE, stderr=slave,
                            cwd=REPO, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the terminal closed with the process
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=timeout)
    reader.join(10)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_one_live_line(classifier_config, ray_address):
    """One worker: the live line's worker state (after its ETA) is free text to its shape, so a second worker would
    only add an actor's start; a two-worker run's lines: test_a_sweep_prints_only_headsweep_lines."""
    store = classifier_config.parent / "store-tty"
    code, out, terminal = run_on_terminal("run", str(classifier_config), "sweep.workers=1", "--store", str(store),
                                          "--address", ray_address)
    assert code == 0, terminal
    assert RUN_ID.fullmatch(out.strip()), out
    # The live line is redrawn in place (carriage returns), and each state of it has the live shape.
    pieces = [p.strip() for p in re.split(r"[\r\n]", ANSI.sub("", terminal)) if p.strip()]
    live = [p for p in pieces if LIVE.fullmatch(p)]
    others = [p for p in pieces if not LIVE.fullmatch(p) and not ALLOWED.fullmatch(p)]
    assert others == [], terminal
    assert "\r" in terminal.replace("\r\n", "") and live, terminal
    # The line's last state: the grid done (its last phase, all-but-one), with the per-worker state.
    assert re.match(r"all_but_one (\d+)/\1 .* 100% ", live[-1]) and " w0 " in f" {live[-1]}", live[-1]
    assert not any(p.startswith("evaluations: ") for p in pieces)  # no plain progress lines on a terminal


def with_unknown_words(source: Path, dest: Path) -> Path:
    """The test sentences with their first two words unknown to the model (about a quarter of the tokens)."""
    lines = [" ".join(["qqqq", "zzzz", *line.split()[2:]]) for line in source.read_text().splitlines()]
    dest.write_text("\n".join(lines) + "\n")
    return dest


def test_a_fairseq_sweep_is_quiet_too(tmp_path_factory, ray_address):
    """fairseq and hydra are the noisiest; a worker's own warning still reaches the console, once."""
    import dataclasses

    from tiny_fairseq import TINY_SETTINGS

    from headsweep.sweep.demo.translation import prepare_synthetic
    from headsweep.workers.families.fairseq_translation.train import train_translation

    tmp = tmp_path_factory.mktemp("terminal_fairseq")
    data = prepare_synthetic(tmp / "data", n_train=1200, n_valid=40, n_test=40, seed=3)
    settings = dataclasses.replace(TINY_SETTINGS, max_epochs=2, save_every_epoch=False)
    model = train_translation(data.data_bin, tmp / "checkpoints", "src", "tgt", settings)
    config = tmp / "translation.yaml"
    config.write_text(yaml.safe_dump({
        "name": "terminal-translation",
        "model": {"kind": "fairseq_translation", "checkpoint": str(model.checkpoint), "data_bin": str(data.data_bin),
                  "beam": 2},
        "data": {"source": str(with_unknown_words(data.test_source, tmp / "noisy.src")),
                 "target": str(data.test_target)},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 20, "workers": 2},
    }))
    proc = run_cli("run", str(config), "--store", str(tmp / "store"), "--address", ray_address, env=LOUD)
    assert proc.returncode == 0, proc.stderr
    assert RUN_ID.fullmatch(proc.stdout.strip()), proc.stdout
    assert foreign_lines(proc.stderr) == [], proc.stderr
    # Both workers load the data and warn; the console shows the warning once, the log file has the rest.
    unknown = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:") and "unknown" in x]
    assert len(unknown) == 1 and "of the source tokens" in unknown[0], proc.stderr
    assert "(EvalWorker pid=" in log_file(proc.stderr).read_text()


def test_importing_headsweep_leaves_logging_alone():
    """A program that imports headsweep's modules keeps its logging, warnings and file descriptors."""
    code = """
import logging, os, sys, warnings
before = (os.fstat(1).st_ino, os.fstat(2).st_ino, warnings.showwarning)
import headsweep.sweep.terminal.cli, headsweep.sweep.run.driver, headsweep.sweep.demo, headsweep.sweep.output.progress
import headsweep.sweep.output.console, headsweep.sweep.cluster.ray_session
assert logging.getLogger().handlers == [], logging.getLogger().handlers
assert logging.getLogger("headsweep").handlers == []
assert (os.fstat(1).st_ino, os.fstat(2).st_ino, warnings.showwarning) == before
assert headsweep.sweep.output.console.current() is None
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_warnings_go_to_the_log_even_when_they_point_into_headsweep(tmp_path):
    """A library's warning is attributed to its caller's line (hydra's deprecation notices point at the demo's
    code); it still goes to the log file, while headsweep's own logger warnings reach the console."""
    code = f"""
import logging, warnings
from headsweep.sweep.output import console
console.setup("check", store={str(tmp_path / "store")!r})
warnings.warn_explicit("a deprecated keyword", UserWarning, {str(REPO / "sweep" / "demo" / "translation.py")!r}, 118)
print("a library's print")
logging.getLogger("headsweep.workers.families.x").warning("the data look odd")
console.out("result")
console.finish()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **LOUD})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "result\n"
    lines = proc.stderr.splitlines()
    assert lines[0] == "headsweep: warning: the data look odd" and foreign_lines(proc.stderr) == [], proc.stderr
    text = log_file(proc.stderr).read_text()
    assert "UserWarning: a deprecated keyword" in text and "a library's print" in text
