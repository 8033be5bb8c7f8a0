"""Checking a transformers model directory's files before loading them, so that a broken file is named.

transformers reports a truncated ``config.json`` as ``Expecting value: line 9 column 12`` and a
truncated ``model.safetensors`` as ``Error while deserializing header``, without the file or the
likely cause. These checks read only what they must: each JSON file of the directory, the header
of each safetensors file (its size must cover the tensors the header lists) and the end of each
zip-format ``pytorch_model*.bin``.

It also sizes the weights a worker will hold (:func:`weight_bytes`), for the driver's memory check
(``sweep/run/memory.py``), from the same headers: this module imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import math
import os
import pickletools
import zipfile
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.hub.cache import is_hub_id, resolve_snapshot

REFETCH = "an interrupted download or copy? fetch the model again"
# safetensors refuses headers above 100 MB: a larger length means the file is not safetensors.
MAX_SAFETENSORS_HEADER = 100_000_000
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAGIC = b"\x80"  # torch's legacy (non-zip) format starts with a pickle protocol opcode
# ``model.dtype``: the torch dtypes a model may be loaded in (torch's aliases included), by their bytes per value.
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}
# Bytes per value of safetensors' dtypes: the floating ones are cast to ``model.dtype`` when loaded.
SAFETENSORS_FLOATING = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
SAFETENSORS_BYTES = {**SAFETENSORS_FLOATING, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def resolve_model_dir(path: str) -> Path:
    """The local model directory, or a one-line error that says why it is not usable."""
    if not path:
        raise HeadsweepError("config key 'model.path' is required (a transformers model directory)")
    p = Path(path)
    if is_hub_id(path):  # org/name[@revision]: its snapshot in the local Hugging Face cache, never downloaded
        p = resolve_snapshot(path).folder
    if not p.exists():
        raise HeadsweepError(f"model directory not found: {path}")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise HeadsweepError(f"{path} is not a transformers model directory (no config.json)")
    if not os.access(p / "config.json", os.R_OK):
        raise HeadsweepError(f"model directory {path} is not readable")
    return p


def dtype_bytes(name: str) -> int:
    """Bytes per value of ``model.dtype`` ``name``, or a one-line error naming the dtypes a model loads in."""
    if name not in DTYPE_BYTES:
        raise HeadsweepError(f"model.dtype {name!r} is not a dtype models are evaluated in: use float32, bfloat16, "
                             "float16 or float64")
    return DTYPE_BYTES[name]


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


def check_safetensors(file: Path) -> dict[str, Any]:
    """One-line error unless ``file`` is a whole safetensors file (header, and every tensor the header lists);
    returns its header (tensor name -> dtype, shape and offsets)."""
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
    return header


def check_torch_file(file: Path) -> None:
    """One-line error when a ``torch.save`` weights file is cut short or is not one, or names Python objects besides
    tensors and their containers (:func:`foreign_objects`)."""
    with open(file, "rb") as f:
        head = f.read(4)
    if head.startswith(ZIP_MAGIC):
        if not zipfile.is_zipfile(file):
            raise HeadsweepError(f"{file} is truncated: a zip archive without its end ({REFETCH})")
        foreign = foreign_objects(file)
        if foreign:
            raise HeadsweepError(pickled_weights(file, foreign))
    elif not head.startswith(PICKLE_MAGIC):
        raise HeadsweepError(f"{file} is not a PyTorch weights file (it does not start as torch.save writes "
                             "them): wrong format, or another file under this name?")


def foreign_objects(file: Path) -> list[str]:
    """``module.name`` of what the pickle of the zip-format ``torch.save`` file ``file`` names beyond torch's own
    classes and functions and Python's containers (an ``argparse.Namespace``, a pickled model's class), read with
    ``pickletools`` (nothing is unpickled, torch is not imported). Empty for a plain state dict, and where the pickle
    names its classes in a way this does not read (protocol 4's ``STACK_GLOBAL``: torch.save writes protocol 2), as
    torch's ``weights_only`` load still refuses them then (:data:`loading.WEIGHTS_ONLY_REFUSED`)."""
    try:
        with zipfile.ZipFile(file) as archive:
            name = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
            data = archive.read(name) if name is not None else b""
        found = [str(arg).replace(" ", ".", 1) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    except (zipfile.BadZipFile, ValueError, OSError):
        return []
    plain = ("torch.", "collections.", "builtins.", "__builtin__.", "_codecs.")  # protocol 2 writes __builtin__
    return sorted({name for name in found if not name.startswith(plain)})


def pickled_weights(file: Path, objects: list[str] | None = None) -> str:
    """The line for PyTorch weights that torch refuses to load with ``weights_only=True`` (they hold pickled Python
    ``objects`` beside the tensors): headsweep never unpickles them, so it says how to convert them to safetensors."""
    script = (f"import torch; from safetensors.torch import save_file; s = torch.load('{file}', weights_only=False); "
              "save_file({k: v.clone().contiguous() for k, v in s.items() if isinstance(v, torch.Tensor)}, "
              f"'{file.parent / 'model.safetensors'}')")
    named = f" ({', '.join(objects[:3])}{' and more' if len(objects) > 3 else ''})" if objects else ""
    return (f"{file} holds pickled Python objects beside its tensors{named}, which headsweep does not load "
            "(unpickling runs code from the file): convert it to safetensors once, on a machine where you trust the "
            f'file, e.g. python -c "{script}" (for a file holding a state dict), then move {file.name} out of the '
            "folder")


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files transformers loads from ``model_dir``, in its order of preference: safetensors (the shards
    its index names, or ``model.safetensors``), else PyTorch's (``pytorch_model.bin`` or its shards)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        index = model_dir / f"{name}.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map") or {}
            return [model_dir / f for f in sorted(set(weight_map.values()))]
        if (model_dir / name).is_file():
            return [model_dir / name]
    return []


def weight_bytes(model_dir: Path, dtype: str) -> int | None:
    """Bytes the weights of ``model_dir`` take once loaded in ``dtype`` (``model.dtype``), read from the files
    without loading them; None where the folder has no weights transformers would load.

    Safetensors: every tensor the headers list, floating ones at ``dtype``'s size, the others at their own
    (tied weights are stored once, as they are held once). PyTorch ``.bin`` files: their size, scaled from the
    dtype the config says they were saved in (``dtype`` or ``torch_dtype``; float32 if it says none) to
    ``dtype``; pickling adds a few kilobytes.
    """
    itemsize = dtype_bytes(dtype)
    files = weight_files(model_dir)
    total = 0
    for file in files:
        if file.suffix == ".safetensors":
            for name, entry in check_safetensors(file).items():
                if name == "__metadata__" or not isinstance(entry, dict):
                    continue
                kind = str(entry.get("dtype"))
                size = itemsize if kind in SAFETENSORS_FLOATING else SAFETENSORS_BYTES.get(kind, itemsize)
                total += math.prod(entry.get("shape") or []) * size
        else:
            config = read_json(model_dir / "config.json")
            saved = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) else None
            total += file.stat().st_size * itemsize // DTYPE_BYTES.get(str(saved), 4)
    return total if files else None
