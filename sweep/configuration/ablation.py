"""``sweep.ablation`` and the ``ablation`` section: what a gated-off head leaves behind, for every experiment kind.

One setting read by the whole pipeline (as auto-circuit's ``AblationType``): every kind that evaluates masks
(single_head, all_but_one, custom, kv_group, prune_level, pairs, the L0 gates' closed-gate evaluations) and
gradient importance use the run's method through the workers' head gates (``headsweep.workers.ablation.spec``).
``zero`` (the default) is what every earlier run did: configs that do not set it keep their hash.

The section is built from the methods (:func:`section_class`): ``keep_first``, which every method honours, and the
fields of each method's ``settings`` dataclass (``AblationMethod.settings``), one key per name. No method's settings
are listed here: a method (a plugin's too) brings its own, with their ranges and choices, and a config that sets a key
of another method than ``sweep.ablation``'s is refused in one line naming the method it belongs to. The built-in
methods' section is :data:`AblationSection`; a config naming a plugin method reads it with that method's keys added
(:func:`read_section`), so the stored config and the hash of every other config stay as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterable
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.plugins import ABLATIONS_GROUP, installed
from headsweep.sweep.configuration.reader import from_dict
from headsweep.workers.ablation.method import COMMON_SETTINGS, AblationMethod, check_choices
from headsweep.workers.ablation.registry import BUILTIN_METHODS, METHODS, ablation_method

# The section's class name is part of every config hash that sets an ablation key (``settings_changed``'s
# ``__type__``): the same name for every method set keeps those hashes as they were.
SECTION_NAME = "AblationSection"


class _Section:
    """What every ``ablation`` section does besides holding its keys (:func:`section_class` makes the dataclass)."""

    def check(self, method: str) -> None:
        """The section's choices, the keys set that ``method`` (``sweep.ablation``) does not read, and the method's
        own checks of its settings."""
        declared = ablation_method(method)  # unknown names refused here, with the known ones
        check_choices(self)
        own = _names(declared)
        defaults = type(self)()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name in own or f.name in COMMON_SETTINGS or getattr(self, f.name) == getattr(defaults, f.name):
                continue
            raise HeadsweepError(refuse_foreign(f.name, method))
        declared.check_settings(declared.settings_from(self))


def _names(method: AblationMethod) -> list[str]:
    return [f.name for f in dataclasses.fields(method.settings)] if method.settings is not None else []


def owners(key: str) -> list[str]:
    """The registered methods that read ``ablation.<key>``, in registration order."""
    return [m.name for m in METHODS.values() if key in _names(m)]


def refuse_foreign(key: str, method: str) -> str:
    """The one line that refuses ``ablation.<key>`` in a config whose ``sweep.ablation`` (``method``) does not read
    it, naming the methods that do."""
    readers = owners(key)
    return (f"ablation.{key} is set but sweep.ablation is {method}, which does not read it: it is a setting of "
            f"{' and '.join(readers)}; remove it, or set sweep.ablation: {' or '.join(readers)}")


def _field(f: dataclasses.Field, hint: Any) -> tuple[str, Any, dataclasses.Field]:
    """A method's settings field as a field of the section (its type resolved, its default, range and marks kept)."""
    return (f.name, hint, dataclasses.field(default=f.default, default_factory=f.default_factory,  # type: ignore[arg-type]
                                            metadata=f.metadata))


def _same(a: dataclasses.Field, b: dataclasses.Field, hint_a: Any, hint_b: Any) -> bool:
    return (hint_a == hint_b and a.default == b.default and a.metadata == b.metadata
            and (a.default_factory is dataclasses.MISSING) == (b.default_factory is dataclasses.MISSING))


@functools.cache
def section_class(methods: tuple[AblationMethod, ...]) -> type:
    """The ``ablation`` section of ``methods``: ``keep_first`` and every method's settings fields, in registration
    order. Two methods may read the same key (``seed``, ``reference``) only with the same type, default and range:
    one key means one thing in a config, whatever the method."""
    fields: list[tuple[str, Any, dataclasses.Field]] = [("keep_first", bool, dataclasses.field(default=False))]
    seen: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    for method in methods:
        if method.settings is None:
            continue
        hints = typing.get_type_hints(method.settings)
        for f in dataclasses.fields(method.settings):
            if f.name in seen:
                first, other, hint = seen[f.name]
                if not _same(f, other, hints[f.name], hint):
                    raise HeadsweepError(
                        f"ablation method {method.name!r} declares ablation.{f.name} unlike {first} does (type, "
                        f"default or range): one key means one thing in a config; name the setting otherwise")
                continue
            seen[f.name] = (method.name, f, hints[f.name])
            fields.append(_field(f, hints[f.name]))
    cls = dataclasses.make_dataclass(SECTION_NAME, fields, bases=(_Section,))
    cls.__module__ = __name__
    cls.__doc__ = ("Config section ``ablation``: ``keep_first`` (every method: position 0 is never replaced) and the "
                   f"settings of the methods {', '.join(m.name for m in methods)} (each method's ``settings``).")
    return cls


# The built-in methods' section: the type of ``Config.ablation``, and what every config that names no plugin reads.
AblationSection = section_class(BUILTIN_METHODS)


def section_for(method: Any) -> type:
    """The section a config whose raw ``sweep.ablation`` is ``method`` reads: the built-in methods' section, with a
    plugin method's settings added when it names one (imported and registered now; an unknown name is refused)."""
    if not isinstance(method, str) or method in (m.name for m in BUILTIN_METHODS):
        return AblationSection
    return section_class((*BUILTIN_METHODS, ablation_method(method)))


def _load_installed() -> None:
    """Register every installed ``headsweep.ablations`` method not registered yet (one that cannot be loaded is left
    out: only a config naming it needs it), so that their settings have owners."""
    for name in installed(ABLATIONS_GROUP):
        if name not in METHODS:
            try:
                ablation_method(name)
            except HeadsweepError:
                continue


def read_section(data: Any, sweep: Any) -> Any:
    """The ``ablation`` section of a raw config (``data``), whose raw ``sweep`` section names the method; a key of
    another method (a registered or an installed one) than the config names is refused naming that method, not as
    an unknown key."""
    method = sweep.get("ablation") if isinstance(sweep, dict) else None
    cls = section_for(method)
    if isinstance(data, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in known]
        if unknown and not any(owners(k) for k in unknown):
            _load_installed()
        foreign = next((k for k in unknown if owners(k)), None)
        if foreign is not None:
            raise HeadsweepError(refuse_foreign(foreign, method if isinstance(method, str) else "zero"))
    return from_dict(cls, data, "ablation")


def method_settings(cfg: Any) -> tuple[AblationMethod, Any]:
    """The run's method and its settings object (from the config's ``ablation`` section)."""
    method = ablation_method(cfg.sweep.ablation)
    return method, method.settings_from(cfg.ablation)


def averaged_outcomes(cfg: Any) -> bool:
    """Whether each example's statistics are a mean over several resample draws (``ablation.resamples`` > 1), so
    that a 0/1 outcome (accuracy) is one no longer."""
    method, settings = method_settings(cfg)
    return method.draws(settings) > 1


def methods_reading(keys: Iterable[str]) -> dict[str, list[str]]:
    """For each of ``keys`` (section keys), the registered methods that read it (every method for ``keep_first``):
    what the configuration reference says of each key."""
    every = list(METHODS)
    return {k: every if k in COMMON_SETTINGS else owners(k) for k in keys}
