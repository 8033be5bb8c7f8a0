"""``sweep.ablation: patch``: activation patching between paired inputs (the IOI and greater-than studies): a
gated-off head takes its output on the pair's other prompt.

``ablation.direction``: ``noising`` (the corrupted prompt's activations patched into the clean run, whose unpatched
score is the baseline) or ``denoising`` (the clean prompt's into the corrupted run, which is then the one
evaluated). Needs paired data (``data.task: paired``); the per-batch step is
:mod:`headsweep.workers.ablation.donors`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.method import AblationMethod


@dataclass(frozen=True)
class PatchSettings:
    """``ablation.direction``: ``noising`` (the corrupted prompt's activations patched into the clean run, whose
    unpatched score is the baseline: is the head necessary?) or ``denoising`` (the clean prompt's into the corrupted
    run, the baseline: is it sufficient?)."""

    direction: Literal["noising", "denoising"] = "noising"


class Patch(AblationMethod):
    name = "patch"
    fill = "per_example"
    settings = PatchSettings
    needs_pairs = True
    fold_refusal = "each example's heads take another input's activations"

    def draw_donors(self, spec: Any, lengths: Sequence[int], paired: bool, what: str, where: str, more: str):
        n = len(lengths)

        def pairs() -> np.ndarray:
            if not paired:
                raise HeadsweepError(self.unpaired_refusal())
            return np.arange(n, dtype=np.int64)[None, :]  # example i's donor: its own other prompt

        return pairs

    def fills_from_pair(self, spec: Any) -> bool:
        return True

    def evaluates_corrupted(self, spec: Any) -> bool:
        return self.settings_in(spec).direction == "denoising"

    def data_facts(self, spec: Any) -> dict[str, Any]:
        return {"direction": self.settings_in(spec).direction}

    def facts(self, spec: Any, means: Any) -> dict[str, Any]:
        return {**super().facts(spec, means), "direction": self.settings_in(spec).direction}

    def refuse_per_example(self, what: str, why: str) -> None:
        raise HeadsweepError(self.unpaired_refusal())  # an adapter that cannot fill per example holds no pairs

    def unpaired_refusal(self) -> str:
        return ("sweep.ablation patch needs paired data (clean and corrupted inputs): set data.task: paired "
                "(hf_causal_lm or hf_classifier: JSONL rows clean, corrupted, answer, wrong_answer), or use another "
                "sweep.ablation")

    def family_refusal(self, family: str, resample: bool = True) -> str:
        instead = "resample or mean" if resample else "mean"
        return (f"sweep.ablation patch is not available for {family} models: it patches activations between paired "
                f"clean and corrupted inputs, and {family} has no paired data format (data.task: paired); use "
                f"sweep.ablation {instead}")


PATCH = Patch()
