"""The ablation methods headsweep knows: the built-in ones, and plugins installed as ``headsweep.ablations`` entry
points (``headsweep.plugins``).

Generic code asks a method by name (:func:`ablation_method`) what it declares
(:class:`~headsweep.workers.ablation.method.AblationMethod`) and never compares method names. Importing this module
imports no torch: the driver reads it when it reads a config.
"""

from __future__ import annotations

from headsweep.plugins import ABLATIONS_GROUP
from headsweep.registry import Registry
from headsweep.workers.ablation.mean import MEAN
from headsweep.workers.ablation.method import AblationMethod, check_method
from headsweep.workers.ablation.optimal import OPTIMAL
from headsweep.workers.ablation.patch import PATCH
from headsweep.workers.ablation.resample import RESAMPLE
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.ablation.zero import ZERO

# What a run that does not set sweep.ablation, and a stored row written before methods existed, use.
DEFAULT_METHOD = ZERO.name
# The methods headsweep brings, in registration order: the ``ablation`` section every config reads is theirs.
BUILTIN_METHODS: tuple[AblationMethod, ...] = (ZERO, MEAN, RESAMPLE, OPTIMAL, PATCH)

# Every registered method by name, in registration order (the order messages list them in).
METHODS: Registry[AblationMethod] = Registry("ablation method", "sweep.ablation", ABLATIONS_GROUP, AblationMethod,
                                             check=check_method)
register = METHODS.register

for _builtin in BUILTIN_METHODS:
    register(_builtin)


def method_names() -> list[str]:
    """The registered methods' names, in registration order."""
    return list(METHODS)


def ablation_method(name: str) -> AblationMethod:
    """The method called ``name``: a registered one, or one installed as a ``headsweep.ablations`` entry point
    (imported and registered now); or a clear error listing the known ones."""
    return METHODS.lookup(name)


def method_of(spec: AblationSpec) -> AblationMethod:
    """The method of the run's ablation ``spec`` (``RuntimeOptions.ablation``): what adapters ask it."""
    return ablation_method(spec.method)


def folding_methods() -> str:
    """The methods whose masks export can write, as a sentence lists them (``zero, mean or optimal``)."""
    names = [m.name for m in METHODS.values() if m.fold != "refused"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
