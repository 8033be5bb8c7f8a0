"""Plugins (experiment kinds, model families, ablation methods) defined outside headsweep, found through installed
entry points.

A config names a plugin by its entry-point name, never by a module path: configs come from many users of one
cluster, and reading one must never import code the config chooses. What can be imported is what the cluster's
administrator installed: a package declaring, in its ``pyproject.toml``::

    [project.entry-points."headsweep.kinds"]
    my_kind = "my_package.kinds:MY_KIND"

    [project.entry-points."headsweep.families"]
    my_family = "my_package.family:MY_FAMILY"

    [project.entry-points."headsweep.ablations"]
    my_method = "my_package.ablation:MY_METHOD"
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TypeVar

from headsweep.errors import HeadsweepError

T = TypeVar("T")

KINDS_GROUP = "headsweep.kinds"
FAMILIES_GROUP = "headsweep.families"
ABLATIONS_GROUP = "headsweep.ablations"


def installed(group: str) -> list[str]:
    """The entry-point names installed in ``group``, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)})


def refuse_module_path(name: str, what: str, group: str) -> None:
    """Refuse ``name`` if it is a module path (``package.module:ATTRIBUTE``), which configs may not name."""
    if ":" in name:
        raise HeadsweepError(
            f"{what} {name!r} is a module path, and configs never import code: install the plugin as an entry point "
            f"in group {group!r} and name it by that entry point's name"
        )


def load_plugin(name: str, group: str, expected: type[T], what: str) -> T | None:
    """The object the installed entry point ``name`` of ``group`` names, checked to be an ``expected``; None where
    no such entry point is installed. ``what`` names the config key in messages (``model.kind``, ...)."""
    refuse_module_path(name, what, group)
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        return None
    try:
        plugin = found[0].load()
    except (ImportError, AttributeError) as exc:
        raise HeadsweepError(
            f"{what} {name!r}: its entry point {found[0].value!r} cannot be imported ({exc})"
        ) from None
    if not isinstance(plugin, expected):
        raise HeadsweepError(
            f"{what} {name!r} (entry point {found[0].value!r}) is a {type(plugin).__name__}, not a "
            f"{expected.__module__}.{expected.__name__}"
        )
    return plugin
