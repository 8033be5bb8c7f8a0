"""Checking a transformers model directory's files before loading them, so that a broken file is named.

transformers reports a truncated ``config.json`` as ``Expecting value: line 9 column 12`` and a
truncated ``model.safetensors`` as ``Error while deserializing header``, without the file or the
likely cause. These checks read only what they must: each JSON file of the directory, the header
of each safetensors file (its size must cover the tensors the header lists) and the end of each
zip-format ``pytorch_model*.bin``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

REFETCH = "an interrupted download or copy? fetch the model again"
# safetensors refuses headers above 100 MB: a larger length means the file is not safetensors.
MAX_SAFETENSORS_HEADER = 100_000_000
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAGIC = b"\x80"  # torch's legacy (non-zip) format starts with a pickle protocol opcode


def check_model_files(model_dir: Path) -> dict[str, Any]:
    """Check the directory's JSON, safetensors and ``pytorch_model*.bin`` files; returns ``config.json``."""
    config = read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise HeadsweepError(f"{model_dir / 'config.json'} is not a transformers config: it holds a "
                             f"{type(config).__name__}, not an object (wrong file?)")
    for file in sorted(model_dir.glob("*.json")):
        if file.name != "config.json":
            read_json(file)
    for file in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(file)
    for file in sorted(model_dir.glob("pytorch_model*.bin")):
        check_torch_file(file)
    return config


def read_json(file: Path) -> Any:
    """A JSON file's content, or a one-line error naming the file and whether it looks truncated."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise HeadsweepError(f"{file} is not JSON: byte 0x{exc.object[exc.start]:02x} at byte offset {exc.start} "
                             "is not UTF-8 (a binary file under a JSON name?)") from None
    except OSError as exc:
        raise HeadsweepError(f"cannot read {file}: {exc.strerror or exc}") from None
    if not text.strip():
        raise HeadsweepError(f"{file} is empty ({REFETCH})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # Cut short: the parser ran off the end, or into a string that never closes.
        cut = not text[exc.pos:].strip() or exc.msg.startswith("Unterminated string")
        cause = f"the file ends early, it looks truncated ({REFETCH})" if cut else "the file is damaged or not JSON"
        raise HeadsweepError(
            f"{file} is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}): {cause}"
        ) from None


def check_safetensors(file: Path) -> None:
    """One-line error unless ``file`` is a whole safetensors file (header, and every tensor the header lists)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or (length <= MAX_SAFETENSORS_HEADER and size < 8 + length):
            raise HeadsweepError(f"{file} is truncated: {size} bytes, shorter than its own header ({REFETCH})")
        if length > MAX_SAFETENSORS_HEADER:
            raise HeadsweepError(f"{file} is not a safetensors file: its first 8 bytes are no header length "
                                 "(wrong format, or another file under this name?)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HeadsweepError(f"{file} is not a safetensors file: its header is not JSON (wrong format?)") from None
    if not isinstance(header, dict):
        raise HeadsweepError(f"{file} is not a safetensors file: its header is not a JSON object (wrong format?)")
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or []) == 2]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        raise HeadsweepError(
            f"{file} is truncated: {size} bytes where its header describes {expected} ({REFETCH})"
        )


def check_torch_file(file: Path) -> None:
    """One-line error when a ``torch.save`` weights file is cut short or is not one."""
    with open(file, "rb") as f:
        head = f.read(4)
    if head.startswith(ZIP_MAGIC):
        if not zipfile.is_zipfile(file):
            raise HeadsweepError(f"{file} is truncated: a zip archive without its end ({REFETCH})")
    elif not head.startswith(PICKLE_MAGIC):
        raise HeadsweepError(f"{file} is not a PyTorch weights file (it does not start as torch.save writes "
                             "them): wrong format, or another file under this name?")
