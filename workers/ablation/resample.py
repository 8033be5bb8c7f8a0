"""``sweep.ablation: resample``: a gated-off head takes its output on a donor example of the same token length
(ACDC's and auto-circuit's default); the donors and the per-batch step are
:mod:`headsweep.workers.ablation.donors`'s.

``ablation.seed`` seeds the derangements, ``ablation.resamples`` (K) draws K of them and averages each example's
statistics over them. Donors come from the whole evaluation set (screening subsets are refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.core.setting_ranges import SEED, ranged

#: How many example lengths an error message names before it says how many more there are.
SHOWN = 5


def derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(n)`` with no fixed point, uniform over all such permutations (drawn by rejection:
    about e tries on average), from ``rng``. ``n`` must be at least 2."""
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 elements, got {n}")
    identity = np.arange(n)
    while True:
        perm = rng.permutation(n)
        if not (perm == identity).any():
            return perm


def same_length_donors(lengths: Sequence[int], seed: int, draws: int = 1, what: str = "examples",
                       where: str = "the evaluation data", more: str = "more data") -> np.ndarray:
    """Resample ablation's donors: shape ``(draws, n)``, ``donors[k, i]`` the example whose activations replace
    example ``i``'s in draw ``k``; within each group of examples of one length, a derangement (draw ``k`` seeded by
    ``(seed, k)``, the groups in order of length).

    Refused (:class:`HeadsweepError`) when an example has no other example of its length: it has no donor whose
    positions line up with its own. The line names the ``what`` of ``where`` and says how to get ``more``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    groups: dict[int, np.ndarray] = {int(n): np.flatnonzero(lengths == n) for n in np.unique(lengths)}
    alone = sorted(n for n, members in groups.items() if len(members) < 2)
    if alone:
        shown = ", ".join(str(n) for n in alone[:SHOWN]) + (f" and {len(alone) - SHOWN} more" if len(alone) > SHOWN
                                                            else "")
        raise HeadsweepError(
            f"sweep.ablation resample draws each example's donor among {what} of the same token length (the same "
            f"padding, so positions line up), and {len(alone)} of the {len(lengths)} {what} of {where} have no other "
            f"of their length (lengths {shown}): evaluate {more}, or use sweep.ablation mean")
    donors = np.empty((draws, len(lengths)), dtype=np.int64)
    for k in range(draws):
        rng = np.random.default_rng((seed, k))
        for members in groups.values():
            donors[k, members] = members[derangement(len(members), rng)]
    return donors


@dataclass(frozen=True)
class ResampleSettings:
    """``ablation.seed``: the donor draws' seed. ``ablation.resamples`` (K): K donor draws, each example's statistics
    the mean over the K."""

    seed: int = ranged(0, within=SEED)
    resamples: int = ranged(1, at_least=1)


class Resample(AblationMethod):
    name = "resample"
    fill = "per_example"
    settings = ResampleSettings
    needs_whole_set = True
    fold_refusal = "each example's heads take another input's activations"

    def draws(self, settings: ResampleSettings) -> int:
        return settings.resamples

    def draw_donors(self, spec: Any, lengths: Sequence[int], paired: bool, what: str, where: str, more: str):
        settings: ResampleSettings = self.settings_in(spec)
        # drawn now: data they cannot pair are refused when the adapter loads
        drawn = same_length_donors(list(lengths), settings.seed, settings.resamples, what, where, more)
        return lambda: drawn

    def facts(self, spec: Any, means: Any) -> dict[str, Any]:
        settings: ResampleSettings = self.settings_in(spec)
        return {**super().facts(spec, means), "seed": settings.seed, "resamples": settings.resamples,
                "donors": "a seeded derangement among examples of the same token length, per draw"}

    def attention_refusal(self, family: str, allowed: tuple[str, ...], what: str, fix: str) -> str:
        if not allowed:  # the general line: no type to name
            return super().attention_refusal(family, allowed, what, fix)
        return (f"sweep.ablation resample is available for {family} models on {', '.join(allowed)} heads only, and "
                f"{what}: a donor's decoder states follow its own hypotheses in beam search, so decoder attention "
                f"cannot take another sentence's states; {fix}, or use sweep.ablation mean")


RESAMPLE = Resample()
