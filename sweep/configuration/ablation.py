"""``sweep.ablation`` and the ``ablation`` section: what a gated-off head leaves behind, for every experiment kind.

One setting read by the whole pipeline (as auto-circuit's ``AblationType``): every kind that evaluates masks
(single_head, all_but_one, custom, kv_group, prune_level, pairs, the L0 gates' closed-gate evaluations) and
gradient importance use the run's method through the workers' head gates (``headsweep.workers.ablation.spec``).
``zero`` (the default) is what every earlier run did: configs that do not set it keep their hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.method import SETTINGS
from headsweep.workers.ablation.registry import ablation_method
from headsweep.workers.core.setting_ranges import SEED, ranged

POSITIONS = ("all", "per_position")
DIRECTIONS = ("noising", "denoising")


@dataclass
class AblationSection:
    """Config section ``ablation``: the settings of ``sweep.ablation``'s method.

    ``reference``: the data whose head outputs give mean ablation its means (a data section typed like ``data``;
    None: the evaluation data). ``positions``: ``all`` (one mean per head over every non-padding token) or
    ``per_position`` (one per absolute position; positions the reference never reaches take the pooled mean).
    ``keep_first``: the first position of every sequence is never replaced (decoder-only models' BOS sink).
    ``seed`` and ``resamples``: resample ablation's donor draws (``resamples`` K: each example's statistics are the
    mean over K draws). ``direction``: activation patching's, ``noising`` (the corrupted prompt's activations patched
    into the clean run, whose unpatched score is the baseline: is the head necessary?) or ``denoising`` (the clean
    prompt's into the corrupted run, the baseline: is it sufficient?). ``steps`` and ``lr``: optimal ablation's most
    Adam updates per head and learning rate (``headsweep.workers.ablation.optimal``).
    """

    reference: dict | None = field(default=None, metadata={"data": True})
    positions: str = "all"
    keep_first: bool = False
    seed: int = ranged(0, within=SEED)
    resamples: int = ranged(1, at_least=1)
    allow_eval_data: bool = False
    direction: str = "noising"
    # 0 steps would store optimal ablation with its untrained starting constants
    steps: int = ranged(100, at_least=1)
    lr: float = ranged(0.01, above=0)

    def check(self, method: str) -> None:
        """The section's own values, and those that mean nothing for ``method`` (``sweep.ablation``)."""
        declared = ablation_method(method)  # unknown names refused here, with the known ones
        if self.positions not in POSITIONS:
            raise HeadsweepError(f"unknown ablation.positions {self.positions!r} (known: {', '.join(POSITIONS)})")
        if self.direction not in DIRECTIONS:
            raise HeadsweepError(f"unknown ablation.direction {self.direction!r} (known: {', '.join(DIRECTIONS)})")
        defaults = AblationSection()
        for name in SETTINGS:  # keep_first: every method honours it
            if name not in declared.settings and getattr(self, name) != getattr(defaults, name):
                raise HeadsweepError(f"ablation.{name} is set but sweep.ablation is {method}, which does not read "
                                     f"it: remove it, or set sweep.ablation to a method that does")
        declared.check_settings(self)


def averaged_outcomes(cfg: Any) -> bool:
    """Whether each example's statistics are a mean over several resample draws (``ablation.resamples`` > 1), so
    that a 0/1 outcome (accuracy) is one no longer."""
    return ablation_method(cfg.sweep.ablation).draws(cfg.ablation) > 1
