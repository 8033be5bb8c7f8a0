"""The typed config reader: a mapping read into a tree of dataclasses, and what of such a tree differs from its
defaults.

:func:`from_dict` builds a dataclass from a mapping and rejects unknown keys, naming the key and the keys that are
allowed, because a misspelt key that is silently ignored runs the wrong sweep for hours; :func:`coerce` types each
value (``int`` where a float is asked for, a comma-separated string where a list of strings is). The sections
themselves are in ``headsweep.sweep.configuration.sections`` and in the experiment kinds that declare them.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.core.setting_ranges import check_ranges


def settings_changed(section: Any) -> dict:
    """The fields of a dataclass tree whose values differ from their defaults (nested sections likewise)."""
    changed = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            inner = settings_changed(value)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if inner or type(value) is not type(default):
                changed[f.name] = {"__type__": type(value).__name__, **inner}
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            changed[f.name] = value
            continue
        if value != default:
            changed[f.name] = value
    return changed


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp`` (config key ``where``), or an error naming the key and the type."""
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
                return coerce(value, arg, where)
            except HeadsweepError as exc:
                errors.append(str(exc))
        raise HeadsweepError(errors[0] if errors else f"config key {where!r} must not be null")
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list):
            raise HeadsweepError(f"config key {where!r} must be a list, got {value!r}")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            raise HeadsweepError(f"config key {where!r} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    return _coerce_scalar(value, tp, where)


_SCIENTIFIC = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")


def _coerce_scalar(value: Any, tp: Any, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise HeadsweepError(f"config key {where!r} must be true or false, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        # YAML 1.1 (PyYAML) reads 1e-3 as text; YAML 1.2 and every user read it as a number.
        return float(value)
    if tp is int and isinstance(value, bool):
        raise HeadsweepError(f"config key {where!r} must be an integer, got {value!r}")
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise HeadsweepError(f"config key {where!r} must be {_type_name(tp)}, got {value!r}")
    return value


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown and missing keys and numbers outside the ranges its
    fields declare (``headsweep.workers.core.setting_ranges``)."""
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
            kwargs[name] = coerce(data[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise HeadsweepError(f"config key {key!r} is required")
    section = cls(**kwargs)
    check_ranges(section, where)
    return section
