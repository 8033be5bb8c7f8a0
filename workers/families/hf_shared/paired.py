"""Paired inputs in both transformers families (``data.task: paired``): which input of each clean / corrupted pair
a run evaluates, and which fills its gated-off heads.

The clean input is evaluated, except under ``sweep.ablation: patch`` with ``ablation.direction: denoising``, where
the corrupted one is; so the baseline (the empty mask) is the unpatched clean run under noising (and every other
method) and the unpatched corrupted run under denoising. Under patching a gated-off head takes its output on the
pair's other input; under resample, on another pair's evaluated input (:mod:`headsweep.workers.ablation.donors`).
The normalised patching score ``(patched - corrupted) / (clean - corrupted)`` needs both unpatched means, which the
adapters record in the run's facts (:meth:`PairedSides.clean_and_corrupted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from headsweep.workers.ablation.registry import method_of
from headsweep.workers.ablation.spec import AblationSpec

T = TypeVar("T")


@dataclass(frozen=True)
class PairedSides:
    """The run's choice of sides: ``evaluated`` is ``"clean"`` or ``"corrupted"``; ``fill_from_other``: gated-off
    heads take the pair's other input (patch), not another pair's evaluated input."""

    evaluated: str
    fill_from_other: bool

    def arrange(self, clean: T, corrupted: T) -> tuple[T, T]:
        """``(evaluated, other)``: the inputs every mask is evaluated on, and each pair's other input."""
        return (corrupted, clean) if self.evaluated == "corrupted" else (clean, corrupted)

    def donor_side(self, evaluated: T, other: T) -> T:
        """The inputs the per-example fill's donor pass reads."""
        return other if self.fill_from_other else evaluated

    def clean_and_corrupted(self, evaluated: T, other: T) -> tuple[T, T]:
        """A value of the evaluated side and of the other side, as ``(clean, corrupted)``."""
        return (evaluated, other) if self.evaluated == "clean" else (other, evaluated)


def paired_sides(spec: AblationSpec) -> PairedSides:
    """The sides of the run's ablation ``spec`` (module docstring)."""
    method = method_of(spec)
    return PairedSides("corrupted" if method.evaluates_corrupted(spec) else "clean", method.fills_from_pair(spec))
