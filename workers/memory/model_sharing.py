"""One copy of the weights per worker: an adapter on other data uses the model the worker already holds.

A worker keeps its evaluation adapter and, for experiments that read other data (gradient importance's
``importance.data``, relevance, roles), a second adapter on that data. Loading the model again for it doubled the
worker's weights: on Llama-3.2-1B's shape (4.6 GiB in float32) the worker that computed importance and then timed
efficiency peaked at 15.0 GiB, two full copies and efficiency's pruned one. While :func:`offered` is active, a
family's loader that finds the offered model to be the one its config names (same folder, dtype, device and
attention implementation) uses it instead of loading another.

Sharing is safe because a worker runs one step at a time: each adapter installs its own gates, whose hooks do
nothing while that adapter has none set, so the two adapters never gate each other's passes. Only the adapter on
other data shares: a variant holding other weights (training checkpoints) or a screening subset loads its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver imports the worker actor's module: keep torch out of its import time
    from torch import nn

_offered: list[nn.Module] = []


@contextlib.contextmanager
def offered(model: nn.Module | None) -> Iterator[None]:
    """While active, loaders may use ``model`` (None: nothing offered) instead of loading the same model again."""
    if model is not None:
        _offered.append(model)
    try:
        yield
    finally:
        if model is not None:
            _offered.remove(model)


def offered_models() -> list[nn.Module]:
    """The models on offer, the latest first."""
    return list(reversed(_offered))
