"""Sweep configuration files: YAML, includes, ``key=value`` overrides, validation.

The sections every run has are in ``headsweep.sweep.configuration.sections``; the experiment kinds declare
theirs (``Experiment.settings``); the ``model`` and ``data`` sections are typed by ``model.kind`` (see
``headsweep.workers.core.family``). A config file may name others to start from with ``include: [file, ...]``
(paths relative to the including file); later files and the overrides win. Which names ``sweep.experiments``
accepts, and what each kind asks of the config, comes from the experiment registry
(``headsweep.sweep.experiments``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.plugins import FAMILIES_GROUP
from headsweep.sweep.configuration.ablation import AblationSection, read_section
from headsweep.sweep.configuration.ablation_checks import check_for_model, check_paired
from headsweep.sweep.configuration.data_sections import DATA, FILE, marked_fields, typed_data
from headsweep.sweep.configuration.reader import coerce, from_dict
from headsweep.sweep.configuration.sections import SECTIONS, Config, SignificanceSection, SweepSection, config_class
from headsweep.sweep.configuration.seeds import check_seeds
from headsweep.sweep.configuration.yaml_text import parse_override, read_yaml_file
from headsweep.workers.core.setting_ranges import check_ranges
from headsweep.workers.data.text_files import describe_kind
from headsweep.workers.families.registry import builtin_families, model_family
from headsweep.workers.hub.cache import parse_hub_id

if TYPE_CHECKING:
    from headsweep.sweep.experiments import Experiment

# configuration/ is the ground floor of the driver: the experiment kinds declare their sections with its types, and
# the screening policy (run/) reads its own. A config is assembled from the registered kinds and checked against them
# and the policy when one is built, so those imports stand in the functions that build one.


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
    if path.is_dir():
        raise HeadsweepError(f"config file {path} is a directory, not a file: name the YAML config file")
    if not path.is_file():
        if path.exists():  # a FIFO or a device (/dev/zero): never opened, so never read forever
            raise HeadsweepError(f"config file {path} is {describe_kind(path)}, not a regular file: name the YAML "
                                 "config file")
        raise HeadsweepError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise HeadsweepError(f"config include cycle at {path}")
    data = read_yaml_file(path)
    if data is None:
        if not seen:  # an empty file included by another adds nothing, and is harmless there
            raise HeadsweepError(f"config file {path} is empty: a config needs at least a model section "
                                 f"(model.kind: one of {family_names()}) and a data section")
        data = {}
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
PATH_KEYS = ("path", "checkpoint", "data_bin", "source", "target", "bpe_codes", "sentencepiece_model", "include_path")


def _path_slots(data: dict) -> list[tuple[str, dict | list, str | int]]:
    """Where a raw config mapping names files: ``(config key, container, index)`` for each relative path in it
    (``container[index]`` a non-empty string, neither absolute nor a URI): the model and data sections' file keys, the
    kinds' and the ablation section's data sections and files, and ``checkpoints``."""
    # The built-in kinds register their sections (SECTIONS) when imported: a caller that has not imported them yet
    # (headsweep run, which imports the driver only after the config passed) must still resolve their files.
    import headsweep.sweep.experiments  # noqa: F401

    sections = [("model", data.get("model")), ("data", data.get("data"))]
    slots: list[tuple[str, dict | list, str | int]] = []
    # The kinds' sections and the ablation section: their data sections and files.
    for key, settings in {**SECTIONS, "ablation": AblationSection}.items():
        own = data.get(key)
        if not isinstance(own, dict):
            continue
        sections += [(f"{key}.{name}", own.get(name)) for name in marked_fields(settings, DATA)]
        slots += [(f"{key}.{name}", own, name) for name in marked_fields(settings, FILE)]
    for where, section in sections:
        if isinstance(section, dict):
            slots += [(f"{where}.{key}", section, key) for key in PATH_KEYS]
    checkpoints = data.get("checkpoints")
    if isinstance(checkpoints, list):
        slots += [(f"checkpoints[{i}]", checkpoints, i) for i in range(len(checkpoints))]
    out = []
    for key, container, index in slots:
        value = container.get(index) if isinstance(container, dict) else container[index]  # type: ignore[index]
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            out.append((key, container, index))
    return out


def _resolve_paths(data: dict, base: Path) -> None:
    for _, container, index in _path_slots(data):
        candidate = base / container[index]  # type: ignore[index]
        if candidate.exists():
            container[index] = str(candidate.resolve())  # type: ignore[index]


def relative_paths(data: dict) -> list[str]:
    """``key=value`` of each relative file path a raw config mapping names (a model key that reads as a hub id,
    ``gpt2`` or ``org/name``, is not a path)."""
    out = []
    for key, container, index in _path_slots(data):
        value = container[index]  # type: ignore[index]
        if key in ("model.path", "model.tokenizer") and parse_hub_id(value) is not None:
            continue
        out.append(f"{key}={value}")
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (``x=3``, ``l=[a,b]``). A key given twice is
    refused, as it is in a config file: which one wins is not what a reader of the command line sees."""
    data = json.loads(json.dumps(data))
    given: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise HeadsweepError(f"bad override {item!r}: expected key=value (e.g. sweep.workers=2)")
        key, raw = item.split("=", 1)
        name = ".".join(part.strip() for part in key.split("."))
        if name in given:
            raise HeadsweepError(f"override {name} is given twice ({given[name]} and {item}): give it once")
        given[name] = item
        value = parse_override(item, raw)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise HeadsweepError(f"bad override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return data


def workers_override(workers: int, overrides: list[str]) -> str:
    """``--workers N`` as the override it stands for, refused beside a ``sweep.workers=`` override of its own."""
    for item in overrides:
        if item.split("=", 1)[0].replace(" ", "") == "sweep.workers":
            raise HeadsweepError(f"--workers {workers} and {item} both set the number of workers: give one")
    return f"sweep.workers={workers}"


def family_names() -> str:
    """The built-in model families' names, for messages: ``fairseq_translation, hf_causal_lm, hf_classifier``."""
    return ", ".join(sorted(f.name for f in builtin_families()))


def build_config(data: dict) -> Config:
    """Validate a merged config mapping into a :class:`Config`."""
    data = dict(data)
    model = data.get("model")
    kinds = f"one of: {family_names()}, or an installed {FAMILIES_GROUP!r} entry point"
    if model is None:
        raise HeadsweepError(f"config key 'model.kind' is required: the config has no model section ({kinds})")
    if not isinstance(model, dict):
        raise HeadsweepError(f"config key 'model' must be a mapping with model.kind ({kinds}) and the model's "
                             f"files, got {model!r}")
    if "kind" not in model:
        raise HeadsweepError(f"config key 'model.kind' is required ({kinds})")
    from headsweep.sweep.experiments import BUILTIN_KINDS, KINDS

    family = model_family(model["kind"])
    named = [KINDS[name] for name in BUILTIN_KINDS] + _named_kinds(data.get("sweep"))
    config = config_class([k.section for k in named if k.settings is not None and k.section is not None])
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HeadsweepError(f"unknown config key '{unknown[0]}' (known keys: {', '.join(sorted(known))})")
    cfg = config(
        model=from_dict(family.model_config, model, "model"),
        data=from_dict(family.data_config, data.get("data"), "data"),
        name=coerce(data.get("name", "sweep"), str, "name"),
        seed=coerce(data.get("seed", 0), int, "seed"),
        sweep=from_dict(SweepSection, data.get("sweep"), "sweep"),
        significance=from_dict(SignificanceSection, data.get("significance"), "significance"),
        ablation=read_section(data.get("ablation"), data.get("sweep")),
        **{key: from_dict(settings, data.get(key), key) for key, settings in SECTIONS.items() if key in known},
        checkpoints=coerce(data.get("checkpoints"), list[str] | None, "checkpoints"),
    )
    check_ranges(cfg)  # the top-level keys (each section checked its own as it was read)
    validate(cfg)
    return cfg


def _named_kinds(sweep: Any) -> list[Experiment]:
    """The registered kinds the raw ``sweep`` section names in ``experiments``, one installed as an entry point
    imported and registered now: their config sections are part of this config. Other names are checked later."""
    from headsweep.sweep.experiments import KINDS, experiment_kind, is_plugin_name

    names = sweep.get("experiments") if isinstance(sweep, dict) else None
    if isinstance(names, str):
        names = names.replace(",", " ").split()
    if not isinstance(names, list):
        return []
    return [experiment_kind(n) for n in names if isinstance(n, str) and (n in KINDS or is_plugin_name(n))]


def validate(cfg: Config) -> None:
    """Checks across keys that the types alone do not catch: each section's, then each experiment kind's.

    ``sweep.experiments`` may grow here: a kind implied by other keys joins it (``sweep.masks``
    adds ``custom``), so that the config's hash says what the run computes.
    """
    from headsweep.sweep.experiments import KINDS, experiments_of

    _check_sections(cfg)
    kinds = experiments_of(cfg)
    if not cfg.sweep.experiments:
        raise HeadsweepError(f"sweep.experiments is empty: name the experiment kinds to run (known: "
                             f"{', '.join(KINDS)}; [baseline] evaluates the unmasked model alone)")
    for kind in kinds:
        kind.check_config(cfg)


def data_sections(cfg: Config) -> list[tuple[str, Any]]:
    """The data sections a run of ``cfg`` reads, typed, with their config keys: ``data``, and those the kinds of the
    run read (``importance.data``, ``l0.data``, ``roles.data``: ``Experiment.data_sections``) and
    ``ablation.reference``. A section equal to
    an earlier one is left out."""
    from headsweep.sweep.experiments import experiments_of

    sections = [("data", cfg.data)]
    for kind in experiments_of(cfg):
        sections += kind.data_sections(cfg)
    if cfg.ablation.reference is not None:
        sections.append(("ablation.reference", typed_data(cfg, cfg.ablation.reference, "ablation.reference")))
    out: list[tuple[str, Any]] = []
    for key, section in sections:
        if all(section != other for _, other in out):
            out.append((key, section))
    return out


def check_data_files(cfg: Config) -> None:
    """Every data section a run of ``cfg`` reads, checked on the driver before Ray or a model starts: its settings,
    its files, and what can be read of them without the model (the family's ``check_data(section, key)``; a
    plugin's section without checks is checked by its workers). The workers check the rest (labels against the
    model's, lengths against its positions) before anything is written."""
    from headsweep.sweep.experiments import KINDS, declaring

    family = model_family(cfg.model.kind)
    sections = data_sections(cfg)
    for key, section in sections:
        family.check_data(section, key)
    check_paired(cfg.sweep.ablation, sections, {KINDS[n].section for n in declaring("reads_attention")})


def _check_sections(cfg: Config) -> None:
    from headsweep.sweep.experiments import KINDS, declaring
    from headsweep.sweep.run.screening import Screening

    check_seeds(cfg)
    _check_checkpoints(cfg.checkpoints)
    model_check = getattr(cfg.model, "check", None)  # a family's checks across its model keys, if it has any
    if model_check is not None:
        model_check()
    cfg.sweep.check()
    Screening.check_config(cfg, declaring("screened"), declaring("whole_set"))
    if cfg.sweep.max_tokens is not None and not model_family(cfg.model.kind).batches_by_tokens:
        raise HeadsweepError(
            f"sweep.max_tokens applies to model families that batch by tokens (fairseq_translation), "
            f"not {cfg.model.kind}: use sweep.batch_size"
        )
    if cfg.sweep.context_cache and getattr(cfg.data, "task", None) not in ("multiple_choice", "lm_eval"):
        raise HeadsweepError(
            "sweep.context_cache applies to causal LMs on multiple-choice questions (model.kind hf_causal_lm, "
            f"data.task multiple_choice or lm_eval), not model.kind {cfg.model.kind} with data.task "
            f"{getattr(cfg.data, 'task', None)}: remove it or set it false"
        )
    cfg.significance.check()
    cfg.ablation.check(cfg.sweep.ablation)
    check_for_model(cfg)
    for kind in KINDS.values():  # each kind's settings this config has, whether or not the run has the kind
        if kind.section is None or hasattr(cfg, kind.section):
            kind.check_settings(cfg)


def _check_checkpoints(checkpoints: list[str] | None) -> None:
    """The same checkpoint twice would be swept twice while the run counts it once."""
    if not checkpoints:
        return
    seen: dict[str, str] = {}
    for checkpoint in checkpoints:
        same = str(Path(checkpoint).resolve()) if "://" not in checkpoint else checkpoint
        if same in seen:
            also = "" if seen[same] == checkpoint else f" (as {seen[same]} and {checkpoint})"
            raise HeadsweepError(f"checkpoints names {checkpoint} twice{also}: name each checkpoint once")
        seen[same] = checkpoint


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, merge, override and validate a config file."""
    return build_config(apply_overrides(read_yaml(Path(path)), overrides or []))
