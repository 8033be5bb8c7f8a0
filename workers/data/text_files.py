"""Text data read as text: bytes decoded strictly with the configured encoding (``data.encoding``).

A byte the encoding cannot decode stops the run with the file, the line and the byte offset:
reading on with the bytes (pyarrow gives an undecodable column as ``binary``, its JSON reader
swaps in U+FFFD) would evaluate other sentences than the file holds, without a word.
"""

from __future__ import annotations

import codecs
import gzip
import json
import stat
import zlib
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.workers.core.setting_ranges import MAX_EXAMPLES

DEFAULT_ENCODING = "utf-8"


def check_encoding(encoding: str, key: str = "data.encoding") -> str:
    """The codec's canonical name, or a one-line error when ``encoding`` names no text encoding."""
    try:
        info = codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise HeadsweepError(f"{key} {encoding!r} is not a text encoding Python knows (e.g. utf-8, latin-1, "
                             "cp1252)") from None
    if not getattr(info, "_is_text_encoding", True):
        raise HeadsweepError(f"{key} {encoding!r} is not a text encoding (e.g. utf-8, latin-1, cp1252)")
    return info.name


def decode(data: bytes, encoding: str, path: str | Path, key: str = "data.encoding", where: str = "") -> str:
    """``data`` (the bytes of text file ``path``) decoded strictly, or a one-line error naming the line
    and byte offset of the first byte that does not decode. A leading UTF-8 byte order mark is dropped
    (it marks the encoding, it is not text). ``where`` qualifies the offset (e.g. of decompressed text)."""
    name = check_encoding(encoding, key)
    skip = len(codecs.BOM_UTF8) if name == "utf-8" and data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode(name, errors="strict")
    except UnicodeDecodeError as exc:
        offset = skip + exc.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1)
        hint = (f"set {key} to the file's encoding (e.g. latin-1 or cp1252), or fix the file"
                if name == "utf-8" else f"check {key}")
        raise HeadsweepError(
            f"{path}: line {line} is not valid {encoding} text (byte 0x{data[offset]:02x} at byte offset "
            f"{offset}{where}, byte {column} of the line): {hint}"
        ) from None


def check_file(path: str | Path, what: str, key: str) -> Path:
    """``path`` when it names a regular file; else one line saying it does not exist, or that it is a directory
    or another kind of file (a FIFO, a device: never opened, so never read forever) where config key ``key`` wants
    a file. ``what`` names the file in the message (``data file``)."""
    p = Path(path)
    if p.is_dir():
        raise HeadsweepError(f"{what} {path} is a directory, not a file: {key} must name a file")
    if not p.is_file():
        if p.exists():
            raise HeadsweepError(f"{what} {path} is {describe_kind(p)}, not a regular file: {key} must name a "
                                 "file on disk")
        raise HeadsweepError(f"{what} not found: {path}")
    return p


def describe_kind(path: str | Path) -> str:
    """What ``path`` is, for a line refusing it where a regular file is wanted (``a FIFO (named pipe)``,
    ``a character device``...)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return "not readable"
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def data_file(key: str) -> str:
    """How messages name the file of data section ``key``: ``data file``, ``importance.data file``."""
    return "data file" if key == "data" else f"{key} file"


def check_max_examples(value: int | None, key: str) -> None:
    """``<section>.max_examples`` (keep the first N examples) is unset or a positive integer."""
    if value is not None and not MAX_EXAMPLES.contains(value):
        raise HeadsweepError(MAX_EXAMPLES.refusal(key, value))


def read_bytes(path: str | Path) -> tuple[bytes, str]:
    """The bytes of a file, gunzipped when it ends in ``.gz``; and how to qualify offsets into them."""
    p = Path(path)
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "rb") as f:
                return f.read(), " of the decompressed text"
        return p.read_bytes(), ""
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise HeadsweepError(f"{path}: not a complete gzip file ({exc}): truncated, or not gzip") from None
    except OSError as exc:
        raise HeadsweepError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_text(path: str | Path, encoding: str = DEFAULT_ENCODING, key: str = "data.encoding") -> str:
    """A text file (plain or ``.gz``) decoded strictly with ``encoding``."""
    data, where = read_bytes(path)
    return decode(data, encoding, path, key, where)


def json_lines(text: str, what: str) -> list[tuple[int, object]]:
    """Each non-blank line of JSONL text parsed, with its line number (from 1, as editors count); or one line
    naming the first that is not JSON (``what``: the file as messages name it, ``data file PATH``). A last line
    that does not parse is most often a file cut off mid-line (a copy or download that stopped): the message says
    so, where a reader that parses whole columns would report a column type change or a count of rows."""
    lines = split_lines(text)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    values = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            values.append((i + 1, json.loads(line)))
        except json.JSONDecodeError as exc:
            cut = (": it is the last line, so the file may be truncated (cut off mid-line); write or copy it again"
                   if i == last else "")
            raise HeadsweepError(f"{what}: line {i + 1} is not JSON ({exc.msg}, column {exc.colno}){cut}") from None
    return values


def split_lines(text: str) -> list[str]:
    """Lines as ``wc -l`` and line-aligned parallel data count them: split at ``\\n`` only (a stray
    ``\\r`` or Unicode line separator inside a sentence does not shift the alignment), ``\\r\\n`` endings
    dropped, no empty last line for a final newline."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def parallel_set_name(path: str | Path) -> str:
    """The name of a raw parallel-text set from one side's file: ``test_2016_flickr.en.gz`` -> ``test_2016_flickr``
    (the language suffix and ``.gz`` / ``.txt`` dropped), as both translation families name their ``dataset``."""
    name = Path(path).name
    for suffix in (".gz", ".txt"):
        name = name.removesuffix(suffix)
    stem, dot, _lang = name.rpartition(".")
    return stem if dot else name
