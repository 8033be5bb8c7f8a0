"""headsweep's terminal: its own lines on the console, every other library's output in a log file.

Set up once, by the command line (``setup``), never at import: a program that imports headsweep's
modules keeps its own logging, warnings and streams, and ``say``/``out`` then simply write to
``sys.stderr``/``sys.stdout``.

What the command line does (unless ``--verbose``):

- File descriptors 1 and 2 of the process are pointed at a log file for the command
  (``log_path``), so that everything other libraries write, by any route (Python logging, warnings,
  ``print``, tqdm bars, C code writing to fd 2, the Ray processes the driver starts), lands there.
  headsweep's own lines go to duplicates of the original descriptors: ``out`` (results: run ids,
  tables, paths) and ``say`` (progress, status, warnings, errors).
- Python warnings become log records (``logging.captureWarnings``), all of them: a warning's file
  and line say where it was triggered, not whose it is (hydra's deprecation notices point into
  headsweep's code), so headsweep says its own warnings through its logger instead. The root
  logger writes records to the log file at INFO, which also makes a library's later
  ``logging.basicConfig(level=DEBUG)`` (fairseq's wav2vec module does one at import) a no-op.
- The ``headsweep`` logger's warnings reach the console as ``headsweep: warning: ...``.
- Ray workers' forwarded output (``log_to_driver``) is printed by Ray into the log file; lines a
  worker prints with the ``headsweep:`` prefix are also shown on the console, once each
  (``relay_ray_workers``).

With ``--verbose`` nothing is redirected: other libraries' messages stay on stderr, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from headsweep.errors import HeadsweepError

# A folder for every command's log file, instead of the default (see ``log_dir``).
LOG_DIR_ENV = "HEADSWEEP_LOG_DIR"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OWN_PREFIX = "headsweep:"


@dataclass
class Console:
    """The streams of one command: headsweep's stdout and stderr, and the log file of everything else."""

    out: TextIO
    err: TextIO
    verbose: bool
    command: str
    log_path: Path | None = None
    announce: bool = False  # the log's path was printed when the command started
    lock: threading.RLock = field(default_factory=threading.RLock)
    live: Any = None  # the progress bar on the terminal, cleared before a line is written above it
    relayed: set[str] = field(default_factory=set)


_console: Console | None = None


def current() -> Console | None:
    """The command line's console, or None in a program that imports headsweep."""
    return _console


def err_stream() -> TextIO:
    """The stream for headsweep's own status lines (the terminal's stderr, even while fd 2 is captured)."""
    return _console.err if _console is not None else sys.stderr


def out_stream() -> TextIO:
    """The stream for headsweep's results (the terminal's stdout, even while fd 1 is captured)."""
    return _console.out if _console is not None else sys.stdout


def say(message: object) -> None:
    """One of headsweep's own status lines, on stderr (above the progress bar, if one is drawn)."""
    message = str(message)
    _write(err_stream(), message + "\n")
    if _console is not None and not _console.verbose:
        # The log file keeps headsweep's lines too, so that other libraries' messages have their context.
        logging.getLogger("headsweep.console").info(message)


def out(text: object, end: str = "\n") -> None:
    """headsweep's results (a run id, a table, a path), on stdout (anything ``print`` takes: ``str(text)``)."""
    _write(out_stream(), str(text) + end)


def stdout_closed() -> None:
    """The reader of stdout went away (``headsweep query ... | head -1``): drop the rest, as Unix tools do.

    The broken stream is closed (its unwritten buffer discarded) and stdout points at the null
    device, so nothing fails again when Python flushes its streams at exit.
    """
    devnull = open(os.devnull, "w")  # noqa: SIM115 - kept open for the rest of the process
    broken = out_stream()
    if _console is not None:
        _console.out = devnull
    sys.stdout = devnull
    with contextlib.suppress(OSError):
        os.dup2(devnull.fileno(), 1)
    with contextlib.suppress(OSError, ValueError):
        broken.close()


def _write(stream: TextIO, text: str) -> None:
    console = _console
    if console is None:
        stream.write(text)
        stream.flush()
        return
    with console.lock:
        live = console.live
        if live is not None:  # stdout and stderr usually share the terminal: clear the bar for either
            live.clear()
        stream.write(text)
        stream.flush()
        if live is not None:
            live.refresh()


def attach_live(bar: Any) -> None:
    """Register the terminal's live progress line (an object with ``clear``, ``refresh`` and ``close``)."""
    if _console is not None:
        with _console.lock:
            _console.live = bar


def detach_live(bar: Any) -> None:
    if _console is not None:
        with _console.lock:
            if _console.live is bar:
                _console.live = None


def end_live() -> None:
    """Leave the live progress line where it stands (a command that fails mid-step), so that the
    lines that follow, the error last, are not redrawn over."""
    live = _console.live if _console is not None else None
    if live is not None:
        live.close()


def log_dir(store: str | None) -> Path:
    """Where a command's log file goes: ``$HEADSWEEP_LOG_DIR``; else ``headsweep-logs`` beside a local
    store; else ``headsweep`` cache's ``logs`` folder (``$HEADSWEEP_CACHE`` or ``~/.cache/headsweep``)."""
    if os.environ.get(LOG_DIR_ENV):
        return Path(os.environ[LOG_DIR_ENV]).expanduser()
    if store and "://" not in store:
        return Path(store).expanduser().resolve().parent / "headsweep-logs"
    cache = os.environ.get("HEADSWEEP_CACHE") or Path.home() / ".cache" / "headsweep"
    return Path(cache) / "logs"


def check_log_dir() -> None:
    """Refuse a ``$HEADSWEEP_LOG_DIR`` that cannot hold log files (a file, or a folder that cannot be made or written):
    the log would otherwise go to the temporary folder, not where the user looks for it."""
    named = os.environ.get(LOG_DIR_ENV)
    if not named:
        return
    folder = Path(named).expanduser()
    if folder.exists() and not folder.is_dir():
        raise HeadsweepError(f"{LOG_DIR_ENV}={named} is a file, not a folder: point it at a folder for the log files "
                             "(made if missing), or unset it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HeadsweepError(f"{LOG_DIR_ENV}={named}: cannot make the folder ({exc.strerror or exc}): point it at a "
                             "folder you can write, or unset it") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise HeadsweepError(f"{LOG_DIR_ENV}={named} is not writable: point it at a folder you can write, or unset it")


def _open_log(command: str, store: str | None) -> tuple[Path, int]:
    """Create the command's log file (its path and descriptor); falls back to the temporary folder when the
    chosen one is not writable."""
    stamp = f"{command}-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
    errors = []
    for folder in (log_dir(store), Path(tempfile.gettempdir()) / "headsweep-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / stamp
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            errors.append(f"{folder}: {exc.strerror or exc}")
    raise OSError("; ".join(errors))


def _text_stream(fd: int, like: TextIO) -> TextIO:
    return open(fd, "w", buffering=1, encoding=getattr(like, "encoding", None) or "utf-8",
                errors="backslashreplace", closefd=True)


def setup(command: str, verbose: bool = False, store: str | None = None, announce: bool = False) -> Console:
    """Route this process's output for the command line (see the module's docstring); returns the console.

    ``announce``: print the log file's path now (long commands: run, demo); otherwise ``finish``
    prints it at the end, and only if something was captured.
    """
    global _console
    if _console is not None:
        return _console
    console = Console(out=sys.stdout, err=sys.stderr, verbose=verbose, command=command)
    if not verbose:
        try:
            path, log_fd = _open_log(command, store)
        except OSError as exc:
            verbose = console.verbose = True
            print(f"headsweep: warning: no log file for other libraries' messages ({exc}); they stay on the console",
                  file=sys.stderr, flush=True)
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            # Duplicates of the terminal's descriptors for headsweep's own lines (not inherited by the
            # Ray processes the driver starts), then 1 and 2 to the log file, for everyone else.
            console.out = _text_stream(os.dup(1), sys.stdout)
            console.err = _text_stream(os.dup(2), sys.stderr)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            console.log_path = path
            # Progress bars of Hugging Face downloads/saves would only fill the log file with redraws, and
            # Ray's colour codes around forwarded worker lines would only make it harder to read.
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    _console = console
    _route_logging(console)
    if console.log_path is not None:
        argv = " ".join(sys.argv)
        logging.getLogger("headsweep.console").info("headsweep %s (pid %d): %s", command, os.getpid(), argv)
        if announce:
            console.announce = True
            say(log_line(console.log_path))
    return console


def log_line(path: Path) -> str:
    """The line that names the log file (printed once)."""
    return f"log: {path} (other libraries' messages; --verbose shows them here)"


class _OwnWarning(logging.Formatter):
    """``headsweep: warning: message`` (``error`` for ERROR and above); a message that already starts
    with ``headsweep:`` is printed as it is."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if message.startswith(OWN_PREFIX):
            return message
        level = "error" if record.levelno >= logging.ERROR else "warning"
        return f"{OWN_PREFIX} {level}: {message}"


class _ConsoleHandler(logging.Handler):
    """Writes records through ``say``, so they pass above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write(err_stream(), self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never break the command
            self.handleError(record)


def _route_logging(console: Console) -> None:
    # Records of every library: into the log file (fd 2 now), or onto the terminal with --verbose.
    to_file = logging.StreamHandler(sys.stderr)
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(to_file)
    root.setLevel(logging.INFO)

    own = logging.getLogger("headsweep")
    show = _ConsoleHandler(logging.WARNING)
    show.setFormatter(_OwnWarning())
    own.addHandler(show)
    # The log file has headsweep's lines too; with --verbose the console handler is the only one (no doubles).
    own.propagate = False
    if not console.verbose:
        own.addHandler(to_file)
    own.setLevel(logging.INFO)
    logging.captureWarnings(True)


def relay_ray_workers() -> None:
    """Show the ``headsweep:`` lines of Ray workers' forwarded output on the console (each text once).

    Ray itself prints all forwarded worker output into ``sys.stdout``/``sys.stderr``, that is the log
    file while the console captures; with ``--verbose`` (or outside the command line) it is left alone.
    """
    if _console is None or _console.verbose:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray layout: workers' own warnings then stay in the log file only
        return
    dispatcher.remove_handler("headsweep_console")
    dispatcher.add_handler("headsweep_console", _relay)


def _relay(data: dict) -> None:
    if _console is not None:
        relay_lines(data.get("lines", []))


def relay_lines(lines: list[str]) -> None:
    """Show the ``headsweep:`` lines among a worker's output lines, each text once (the console's relay); outside
    the command line, each through the ``headsweep`` logger."""
    console = _console
    for line in lines:
        text = line.strip()
        if not text.startswith(OWN_PREFIX):
            continue
        if console is None:
            logging.getLogger("headsweep").warning("%s", text.removeprefix("headsweep: warning: "))
            continue
        if text in console.relayed:
            continue
        console.relayed.add(text)
        _write(console.err, text + "\n")


def finish(name_log: bool = True) -> None:
    """End of the command: name the log file if something went into it and it was not named yet
    (unless ``name_log`` is false: a one-line error says all); remove it when it stayed empty."""
    end_live()
    console = _console
    if console is None or console.log_path is None:
        return
    # Ray's and other libraries' buffered output first, so that the size below is final.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if console.announce:  # named when the command started: kept, whatever it holds
        return
    if _only_own_lines(console.log_path):
        with contextlib.suppress(OSError):
            console.log_path.unlink()
            # headsweep's own log folder, left empty: whichever command ends last removes it, also when another
            # command created it (commands running at once share it; rmdir refuses a folder still in use).
            console.log_path.parent.rmdir()
        return
    if name_log:
        say(log_line(console.log_path))


def _only_own_lines(path: Path) -> bool:
    """Whether the log holds nothing but headsweep's own (console) lines."""
    try:
        with open(path, errors="replace") as f:
            return all(" headsweep.console: " in line for line in f if line.strip())
    except OSError:
        return True
