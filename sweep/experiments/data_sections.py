"""Data a kind reads besides the evaluation set (``importance.data``, ``l0.data``, ``roles.data``): typed like the
model family's ``data`` section, and the rule for data a kind trains or estimates on.

A settings field that holds such a section is marked ``field(metadata={"data": True})``; a field that names a
file, ``field(metadata={"file": True})``. The config reader resolves the paths in both relative to the config
file, as it does those of ``data`` (``headsweep.sweep.configuration.config``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.reader import from_dict
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.registry import model_family

# A settings field holding a data section, or naming a file (dataclasses.field metadata).
DATA, FILE = "data", "file"
FILE_KEYS = ("path", "source", "target", "data_bin")


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
    files (by where they are, not how they are spelled) and, for binarised data, the same folder and split."""
    keys = (*FILE_KEYS, "split")
    mine = {k: _same_place(k, a.get(k)) for k in keys if a.get(k)}
    theirs = {k: _same_place(k, getattr(b, k, None)) for k in keys if getattr(b, k, None)}
    return bool(mine) and mine == theirs


def names_test_split(data: dict) -> bool:
    """Whether a data section names a test split (a file or split called test...)."""
    keys = ("path", "source", "name", "split") if data.get("data_bin") else ("path", "source", "name")
    names = [str(data.get(k) or "") for k in keys]
    return any(Path(n).name.lower().startswith("test") or n.lower() == "test" for n in names if n)


def refuse_eval_data(key: str, data: dict, cfg: Config, same_advice: str, test_advice: str,
                     resolved: Any = None, name: str = "data") -> None:
    """The rule for data a kind trains or estimates on (``importance.data``, ``l0.data``, ``ablation.reference``
    with ``name``): not the evaluation set (the same section, file, or ``resolved`` typed section) nor a test split,
    unless ``<key>.allow_eval_data``."""
    if data == dataclasses.asdict(cfg.data) or same_data_file(data, cfg.data) or resolved == cfg.data:
        raise HeadsweepError(f"{key}.{name} is the evaluation set; {same_advice}, or set {key}.allow_eval_data: true")
    if names_test_split(data):
        raise HeadsweepError(f"{key}.{name} looks like a test split; {test_advice}, or set {key}.allow_eval_data: "
                             "true")
