"""The examples of an evaluation set at chosen positions: what sequential screening (``sweep.screen``) evaluates first.

Every family reads its whole evaluation set, then keeps ``RuntimeOptions.examples`` (positions in that set,
after ``data.max_examples``) when it is given, before batching: an adapter on a subset is an ordinary adapter
whose evaluation set is smaller, and its rows line up with the full set's rows at those positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from headsweep.errors import HeadsweepError

T = TypeVar("T")


def at_positions(examples: T, positions: Sequence[int] | None) -> T:
    """``examples`` (a list, or a dataclass of per-example lists keyed by its ``ids``) at ``positions``.

    ``positions`` None returns ``examples`` unchanged. Fields of a dataclass that are not per-example lists
    (a name, a rate computed over the file) are kept as they are.
    """
    if positions is None:
        return examples
    n = len(examples.ids) if dataclasses.is_dataclass(examples) else len(examples)  # type: ignore[arg-type]
    bad = next((p for p in positions if not 0 <= p < n), None)
    if bad is not None:
        raise HeadsweepError(f"screening subset position {bad} is outside the evaluation set of {n} examples")
    if not dataclasses.is_dataclass(examples):
        return [examples[p] for p in positions]  # type: ignore[index,return-value]
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(examples):
        value = getattr(examples, f.name)
        if isinstance(value, list) and len(value) == n:
            changes[f.name] = [value[p] for p in positions]
    return dataclasses.replace(examples, **changes)
