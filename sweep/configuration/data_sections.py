"""Data a kind reads besides the evaluation set (``importance.data``, ``l0.data``, ``roles.data``): typed like the
model family's ``data`` section, and the rule for data a kind trains or estimates on.

A settings field that holds such a section is marked ``field(metadata={"data": True})``; a field that names a
file, ``field(metadata={"file": True})``. The config reader resolves the paths in both relative to the config
file, as it does those of ``data`` (``headsweep.sweep.configuration.config``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.families.registry import model_family

# A settings field holding a data section, or naming a file (dataclasses.field metadata).
DATA, FILE = "data", "file"
FILE_KEYS = ("path", "source", "target", "data_bin")
# The keys that name one data file (data_bin names a folder): a copy of the evaluation file is the evaluation set.
COPY_KEYS = ("path", "source", "target")


def typed_data(cfg: Config, value: dict | None, key: str) -> Any:
    """``value`` (the config's ``key``, e.g. ``l0.data``) typed as the model family's data section."""
    return from_dict(model_family(cfg.model.kind).data_config, value, key)


def marked_fields(settings: Any, mark: str) -> list[str]:
    """The fields of the settings dataclass ``settings`` marked ``mark`` (:data:`DATA` or :data:`FILE`)."""
    return [f.name for f in dataclasses.fields(settings) if f.metadata.get(mark)]


def _same_place(key: str, value: Any) -> Any:
    """A file or folder named by a data key, as the file system knows it (a relative path, a link and the path
    it points to are one place); other keys as written."""
    if key in FILE_KEYS and isinstance(value, str) and "://" not in value:
        return os.path.realpath(value)
    return value


def same_data_file(a: dict, b: Any) -> bool:
    """Whether the data section ``a`` (a dict) names the same data as the typed data section ``b``: the same
    files (by where they are, not how they are spelled, or copies holding the same bytes) and, for binarised
    data, the same folder and split."""
    return _copied(a, b) is not None


def _copied(a: dict, b: Any) -> str | None:
    """How the data section ``a`` names ``b``'s data: None (other data), ``""`` (the same files), or which of its
    files are copies of ``b``'s (``X holds the same bytes as Y``)."""
    keys = (*FILE_KEYS, "split")
    mine = {k: _same_place(k, a.get(k)) for k in keys if a.get(k)}
    theirs = {k: _same_place(k, getattr(b, k, None)) for k in keys if getattr(b, k, None)}
    if not mine or mine.keys() != theirs.keys():
        return None
    copies = []
    for k in mine:
        if mine[k] == theirs[k]:
            continue
        if k not in COPY_KEYS or not same_bytes(mine[k], theirs[k]):
            return None
        copies.append(f"{a[k]} holds the same bytes as {getattr(b, k)}")
    return "; ".join(copies)


def same_bytes(a: str, b: str) -> bool:
    """Whether files ``a`` and ``b`` hold the same bytes: their sizes first, a SHA-256 of each only when those
    match (the run reads the evaluation file whole anyway). A path that is not a readable file is no copy."""
    try:
        if not (os.path.isfile(a) and os.path.isfile(b)) or os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return hashlib.file_digest(fa, "sha256").digest() == hashlib.file_digest(fb, "sha256").digest()
    except OSError:
        return False


def names_test_split(data: dict) -> bool:
    """Whether a data section names a test split (a file or split called test...)."""
    keys = ("path", "source", "name", "split") if data.get("data_bin") else ("path", "source", "name")
    names = [str(data.get(k) or "") for k in keys]
    return any(Path(n).name.lower().startswith("test") or n.lower() == "test" for n in names if n)


def refuse_eval_data(key: str, data: dict, cfg: Config, same_advice: str, test_advice: str,
                     resolved: Any = None, name: str = "data") -> None:
    """The rule for data a kind trains or estimates on (``importance.data``, ``l0.data``, ``ablation.reference``
    with ``name``): not the evaluation set (the same section, file or a copy of it, or ``resolved`` typed section) nor
    a test split, unless ``<key>.allow_eval_data``."""
    same = "" if data == dataclasses.asdict(cfg.data) or resolved == cfg.data else _copied(data, cfg.data)
    if same is not None:
        copy = f" ({same})" if same else ""
        raise HeadsweepError(f"{key}.{name} is the evaluation set{copy}; {same_advice}, or set {key}.allow_eval_data: "
                             "true")
    if names_test_split(data):
        raise HeadsweepError(f"{key}.{name} looks like a test split; {test_advice}, or set {key}.allow_eval_data: "
                             "true")
