"""A worker kept warm between runs (``headsweep run --keep-workers``): its lease, and its process put back as it was.

A worker's start costs seconds of imports (torch, transformers, fairseq) before its model loads. On a running
cluster, a run may keep its workers after it ends: each stays a detached Ray actor, its models dropped, for the next
run that asks for workers of the same shape. What a warm worker must never do is answer differently from a fresh
one, so:

- a run may change process-wide state (torch's threads, the random generators, environment variables such as
  lm-eval's offline switches): the state the process started with is put back when the run lets it go, before any
  other run can claim it (:class:`ProcessStart`);
- the code it imported must still be the code installed: a worker whose headsweep files or entry points changed
  since it started refuses to be claimed and ends (:func:`code_fingerprint`);
- one run at a time holds it (:class:`Lease`: a claim answered on its own thread, so a busy worker says so at once);
  an idle one ends itself after the keep time, and a held one whose driver's Ray job is gone (the driver killed)
  ends too, so a lost driver leaves nothing holding the cluster's CPUs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

# How often a warm worker checks its idle time and its holder's job.
WATCH_EVERY_S = 2.0

# How long a warm worker that Ray restarted waits for the run holding it to take it back (``Lease.take``), at least:
# the driver asks a restarted worker back within a second, but its first answer may wait on a loaded node.
RETAKE_WAIT_S = 120.0

# How a worker's own warnings read, as the driver's console shows them (`headsweep: warning: ...`).
WARNING_FORMAT = "headsweep: warning: %(message)s"

# Claim answers.
CLAIMED, BUSY, STALE = "claimed", "busy", "stale"


def code_fingerprint() -> str:
    """Size and modification time of every Python file of the installed headsweep, and the plugin entry points (a
    plugin installed or removed is new code too): what a process that started now would import."""
    import headsweep
    from headsweep.plugins import ABLATIONS_GROUP, FAMILIES_GROUP, KINDS_GROUP

    digest = hashlib.sha256()
    # followlinks: an editable install's package links its sub-packages (sweep, workers, results) in
    for folder, dirs, files in os.walk(Path(headsweep.__file__).parent, followlinks=True):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            digest.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for group in (KINDS_GROUP, FAMILIES_GROUP, ABLATIONS_GROUP):
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            digest.update(f"{group}:{ep.name}={ep.value}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class ProcessStart:
    """What a run may change process-wide, as the worker's process started."""

    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    threads: int = 0
    torch_rng: Any = None
    numpy_rng: Any = None
    python_rng: Any = None

    @classmethod
    def now(cls) -> ProcessStart:
        """The process's state now (taken as the worker starts, before any run's model loads)."""
        import numpy as np
        import torch

        return cls(threads=torch.get_num_threads(), torch_rng=torch.get_rng_state(),
                   numpy_rng=np.random.get_state(), python_rng=random.getstate())

    def restore(self) -> None:
        """The process as it started (call on the thread that runs the worker's evaluations: torch's thread count
        is read there)."""
        import numpy as np
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)


class NoteBuffer(logging.Handler):
    """headsweep's warnings on a warm worker, kept for the driver to fetch: Ray forwards a detached actor's output to
    the driver that created it only, not to the run holding it now."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(WARNING_FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def drain(self) -> list[str]:
        """The lines kept since the last drain."""
        lines, self.lines = self.lines, []
        return lines


class Lease:
    """Who holds a warm worker, and when it ends itself.

    ``owner`` is ``(run id, Ray job id)`` of the run holding it, or None while it is idle. ``claim`` and the watch
    thread share the state under a lock; the worker's evaluations never touch it."""

    def __init__(self, owner: tuple[str, str] | None, keep_s: float, fingerprint: str,
                 restarted: bool = False) -> None:
        """``restarted``: Ray started the worker again after its process died; ``owner`` is then the run that first
        started it, perhaps long gone: the run holding it now takes it back (``take``) or it ends after
        ``max(keep_s, RETAKE_WAIT_S)``."""
        self.owner = owner if not restarted else None
        self.keep_s = keep_s if not restarted else max(keep_s, RETAKE_WAIT_S)
        self.fingerprint = fingerprint
        self.idle_since = time.monotonic()
        # until taken back, a restarted worker is claimed by no other run
        self.awaiting_retake = restarted
        self.lock = threading.Lock()
        self.ended = False
        threading.Thread(target=self._watch, name="headsweep-warm-lease", daemon=True).start()

    def claim(self, owner: tuple[str, str], keep_s: float) -> str:
        """``claimed`` (now held by ``owner``), ``busy`` (another run holds it) or ``stale`` (its code changed since
        it started: it ends)."""
        with self.lock:
            if self.ended:
                return STALE
            if self.awaiting_retake or (self.owner is not None and self.owner != owner):
                return BUSY
            if code_fingerprint() != self.fingerprint:
                self._end()
                return STALE
            self.owner, self.keep_s = owner, keep_s
            return CLAIMED

    def take(self, owner: tuple[str, str]) -> None:
        """Held by ``owner`` whatever it was (a worker Ray restarted for the run holding it)."""
        with self.lock:
            self.owner, self.awaiting_retake = owner, False

    def release(self) -> None:
        """Idle from now on; it ends after the keep time its last claim gave unless claimed again."""
        with self.lock:
            self.owner, self.idle_since = None, time.monotonic()

    def _watch(self) -> None:
        while not self.ended:
            time.sleep(WATCH_EVERY_S)
            with self.lock:
                if self.owner is None and time.monotonic() - self.idle_since >= self.keep_s:
                    self._end()
                elif self.owner is not None and not job_alive(self.owner[1]):
                    self._end()

    def _end(self) -> None:
        """The actor ends for good (no restart): its resources go back to the cluster."""
        import ray

        self.ended = True
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def job_alive(job_id: str) -> bool:
    """Whether the Ray job ``job_id`` (a driver) is still running. Read from the cluster's job table through Ray's
    own client (the public state API needs the dashboard, which a cluster may run without); where that fails the job
    counts as alive: the worker is ended by its keep time instead, once released."""
    import ray

    try:
        jobs = ray._private.worker.global_worker.gcs_client.get_all_job_info()
    except Exception:  # noqa: BLE001 - another Ray layout: never end a worker on a guess
        return True
    for key, info in jobs.items():
        if (key.hex() if hasattr(key, "hex") else str(key)) == job_id:
            return not info.is_dead
    return True
