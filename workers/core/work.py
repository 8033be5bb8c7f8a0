"""The unit of work the driver sends to a worker actor: one mask to evaluate, with its stable id.

It lives on the worker side because actors receive it pickled: workers must not import the
driver (``headsweep.sweep``) to read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.workers.core.heads import Head


@dataclass(frozen=True)
class WorkUnit:
    """One evaluation: a mask (heads gated off) and the head it is reported under."""

    eval_id: str
    experiment: str
    masked: tuple[Head, ...]
    attention: str | None = None
    layer: int | None = None
    head: int | None = None
    level: float | None = None
    # Evaluate on these examples only (positions in the evaluation set): a screening evaluation
    # (sweep.screen); None: the whole evaluation set.
    examples: tuple[int, ...] | None = None
    # Evaluate a model holding these weights instead of the loaded ones: the path of a torch state dict of the
    # same model (a fine-tuned copy, e.g. an ``l0.train: all`` trial's), readable by the workers (a local path:
    # the run's store on this machine or a shared filesystem); None: the loaded model.
    weights: str | None = None
