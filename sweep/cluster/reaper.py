"""The processes of an embedded Ray instance end with the driver that started it, however the driver ends.

``ray.init`` without an address starts a private instance: GCS, raylet, a dashboard process, and through the raylet
its dashboard agent, runtime-env agent and workers. Ray ties the GCS and the raylet to the driver
(``PR_SET_PDEATHSIG``) and ends them all on ``ray.shutdown``, but the raylet's children are not tied to anything:
when the driver stops while they start (Ctrl-C or SIGTERM during ``ray.init``, a SIGKILL), the raylet dies, and
the agents, reparented to PID 1, live on, ignoring SIGTERM while their event loop is not running yet (issue 45).

So before ``ray.init`` the driver starts a watchdog: a small process in a session of its own (Ctrl-C to the
terminal's process group does not reach it) whose standard input is a pipe that only the driver writes to. When
the driver ends, whatever the way (done, error, signal, SIGKILL), or lets the instance go (``release``), the pipe
reads end of file; the watchdog then ends every process whose environment carries the driver's mark
(``HEADSWEEP_EMBEDDED_RAY=<token>``, set while ``ray.init`` runs: every process Ray starts for the instance inherits
it, directly or through the raylet, and nothing else has it): SIGTERM, then SIGKILL a second later for any that is
still there, until none is left.

The watchdog runs this file as a script (``python -I reaper.py TOKEN``): it imports nothing of headsweep's, so it
starts in tens of milliseconds. Linux only (it reads ``/proc``); elsewhere no watchdog is started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

MARK = "HEADSWEEP_EMBEDDED_RAY"
# Seconds between the SIGTERM and the SIGKILL of a marked process; how long the watchdog keeps looking at most.
TERM_GRACE_S = 1.0
REAP_FOR_S = 60.0
POLL_S = 0.1
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


def marked(token: str) -> set[int]:
    """The processes whose environment carries ``MARK=token`` (those of other users are not readable: not ours)."""
    needle = f"{MARK}={token}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.add(int(entry))
    return found


def reap(token: str) -> None:
    """End every marked process: SIGTERM first, SIGKILL ``TERM_GRACE_S`` later, until none is seen for
    ``QUIET_S`` (or ``REAP_FOR_S`` have passed)."""
    termed: dict[int, float] = {}
    deadline = time.monotonic() + REAP_FOR_S
    quiet_since = None
    while time.monotonic() < deadline:
        pids = marked(token) - {os.getpid()}
        now = time.monotonic()
        if not pids:
            # Done once none is seen for QUIET_S, not at the first scan that sees none: once, a SIGTERM during Ray's
            # start-up left one process of the instance running after such a scan (one being started then, whose
            # environment could not be read yet, or started just after it).
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= QUIET_S:
                return
            time.sleep(POLL_S)
            continue
        quiet_since = None
        for pid in pids:
            first = termed.setdefault(pid, now)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM if first == now else signal.SIGKILL if now - first >= TERM_GRACE_S else 0)
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    """The watchdog: wait for the driver's end (end of file on standard input), then reap its marked processes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver never stops the cleanup
    token = argv[1]
    with contextlib.suppress(OSError):
        while os.read(0, 65536):
            pass
    reap(token)


if __name__ == "__main__":
    main(sys.argv)
