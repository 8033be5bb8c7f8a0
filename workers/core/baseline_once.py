"""``evaluate`` and ``baseline`` of an adapter that computes its unmasked evaluation once and reuses it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from headsweep.workers.core.family import MaskOutput
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head


class BaselineOnce:
    """An adapter's ``evaluate`` and ``baseline``: the unmasked evaluation is computed once and reused (every later
    empty mask gets that very output); a subclass computes one row of per-example values per mask (``values``) and
    turns a row into a :class:`MaskOutput` (``output``)."""

    gates: HeadGates
    _baseline: MaskOutput | None = None

    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Per-example values under each mask: shape (n_masks, n_examples, ...), float64."""
        raise NotImplementedError

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        """The evaluation of one mask from its per-example values."""
        raise NotImplementedError

    def baseline(self) -> MaskOutput:
        """The unmasked evaluation, computed once and reused."""
        if self._baseline is None:
            self._baseline = self.evaluate([[]])[0]
        return self._baseline

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Each mask's evaluation; every head is checked against the model's heads first (a mask naming a head the
        model lacks is refused before anything runs)."""
        masks = [list(m) for m in masks]
        for mask in masks:
            for head in mask:
                self.gates.inventory.check(head)
        todo = [i for i, m in enumerate(masks) if m or self._baseline is None]
        start = time.perf_counter()
        computed = dict(zip(todo, self.values([masks[i] for i in todo]), strict=True)) if todo else {}
        seconds_each = (time.perf_counter() - start) / max(1, len(todo))
        return [self.output(computed[i], seconds_each) if i in computed else self._baseline
                for i in range(len(masks))]
