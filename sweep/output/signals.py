"""How the command line ends on a signal: Ctrl-C (SIGINT) and a scheduler's SIGTERM take one path.

SIGTERM is what ``kill``, Slurm, Kubernetes and ``headsweep jobs stop`` send. It raises :class:`Terminated`, a
``KeyboardInterrupt``, wherever the process is, so that everything that handles Ctrl-C (a run's row marked
``interrupted``, a query stopped inside DuckDB) handles it the same way; only the exit status differs
(128 + the signal's number, as a shell reports a process the signal ended: 130, 143).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

HANDLED = (signal.SIGINT, signal.SIGTERM)
# stopping: a signal arrived, the command is cleaning up and further signals are ignored; signum: that signal
_state: dict[str, int | bool] = {"stopping": False, "signum": 0}
# While handlers_kept holds SIGTERM: processes forked meanwhile start with it unblocked (a blocked signal mask is
# inherited across exec). Set once, read in every forked child.
_held = {"active": False, "hooked": False}


def _unblock_in_child() -> None:
    if _held["active"]:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as Ctrl-C stops."""

    signum = signal.SIGTERM


def _stop(signum: int, frame: object) -> None:
    ignore_further()
    _state["signum"] = signum
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def install() -> None:
    """From now on SIGINT raises ``KeyboardInterrupt`` and SIGTERM :class:`Terminated`, each once: further signals
    are ignored while the command cleans up (the command line only: a program that imports headsweep keeps its
    own handlers). A signal the process was started ignoring stays ignored (``nohup``, a background job)."""
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The exit status of a command that ``interrupt`` stopped: 130 for Ctrl-C, 143 for SIGTERM.

    The signal that arrived decides, not the exception's class: ``ray.get`` and ``ray.wait`` raise a
    ``KeyboardInterrupt`` of their own for whichever signal's handler raised inside them."""
    return 128 + int(_state["signum"] or getattr(interrupt, "signum", signal.SIGINT))


def ignore_further() -> None:
    """While the command cleans up after the first signal: a second Ctrl-C (or the SIGTERM a scheduler repeats)
    must not cut the run's last row or Ray's shutdown short, which ended the process on a signal or a crash."""
    if threading.current_thread() is threading.main_thread():
        _state["stopping"] = True
        for signum in HANDLED:
            signal.signal(signum, signal.SIG_IGN)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once the command has cleaned up after a signal (Ray shut down, the last line
    written), without the interpreter's teardown: threads that Ray's core worker, torch or DuckDB still run may
    call into an interpreter being torn down, and the process then ends in a crash (139) instead of the code."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    logging.shutdown()
    os._exit(code)


@contextlib.contextmanager
def handlers_kept() -> Iterator[None]:
    """Run a block that replaces signal handlers (``ray.init``: its Python SIGTERM handler calls
    ``sys.exit(SIGTERM)``, its core worker's C++ one aborts the process) and put this process's handlers back after
    it.

    SIGTERM is held (blocked) meanwhile, in this thread and the threads the block starts, and arrives once the
    handlers are back (Ctrl-C is not: it stops a connection that hangs). A SIGTERM that another thread took and
    that ended the block through such a ``sys.exit`` comes out as :class:`Terminated` where SIGTERM raises that.

    The processes the block starts (an embedded Ray instance's GCS, raylet, dashboard and, through the raylet, its
    workers) do not inherit the hold: each would otherwise ignore the SIGTERM that Ray's shutdown sends it first,
    and every shutdown would wait out Ray's one-second grace per process before killing it (about 5 s at the end
    of every local run). Ray starts them through ``subprocess`` with a ``preexec_fn``, so Python runs its at-fork
    hooks in the child, where :func:`_unblock_in_child` lifts the hold."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers are only set from the main thread, so nobody replaces them from here
        return
    if not _held["hooked"]:
        os.register_at_fork(after_in_child=_unblock_in_child)
        _held["hooked"] = True
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _held["active"] = True
    try:
        yield
    except SystemExit as exc:
        if exc.code == signal.SIGTERM and before[signal.SIGTERM] is _stop:
            ignore_further()
            _state["signum"] = signal.SIGTERM
            raise Terminated() from None
        raise
    finally:
        for signum, handler in before.items():
            # None: a handler set from C, which cannot be put back from here; once stopping, signals stay ignored
            if handler is not None and not _state["stopping"]:
                signal.signal(signum, handler)
        _held["active"] = False
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal held meanwhile is delivered now
