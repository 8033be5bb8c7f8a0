"""Sweep configuration: YAML files, ``key=value`` overrides, strict validation.

A config is a tree of dataclasses. Unknown keys are errors that name the key and the keys
that are allowed, because a misspelt key that is silently ignored runs the wrong sweep for
hours. The ``model`` and ``data`` sections are typed by ``model.kind`` (see
``workers.tasks.TASK_KINDS``). A config file may name others to start from with
``include: [file, ...]`` (paths relative to the including file); later files and the
overrides win.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sweep.errors import HeadsweepError

EXPERIMENTS = ("baseline", "single_head", "all_but_one", "custom")
TESTS = ("paired_bootstrap", "paired_ttest", "mcnemar_exact")
CORRECTIONS = ("bh", "holm", "bonferroni", "none")


@dataclass
class SweepSection:
    """What to evaluate and how to spread it over workers."""

    experiments: list[str] = field(default_factory=lambda: ["baseline", "single_head", "all_but_one"])
    attention: list[str] | None = None
    masks: list[list[str]] = field(default_factory=list)
    workers: int = 1
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    device: str = "auto"
    threads_per_worker: int = 0
    batch_size: int = 32
    masks_per_batch: int = 0
    flush_every: int = 64
    flush_seconds: float = 10.0


@dataclass
class SignificanceSection:
    """Config section ``significance``."""

    enabled: bool = True
    tests: list[str] | None = None
    n_resamples: int = 1000
    seed: int = 12345
    alpha: float = 0.01
    correction: str = "bh"


def validate_significance(s: SignificanceSection) -> None:
    for test in s.tests or []:
        if test not in TESTS:
            raise HeadsweepError(f"unknown test {test!r} in significance.tests (known: {', '.join(TESTS)})")
    if s.correction not in CORRECTIONS:
        raise HeadsweepError(
            f"unknown significance.correction {s.correction!r} (known: {', '.join(CORRECTIONS)})"
        )
    if not 0 < s.alpha < 1:
        raise HeadsweepError(f"significance.alpha must be in (0, 1), got {s.alpha}")
    if s.n_resamples < 1:
        raise HeadsweepError(f"significance.n_resamples must be at least 1, got {s.n_resamples}")


@dataclass
class Config:
    """A whole sweep. ``model`` and ``data`` are the dataclasses of ``model.kind``."""

    model: Any
    data: Any
    name: str = "sweep"
    seed: int = 0
    sweep: SweepSection = field(default_factory=SweepSection)
    significance: SignificanceSection = field(default_factory=SignificanceSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        """Identity of what is computed: the canonical JSON of the config."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except HeadsweepError as exc:
                errors.append(str(exc))
        raise HeadsweepError(errors[0] if errors else f"config key {where!r} must not be null")
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list):
            raise HeadsweepError(f"config key {where!r} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            raise HeadsweepError(f"config key {where!r} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise HeadsweepError(f"config key {where!r} must be true or false, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise HeadsweepError(f"config key {where!r} must be an integer, got {value!r}")
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise HeadsweepError(f"config key {where!r} must be {_type_name(tp)}, got {value!r}")
    return value


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown and missing keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise HeadsweepError(f"config section {where or 'top level'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise HeadsweepError(
            f"unknown config key '{prefix}{unknown[0]}' (known keys{' in ' + where if where else ''}: "
            f"{', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise HeadsweepError(f"config key {key!r} is required")
    return cls(**kwargs)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file and the files it includes, merged in order."""
    path = Path(path)
    if not path.is_file():
        raise HeadsweepError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise HeadsweepError(f"config include cycle at {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise HeadsweepError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise HeadsweepError(f"config file {path} must hold a mapping at the top level")
    includes = data.pop("include", []) or []
    merged: dict = {}
    for inc in [includes] if isinstance(includes, str) else includes:
        merged = _merge(merged, read_yaml(path.parent / inc, (*seen, path.resolve())))
    merged = _merge(merged, data)
    _resolve_paths(merged, path.parent)
    return merged


# Keys that name files. A relative path is taken relative to the config file when it exists there,
# otherwise relative to the working directory (and a hub-style model id stays as written).
PATH_KEYS = {("model", "path"), ("model", "checkpoint"), ("model", "data_bin"), ("data", "path"),
             ("data", "source"), ("data", "target"), ("data", "bpe_codes"), ("data", "sentencepiece_model")}


def _resolve_paths(data: dict, base: Path) -> None:
    for section, key in PATH_KEYS:
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            candidate = base / value
            if candidate.exists():
                data[section][key] = str(candidate.resolve())


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (``x=3``, ``l=[a,b]``)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise HeadsweepError(f"bad override {item!r}: expected key=value (e.g. sweep.workers=2)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise HeadsweepError(f"bad override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return data


def build_config(data: dict) -> Config:
    """Validate a merged config mapping into a :class:`Config`."""
    from workers.tasks import task_kind

    data = dict(data)
    model = data.get("model")
    if not isinstance(model, dict) or "kind" not in model:
        raise HeadsweepError("config key 'model.kind' is required (one of: hf_classifier, fairseq_translation)")
    kind = task_kind(model["kind"])
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HeadsweepError(f"unknown config key '{unknown[0]}' (known keys: {', '.join(sorted(known))})")
    cfg = Config(
        model=from_dict(kind.model_config, model, "model"),
        data=from_dict(kind.data_config, data.get("data"), "data"),
        name=_coerce(data.get("name", "sweep"), str, "name"),
        seed=_coerce(data.get("seed", 0), int, "seed"),
        sweep=from_dict(SweepSection, data.get("sweep"), "sweep"),
        significance=from_dict(SignificanceSection, data.get("significance"), "significance"),
    )
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks across keys that the types alone do not catch."""
    s = cfg.sweep
    for exp in s.experiments:
        if exp not in EXPERIMENTS:
            raise HeadsweepError(
                f"unknown experiment kind {exp!r} in sweep.experiments (known: {', '.join(EXPERIMENTS)})"
            )
    if s.masks and "custom" not in s.experiments:
        s.experiments.append("custom")
    if "custom" in s.experiments and not s.masks:
        raise HeadsweepError("experiment 'custom' needs sweep.masks (a list of masks, each a list of head names)")
    if s.workers < 1:
        raise HeadsweepError(f"sweep.workers must be at least 1, got {s.workers}")
    if s.batch_size < 1:
        raise HeadsweepError(f"sweep.batch_size must be at least 1, got {s.batch_size}")
    if s.num_cpus_per_worker <= 0:
        raise HeadsweepError(f"sweep.num_cpus_per_worker must be positive, got {s.num_cpus_per_worker}")
    if s.device not in ("auto", "cpu", "cuda"):
        raise HeadsweepError(f"sweep.device must be auto, cpu or cuda, got {s.device!r}")
    validate_significance(cfg.significance)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, merge, override and validate a config file."""
    return build_config(apply_overrides(read_yaml(Path(path)), overrides or []))
