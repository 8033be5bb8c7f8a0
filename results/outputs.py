"""What a command may write where a user names it (``--out``, ``demo --report``): the one rule for every output.

An output that exists and that headsweep did not write is refused unless ``--force``, and ``--force`` never
deletes or replaces anything headsweep did not write, nor the model a command reads, nor a store's files:

- a **folder** (a report, an exported model) gets a marker, :data:`MARKER`, listing the files headsweep wrote
  there. A folder that is missing, empty, or holds only what its marker lists (and other headsweep outputs in
  sub-folders with their own markers) is headsweep's own: it is replaced whole. Any other file in it is the
  user's: refused, and with ``--force`` headsweep writes beside such files, replacing only the files its marker
  lists, and still refuses when one of its files would take the name of one of theirs;
- a **file** (a query's result) cannot carry a marker, so an existing one is refused unless ``--force``, which
  replaces that one file (never a folder, a device or a pipe).

Every output is written under a hidden name beside its place and renamed there once complete, so a refusal or a
failure leaves the place as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from headsweep.errors import HeadsweepError

MARKER = ".headsweep-output.json"


@dataclass(frozen=True)
class Output:
    """A checked place to write: ``path`` (resolved), ``kind`` (``file`` or ``folder``), ``force`` as given,
    ``option`` (the option that named it, for messages) and, for a folder that exists, ``listed`` (the files its
    marker lists: headsweep's, replaced) and ``theirs`` (the files it holds that headsweep did not write)."""

    path: Path
    kind: str
    force: bool
    option: str = "--out"
    listed: frozenset[str] = frozenset()
    theirs: frozenset[str] = frozenset()
    named: str = field(default="", compare=False)  # as the user wrote it


def check_output(out: str | Path, kind: str, *, force: bool = False, store=None, protected: Sequence[str | Path] = (),
                 option: str = "--out", replace_own: bool = True, can_force: bool = True) -> Output:
    """Check ``out`` before anything is computed or written; returns where to write, or raises one line.

    ``store``: a results store (``ResultStore``) that ``out`` must lie outside of. ``protected``: paths the command
    reads (the model being exported) that ``out`` must neither be nor hold, ``--force`` or not. ``replace_own``
    False: a folder holding an earlier output of headsweep's is replaced only with ``force`` too (an exported model,
    which may be in use; a report is replaced without asking). ``can_force`` False: the command has no ``--force``
    (``demo --report``), so a refusal does not offer it."""
    named = str(out)
    if not named.strip():
        raise HeadsweepError(f"{option} is empty: give a {kind} path")
    path = Path(named).expanduser().resolve()
    if store is not None and store.local:
        root = Path(store.root)
        if path == root or root in path.parents:
            raise HeadsweepError(f"{option} {named} is inside the store {store.uri}, which holds only what headsweep "
                                 f"runs write: give {option} a {kind} outside it")
    for held in protected:
        held_path = Path(held).expanduser().resolve()
        if path == held_path or path in held_path.parents:
            raise HeadsweepError(f"{option} {named} is (or holds) {held}, which this command reads: give {option} a "
                                 f"new {kind} elsewhere (--force never replaces what a command reads)")
    _check_parent(path, named, kind, option)
    if kind == "file":
        return _check_file(path, named, force, option)
    return _check_folder(path, named, force, option, replace_own, can_force)


def _check_parent(path: Path, named: str, kind: str, option: str) -> None:
    for above in path.parents:
        if above.exists():
            if not above.is_dir():
                raise HeadsweepError(f"{option} {named} cannot be created: {above} is a file, not a folder")
            if not os.access(above, os.W_OK | os.X_OK):
                raise HeadsweepError(f"{option} {named} cannot be created: {above} is not writable; give {option} "
                                     f"a {kind} in a folder you can write")
            return


def _check_file(path: Path, named: str, force: bool, option: str) -> Output:
    if path.is_dir():
        raise HeadsweepError(f"{option} {named} is a folder: give a file path")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise HeadsweepError(f"{option} {named} exists and is not a regular file: give a new file path")
        if not force:
            raise HeadsweepError(f"{option} {named} exists and headsweep cannot tell whether it wrote it: choose a "
                                 "new file name, or add --force to replace it")
    return Output(path, "file", force, option, named=named)


def _check_folder(path: Path, named: str, force: bool, option: str, replace_own: bool, can_force: bool) -> Output:
    if path.exists() and not path.is_dir():
        raise HeadsweepError(f"{option} {named} is a file: give a new or empty folder")
    if not path.exists():
        return Output(path, "folder", force, option, named=named)
    listed = _listed(path)
    theirs = frozenset(_files(path) - listed)
    if theirs and not force:
        example = sorted(theirs)[0]
        raise HeadsweepError(
            f"{option} {named} holds {len(theirs)} file{'s' if len(theirs) > 1 else ''} headsweep did not write "
            f"({example}{', ...' if len(theirs) > 1 else ''}): choose a new or empty folder"
            + (", or add --force to write beside them (--force replaces only what headsweep wrote there)"
               if can_force else ""))
    if not force and not replace_own and listed & _files(path):
        raise HeadsweepError(f"{option} {named} exists and is not empty: choose a new folder, or add --force to "
                             "replace what headsweep wrote there")
    return Output(path, "folder", force, option, listed, theirs, named=named)


def _listed(folder: Path) -> frozenset[str]:
    """The files ``folder``'s marker says headsweep wrote (none without a readable marker)."""
    try:
        files = json.loads((folder / MARKER).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return frozenset()
    return frozenset(f for f in files if isinstance(f, str))


def _files(folder: Path) -> set[str]:
    """Every file under ``folder`` (relative paths; links count as files), the marker and sub-folders that are
    headsweep outputs of their own (their marker) left out."""
    found = set()
    for here, dirs, names in os.walk(folder):
        base = Path(here)
        keep = []
        for d in dirs:
            if (base / d / MARKER).is_file():
                continue  # another headsweep output (a one-run report in the several-run report's folder)
            if (base / d).is_symlink():
                names.append(d)
            else:
                keep.append(d)
        dirs[:] = keep
        found.update(str((base / n).relative_to(folder)) for n in names)
    found.discard(MARKER)
    return found


@contextlib.contextmanager
def written_folder(output: Output, what: str) -> Iterator[Path]:
    """A new hidden folder beside ``output`` to write into; put in place when the block ends without an error
    (``what`` is recorded in the marker, e.g. ``headsweep report``), removed either way."""
    staging = output.path.parent / f".{output.path.name}.writing-{uuid.uuid4().hex[:8]}"
    output.path.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        yield staging
        _commit_folder(output, staging, what)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit_folder(output: Output, staging: Path, what: str) -> None:
    new = sorted(_files(staging))
    out = output.path
    if not output.theirs:  # nothing of the user's there: the finished folder takes its place whole
        _write_marker(staging, new, what)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        staging.rename(out)
        if old is not None:
            # sub-folders that are outputs of their own (a one-run report under the several-run one) stay
            for entry in old.iterdir():
                if entry.is_dir() and (entry / MARKER).is_file() and not (out / entry.name).exists():
                    entry.rename(out / entry.name)
            shutil.rmtree(old, ignore_errors=True)
        return
    # --force beside the user's files: replace only what the marker lists, never one of theirs.
    clash = sorted(set(new) & (_files(out) - output.listed))
    if clash:
        raise HeadsweepError(f"{output.option} {output.named} holds {clash[0]}, which headsweep did not write and "
                             "would replace: move it, or choose a new or empty folder")
    _write_marker(out, sorted(output.listed | set(new)), what)  # first: an interruption leaves every file listed
    for name in new:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, target)
    for name in sorted(output.listed - set(new)):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    _write_marker(out, new, what)


def _write_marker(folder: Path, files: Sequence[str], what: str) -> None:
    tmp = folder / f".{MARKER}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps({"written_by": what, "files": list(files)}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MARKER)


@contextlib.contextmanager
def written_file(output: Output) -> Iterator[Path]:
    """A hidden file beside ``output`` to write; renamed over it when the block ends without an error, removed
    either way."""
    tmp = output.path.parent / f".{output.path.name}.writing-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, output.path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
