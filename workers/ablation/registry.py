"""The ablation methods headsweep knows: the built-in ones, and plugins installed as ``headsweep.ablations`` entry
points (``headsweep.plugins``).

Generic code asks a method by name (:func:`ablation_method`) what it declares
(:class:`~headsweep.workers.ablation.method.AblationMethod`) and never compares method names. Importing this module
imports no torch: the driver reads it when it reads a config.
"""

from __future__ import annotations

from headsweep.errors import HeadsweepError
from headsweep.plugins import ABLATIONS_GROUP, installed, load_plugin
from headsweep.workers.ablation.mean import MEAN
from headsweep.workers.ablation.method import AblationMethod, check_method
from headsweep.workers.ablation.optimal import OPTIMAL
from headsweep.workers.ablation.patch import PATCH
from headsweep.workers.ablation.resample import RESAMPLE
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.ablation.zero import ZERO

# What a run that does not set sweep.ablation, and a stored row written before methods existed, use.
DEFAULT_METHOD = ZERO.name

# Every registered method by name, in registration order (the order messages list them in).
METHODS: dict[str, AblationMethod] = {}


def register(method: AblationMethod, replace: bool = False) -> AblationMethod:
    """Add ``method`` under its name (refused if the name is taken by another, unless ``replace``)."""
    check_method(method)
    if method.name in METHODS and METHODS[method.name] is not method and not replace:
        raise HeadsweepError(f"ablation method {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


for _builtin in (ZERO, MEAN, RESAMPLE, OPTIMAL, PATCH):
    register(_builtin)


def method_names() -> list[str]:
    """The registered methods' names, in registration order."""
    return list(METHODS)


def ablation_method(name: str) -> AblationMethod:
    """The method called ``name``: a registered one, or one installed as a ``headsweep.ablations`` entry point
    (imported and registered now); or a clear error listing the known ones."""
    if name in METHODS:
        return METHODS[name]
    plugin = load_plugin(name, ABLATIONS_GROUP, AblationMethod, "sweep.ablation")
    if plugin is None:
        known = [*METHODS, *(n for n in installed(ABLATIONS_GROUP) if n not in METHODS)]
        raise HeadsweepError(f"unknown sweep.ablation {name!r} (known: {', '.join(known)})")
    if plugin.name != name:
        raise HeadsweepError(f"ablation method entry point {name!r} names a method called {plugin.name!r}: the two "
                             "names must be the same")
    return register(plugin)


def method_of(spec: AblationSpec) -> AblationMethod:
    """The method of the run's ablation ``spec`` (``RuntimeOptions.ablation``): what adapters ask it."""
    return ablation_method(spec.method)


def folding_methods() -> str:
    """The methods whose masks export can write, as a sentence lists them (``zero, mean or optimal``)."""
    names = [m.name for m in METHODS.values() if m.fold != "refused"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
