"""Sweep configuration: YAML files, ``key=value`` overrides, strict validation.

A config is a tree of dataclasses. Unknown keys are errors that name the key and the keys
that are allowed, because a misspelt key that is silently ignored runs the wrong sweep for
hours. The ``model`` and ``data`` sections are typed by ``model.kind`` (see
``headsweep.workers.family.TASK_KINDS``). A config file may name others to start from with
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

from headsweep.errors import HeadsweepError

EXPERIMENTS = ("baseline", "single_head", "all_but_one", "custom", "importance", "prune_level", "efficiency")
IMPORTANCE_METHODS = ("gradient", "ablation")
DEFAULT_LEVELS = [round(0.1 * i, 1) for i in range(11)]
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
    reuse: bool = True
    flush_every: int = 64
    flush_seconds: float = 10.0
    max_retries: int = 2
    worker_restarts: int = 3
    placement_timeout_s: float = 600.0
    wait_for_resources: bool = False


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
class ImportanceSection:
    """Head importance (Michel et al. sec. 4.1): how it is estimated, and on which data.

    ``data`` has the same keys as the top-level ``data`` section of the model kind and must
    not be the evaluation set: importance estimated on the data it is judged on flatters it.
    """

    method: str = "gradient"
    data: dict | None = None
    per_token: bool = True
    normalize: bool = True
    allow_eval_data: bool = False
    from_run: str | None = None


@dataclass
class PruneSection:
    """Pruning levels (Michel et al. sec. 4.2): mask the ceil(p * N) least important heads."""

    levels: list[float] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    attention: list[str] | None = None
    min_heads_per_layer: int = 0
    reestimate: bool = False


@dataclass
class EfficiencySection:
    """The ``efficiency`` experiment: the full and the physically pruned model, timed side by side.

    The mask is ``mask`` (head names), or the ``prune_level`` evaluation at ``level`` or the
    evaluation ``eval_id`` of run ``from_run`` (of this run when ``from_run`` is null).
    """

    mask: list[str] | None = None
    from_run: str | None = None
    level: float | None = None
    eval_id: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    warmup: int = 3
    repeats: int = 10


@dataclass
class Config:
    """A whole sweep. ``model`` and ``data`` are the dataclasses of ``model.kind``."""

    model: Any
    data: Any
    name: str = "sweep"
    seed: int = 0
    sweep: SweepSection = field(default_factory=SweepSection)
    significance: SignificanceSection = field(default_factory=SignificanceSection)
    importance: ImportanceSection = field(default_factory=ImportanceSection)
    prune: PruneSection = field(default_factory=PruneSection)
    efficiency: EfficiencySection = field(default_factory=EfficiencySection)
    checkpoints: list[str] | None = None

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
PATH_KEYS = ("path", "checkpoint", "data_bin", "source", "target", "bpe_codes", "sentencepiece_model")


def _resolve_paths(data: dict, base: Path) -> None:
    sections = [data.get("model"), data.get("data")]
    importance = data.get("importance")
    if isinstance(importance, dict):
        sections.append(importance.get("data"))
    for section in sections:
        if not isinstance(section, dict):
            continue
        for key in PATH_KEYS:
            value = section.get(key)
            if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
                candidate = base / value
                if candidate.exists():
                    section[key] = str(candidate.resolve())
    checkpoints = data.get("checkpoints")
    if isinstance(checkpoints, list):
        data["checkpoints"] = [
            str((base / c).resolve()) if isinstance(c, str) and (base / c).exists() else c for c in checkpoints
        ]


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
    from headsweep.workers.family import task_kind

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
        importance=from_dict(ImportanceSection, data.get("importance"), "importance"),
        prune=from_dict(PruneSection, data.get("prune"), "prune"),
        efficiency=from_dict(EfficiencySection, data.get("efficiency"), "efficiency"),
        checkpoints=_coerce(data.get("checkpoints"), list[str] | None, "checkpoints"),
    )
    if cfg.importance.data is not None:
        # Typed like the evaluation data, so a misspelt key fails here, not on a worker.
        from_dict(kind.data_config, cfg.importance.data, "importance.data")
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
    if s.num_gpus_per_worker < 0:
        raise HeadsweepError(f"sweep.num_gpus_per_worker must not be negative, got {s.num_gpus_per_worker}")
    if s.device == "cuda" and s.num_gpus_per_worker == 0:
        raise HeadsweepError(
            "sweep.device=cuda needs sweep.num_gpus_per_worker > 0 (Ray shows a GPU only to actors that ask for one)"
        )
    if s.device == "cpu" and s.num_gpus_per_worker > 0:
        raise HeadsweepError(
            f"sweep.device=cpu with sweep.num_gpus_per_worker={s.num_gpus_per_worker} would hold GPUs it never "
            "uses; set sweep.num_gpus_per_worker=0"
        )
    if s.max_retries < 0 or s.worker_restarts < 0:
        raise HeadsweepError("sweep.max_retries and sweep.worker_restarts must not be negative")
    validate_significance(cfg.significance)
    validate_importance(cfg)
    validate_efficiency(cfg)


def validate_efficiency(cfg: Config) -> None:
    e = cfg.efficiency
    if not e.batch_sizes or any(b < 1 for b in e.batch_sizes):
        raise HeadsweepError(f"efficiency.batch_sizes must be positive integers, got {e.batch_sizes}")
    if e.warmup < 0 or e.repeats < 1:
        raise HeadsweepError(f"efficiency needs warmup >= 0 and repeats >= 1, got {e.warmup} and {e.repeats}")
    if "efficiency" not in cfg.sweep.experiments:
        return
    named = [k for k in ("mask", "level", "eval_id") if getattr(e, k) is not None]
    if len(named) != 1:
        raise HeadsweepError(
            "experiment 'efficiency' needs exactly one of efficiency.mask (head names), efficiency.level "
            f"(a pruning level) or efficiency.eval_id (an evaluation), got {', '.join(named) or 'none'}"
        )
    if e.mask is not None:
        from headsweep.workers.heads import Head

        for name in e.mask:
            Head.parse(name)  # a misspelt name fails now; heads out of range fail once the model is loaded
    if e.mask is not None and e.from_run:
        raise HeadsweepError("efficiency.from_run goes with efficiency.level or efficiency.eval_id, not with a mask")
    if e.level is not None and not e.from_run and "prune_level" not in cfg.sweep.experiments:
        raise HeadsweepError("efficiency.level needs prune_level in sweep.experiments, or efficiency.from_run")


def validate_importance(cfg: Config) -> None:
    imp, prune, exps = cfg.importance, cfg.prune, cfg.sweep.experiments
    if imp.method not in IMPORTANCE_METHODS:
        raise HeadsweepError(
            f"unknown importance.method {imp.method!r} (known: {', '.join(IMPORTANCE_METHODS)})"
        )
    needs_importance = "importance" in exps or "prune_level" in exps
    if needs_importance and imp.method == "gradient":
        if imp.data is None:
            raise HeadsweepError(
                "gradient importance needs importance.data (training or validation data, kept apart from the "
                "evaluation set)"
            )
        if not imp.allow_eval_data:
            if imp.data == dataclasses.asdict(cfg.data) or _same_file(imp.data, cfg.data):
                raise HeadsweepError(
                    "importance.data is the evaluation set; estimate importance on training or validation data, "
                    "or set importance.allow_eval_data: true"
                )
            if _names_test_split(imp.data):
                raise HeadsweepError(
                    "importance.data looks like a test split; use training or validation data, "
                    "or set importance.allow_eval_data: true"
                )
    if needs_importance and imp.method == "ablation" and not imp.from_run and "single_head" not in exps:
        raise HeadsweepError(
            "importance.method ablation orders heads by single-head deltas: add single_head to sweep.experiments "
            "or name an earlier run with importance.from_run"
        )
    for p in prune.levels:
        if not 0.0 <= p <= 1.0:
            raise HeadsweepError(f"prune.levels must lie in [0, 1], got {p}")
    if prune.min_heads_per_layer < 0:
        raise HeadsweepError(f"prune.min_heads_per_layer must be >= 0, got {prune.min_heads_per_layer}")
    if prune.reestimate and imp.method != "gradient":
        raise HeadsweepError("prune.reestimate needs importance.method gradient")


def _same_file(a: dict, b: Any) -> bool:
    keys = ("path", "source", "target", "split")
    mine = {k: a.get(k) for k in keys if a.get(k)}
    theirs = {k: getattr(b, k, None) for k in keys if getattr(b, k, None)}
    return bool(mine) and mine == theirs


def _names_test_split(data: dict) -> bool:
    keys = ("path", "source", "name", "split") if data.get("data_bin") else ("path", "source", "name")
    names = [str(data.get(k) or "") for k in keys]
    return any(Path(n).name.lower().startswith("test") or n.lower() == "test" for n in names if n)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, merge, override and validate a config file."""
    return build_config(apply_overrides(read_yaml(Path(path)), overrides or []))
