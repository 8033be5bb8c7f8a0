"""Plugins named as ``package.module:ATTRIBUTE`` in a config (model families, experiment kinds)."""

from __future__ import annotations

import importlib
from typing import TypeVar

from headsweep.errors import HeadsweepError

T = TypeVar("T")


def load_plugin(name: str, expected: type[T], what: str) -> T:
    """The object ``package.module:ATTRIBUTE`` names, checked to be an ``expected``; one-line errors.

    ``what`` names the config key in messages (``model.kind``, ``experiment kind``).
    """
    module, _, attribute = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise HeadsweepError(f"{what} {name!r}: cannot import it ({exc})") from None
    if not isinstance(found, expected):
        raise HeadsweepError(
            f"{what} {name!r} is a {type(found).__name__}, not a {expected.__module__}.{expected.__name__}"
        )
    return found
