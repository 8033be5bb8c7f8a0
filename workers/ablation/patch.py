"""``sweep.ablation: patch``: activation patching between paired inputs (the IOI and greater-than studies): a
gated-off head takes its output on the pair's other prompt.

``ablation.direction``: ``noising`` (the corrupted prompt's activations patched into the clean run, whose unpatched
score is the baseline) or ``denoising`` (the clean prompt's into the corrupted run, which is then the one
evaluated). Needs paired data (``data.task: paired``); the per-batch step is
:mod:`headsweep.workers.ablation.donors`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.ablation.spec import PATCH_NEEDS_PAIRS


class Patch(AblationMethod):
    name = "patch"
    fill = "per_example"
    settings = ("direction",)
    needs_pairs = True
    fold_refusal = "each example's heads take another input's activations"

    def draw_donors(self, spec: Any, lengths: Sequence[int], paired: bool, what: str, where: str, more: str):
        n = len(lengths)

        def pairs() -> np.ndarray:
            if not paired:
                raise HeadsweepError(PATCH_NEEDS_PAIRS)
            return np.arange(n, dtype=np.int64)[None, :]  # example i's donor: its own other prompt

        return pairs

    def fills_from_pair(self, spec: Any) -> bool:
        return True

    def evaluates_corrupted(self, spec: Any) -> bool:
        return spec.direction == "denoising"

    def data_facts(self, spec: Any) -> dict[str, Any]:
        return {"direction": spec.direction}

    def facts(self, spec: Any, means: Any) -> dict[str, Any]:
        return {**super().facts(spec, means), "direction": spec.direction}

    def refuse_per_example(self, what: str, why: str) -> None:
        raise HeadsweepError(PATCH_NEEDS_PAIRS)  # an adapter that cannot fill per example holds no pairs


PATCH = Patch()
