"""The processes of an embedded Ray instance end with the driver that started it, however the driver ends.

``ray.init`` without an address starts a private instance: GCS, raylet, a dashboard process (and its module
subprocesses), and through the raylet its dashboard agent, runtime-env agent and workers. Ray ties the GCS and the
raylet to the driver (``PR_SET_PDEATHSIG``) and ends them all on ``ray.shutdown``, but the raylet's children are not
tied to anything: when the driver stops while they start (Ctrl-C or SIGTERM during ``ray.init``, a SIGKILL), the
raylet dies, and the agents, reparented to PID 1, live on, ignoring SIGTERM while their event loop is not running
yet (issue 45).

So before ``ray.init`` the driver starts a watchdog: a small process in a session of its own (Ctrl-C to the
terminal's process group does not reach it) whose standard input is a pipe that only the driver writes to. Every
process Ray starts for the instance inherits the driver's mark (``HEADSWEEP_EMBEDDED_RAY=<token>``, set in the
environment while ``ray.init`` runs, directly or through the raylet; nothing else has it). A mark in the
environment is not enough to find them later: a process that sets its title (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``, ``ray-dashboard-*Head``: Ray's ``setproctitle``) overwrites the memory that
``/proc/PID/environ`` shows, so from then on its mark cannot be read. The watchdog therefore watches from its start:
every ``WATCH_POLL_S`` it records the processes that carry the mark and every child of a recorded one, each by its
pid and start time (a pid used again is another process), so that a process stays recorded after its title hides
its mark, and one started by a recorded process is recorded however it is titled.

When the driver ends, whatever the way (done, error, signal, SIGKILL), or lets the instance go (``release``), the
pipe reads end of file; the watchdog then ends every recorded process and every one found after (marked, or a child
of a recorded one): SIGTERM, then SIGKILL ``TERM_GRACE_S`` later for any still there, and it keeps looking until none
is left and none has appeared for ``QUIET_S``.

The watchdog runs this file as a script (``python -I reaper.py TOKEN``): it imports nothing of headsweep's, so it
starts in tens of milliseconds. Linux only (it reads ``/proc``); elsewhere no watchdog is started.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

MARK = "HEADSWEEP_EMBEDDED_RAY"
# Seconds between the SIGTERM and the SIGKILL of a process; how long the watchdog keeps reaping at most.
TERM_GRACE_S = 1.0
REAP_FOR_S = 60.0
POLL_S = 0.1
# While the driver lives: often enough to see every agent before it sets its title (Python's start-up and Ray's
# imports take about a second before that), rarely enough to cost little (a scan of /proc: 1-3 ms of CPU with ~200
# processes, about 1% of a core).
WATCH_POLL_S = 0.2
QUIET_S = 6.0


class Watchdog:
    """The driver's side: the watchdog process and the mark it looks for."""

    def __init__(self) -> None:
        self.token = f"{os.getpid()}-{uuid.uuid4().hex}"
        # Started before the mark is set: the watchdog itself does not carry it.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), self.token], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """While the block runs (``ray.init``), processes started from this one carry the mark."""
        before = os.environ.get(MARK)
        os.environ[MARK] = self.token
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(MARK, None)
            else:
                os.environ[MARK] = before

    def release(self) -> None:
        """The instance is shut down (or never started): the watchdog ends what is left of it, and itself."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def start() -> Watchdog | None:
    """A watchdog for an embedded instance about to start; None where processes cannot be found by their mark."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    return Watchdog()


def stat(pid: int) -> tuple[int, int, bool] | None:
    """``(parent pid, start time in clock ticks, ended)`` of a process (ended: a zombie, waiting for its parent to
    collect it); None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything: the fields after its last ")".
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0] in (b"Z", b"X")


def carries(pid: int, needle: bytes) -> bool:
    """Whether the environment that ``/proc`` shows for ``pid`` holds ``needle`` (those of other users are not
    readable: not ours)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


class Instance:
    """The processes of one embedded instance, as far as seen: each by pid and start time."""

    def __init__(self, token: str) -> None:
        self.needle = f"{MARK}={token}".encode()
        self.me = os.getpid()
        self.driver = os.getppid()
        own = stat(self.me)
        # Nothing older than the watchdog can carry the mark (it is set after the watchdog starts).
        self.since = own[1] if own is not None else 0
        self.seen: dict[int, int] = {}
        # Processes looked at and not the instance's, by (pid, start time): their environment is fixed once they
        # run a program, except the driver's children, which may yet exec with the mark.
        self.foreign: set[tuple[int, int]] = set()

    def scan(self) -> dict[int, int]:
        """The instance's processes now running (pid -> start time): those seen before that still run, every new
        one that carries the mark, and every child of one of them."""
        now = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (info := stat(int(entry))) is not None:
                now[int(entry)] = info
        self.seen = {pid: start for pid, start in self.seen.items()
                     if pid in now and now[pid][1] == start and not now[pid][2]}
        # Oldest first: a parent is placed before its children, so a whole new subtree is taken in one scan.
        for pid, (ppid, start, ended) in sorted(now.items(), key=lambda item: (item[1][1], item[0])):
            if ended or pid == self.me or pid in self.seen or start < self.since or (pid, start) in self.foreign:
                continue
            if ppid in self.seen or carries(pid, self.needle):
                self.seen[pid] = start
            elif ppid != self.driver:
                self.foreign.add((pid, start))
        return dict(self.seen)


def watch(instance: Instance) -> None:
    """Until the driver ends (end of file on standard input): record the instance's processes as they start."""
    while True:
        instance.scan()
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select([0], [], [], WATCH_POLL_S)
            if readable:
                try:
                    if not os.read(0, 65536):
                        return
                except OSError:
                    return


def reap(instance: Instance) -> None:
    """End every process of the instance: SIGTERM first, SIGKILL ``TERM_GRACE_S`` later, until none is left and
    none has appeared for ``QUIET_S`` (or ``REAP_FOR_S`` have passed)."""
    termed: dict[tuple[int, int], float] = {}
    deadline = time.monotonic() + REAP_FOR_S
    quiet_since = None
    while time.monotonic() < deadline:
        running = instance.scan()
        now = time.monotonic()
        if not running:
            # Done once none is seen for QUIET_S, not at the first scan that sees none: a raylet being ended may
            # still have started an agent, whose environment could not be read yet.
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= QUIET_S:
                return
            time.sleep(POLL_S)
            continue
        quiet_since = None
        for pid, start in running.items():
            first = termed.setdefault((pid, start), now)
            if first == now or now - first >= TERM_GRACE_S:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM if first == now else signal.SIGKILL)
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    """The watchdog: record the instance's processes while the driver lives, then end them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver never stops the cleanup
    instance = Instance(argv[1])
    watch(instance)
    reap(instance)


if __name__ == "__main__":
    main(sys.argv)
