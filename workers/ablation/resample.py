"""``sweep.ablation: resample``: a gated-off head takes its output on a donor example of the same token length
(ACDC's and auto-circuit's default); the donors and the per-batch step are
:mod:`headsweep.workers.ablation.donors`'s.

``ablation.seed`` seeds the derangements, ``ablation.resamples`` (K) draws K of them and averages each example's
statistics over them. Donors come from the whole evaluation set (screening subsets are refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headsweep.workers.ablation.method import AblationMethod


class Resample(AblationMethod):
    name = "resample"
    fill = "per_example"
    settings = ("seed", "resamples")
    needs_whole_set = True
    fold_refusal = "each example's heads take another input's activations"

    def draws(self, section: Any) -> int:
        return section.resamples

    def draw_donors(self, spec: Any, lengths: Sequence[int], paired: bool, what: str, where: str, more: str):
        from headsweep.workers.ablation.donors import same_length_donors  # torch: on the workers only

        # drawn now: data they cannot pair are refused when the adapter loads
        drawn = same_length_donors(list(lengths), spec.seed, spec.resamples, what, where, more)
        return lambda: drawn

    def facts(self, spec: Any, means: Any) -> dict[str, Any]:
        return {**super().facts(spec, means), "seed": spec.seed, "resamples": spec.resamples,
                "donors": "a seeded derangement among examples of the same token length, per draw"}


RESAMPLE = Resample()
