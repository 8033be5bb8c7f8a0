"""A short exclusive claim on a key of a store, so that two drivers never decide at the same moment.

Neither pyarrow's filesystems nor plain S3 offer a create-if-absent that every store has, so a claim is
taken by writing a hidden object of one's own and then listing: a driver holds the key when its object
is the only live one. Two drivers racing for a key can then both back off (each sees the other's object),
never both proceed: for both to proceed, each listing would have to come before the other's write, and
each comes after its own. Losers remove their object and retry after a random pause.

This needs a store whose listing shows an object once its write has returned: local and NFS folders,
S3 (strongly consistent since December 2020), GCS, Azure, MinIO and Ceph do. On an eventually
consistent store the claim is only best effort.

A driver that died while holding a claim leaves its object behind: on the same host the process is
checked, and an object from another host is taken for dead after ``STALE_AFTER_S`` seen unchanged (the bound
after which a run without a heartbeat is taken for dead: a claim covers one read of the runs table and one row).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from headsweep.errors import HeadsweepError
from headsweep.results.store import FULL_ERRNOS, ResultStore, StoreFull
from headsweep.sweep.output.console import say
from headsweep.sweep.run.runs import STALE_AFTER_S, driver_id, process_exists

PREFIX = ".claim-"
WAIT_NOTE_S = 10.0  # a wait longer than this is said on the console


class StoreClaim:
    """One driver's attempts at the claim on ``key`` of ``store``."""

    def __init__(self, store: ResultStore, key: str):
        self.store = store
        self.key = key
        self.path = f"{store.root}/{PREFIX}{key}-{uuid.uuid4().hex}"
        self.first_seen: dict[str, float] = {}  # another claim's object -> when this driver first saw it
        self.owners: dict[str, str] = {}  # another claim's object -> its driver, host:pid
        self.made_root = False

    def _write(self) -> None:
        if self.store.local and not os.path.isdir(self.store.root):
            self.store.fs.create_dir(self.store.root, recursive=True)
            self.made_root = True
        with self.store.fs.open_output_stream(self.path) as out:
            out.write(json.dumps({"owner": driver_id()}).encode())

    def _delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.store.fs.delete_file(path)

    def _others(self) -> list[str]:
        """The live objects of other drivers on this key (those of dead drivers are removed)."""
        fs = self.store.fs
        mine = os.path.basename(self.path)
        others = []
        for info in fs.get_file_info(pafs.FileSelector(self.store.root, allow_not_found=True)):
            name = info.base_name
            if info.type != pafs.FileType.File or not name.startswith(f"{PREFIX}{self.key}-") or name == mine:
                continue
            if self._dead(info.path):
                self._delete(info.path)
            else:
                others.append(info.path)
        return others

    def _dead(self, path: str) -> bool:
        """Whether the object's driver is gone: its process on this host, or silent too long elsewhere."""
        seen = self.first_seen.setdefault(path, time.monotonic())
        try:
            with self.store.fs.open_input_stream(path) as f:
                owner = json.loads(f.read() or b"{}").get("owner", "")
        except FileNotFoundError:
            return False  # released while listed: not there at the next look
        except (OSError, ValueError, pa.ArrowException):
            owner = ""  # being written, or unreadable: left to the staleness bound
        self.owners[path] = owner
        host, _, pid = owner.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            return not process_exists(int(pid))
        return time.monotonic() - seen >= STALE_AFTER_S

    def acquire(self) -> None:
        """Write this driver's object, then wait until it is the only live one."""
        pause, started, told = 0.05, time.monotonic(), False
        while True:
            self._write()
            others = self._others()
            if not others:
                return
            self._delete(self.path)
            if not told and time.monotonic() - started > WAIT_NOTE_S:
                told = True
                say(f"waiting for the driver {self.owners.get(others[0]) or '(unknown)'} to start its run of this "
                    f"config in store {self.store.uri} (a driver on another host that died meanwhile is taken for "
                    f"dead after {STALE_AFTER_S:.0f} s)")
            time.sleep(random.uniform(0.5, 1.5) * pause)  # apart: two that backed off together retry apart
            pause = min(pause * 2, 2.0)

    def release(self) -> None:
        self._delete(self.path)
        if self.made_root:
            # The store's folder, made for the claim: gone again unless something was written into it since.
            with contextlib.suppress(OSError):
                os.rmdir(self.store.root)


@contextlib.contextmanager
def store_claim(store: ResultStore, key: str) -> Iterator[None]:
    """Hold the claim on ``key`` of ``store`` inside the block."""
    claim = StoreClaim(store, key)
    try:
        claim.acquire()
    except (OSError, pa.ArrowException) as exc:
        claim.release()
        if getattr(exc, "errno", None) in FULL_ERRNOS:
            raise StoreFull(store.uri, 0) from None
        raise HeadsweepError(f"store {store.uri}: cannot take the claim on config {key} that one run of a "
                             f"config starts at a time: {str(exc).splitlines()[0]}") from None
    try:
        yield
    finally:
        claim.release()
