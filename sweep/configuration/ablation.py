"""``sweep.ablation`` and the ``ablation`` section: what a gated-off head leaves behind, for every experiment kind.

One setting read by the whole pipeline (as auto-circuit's ``AblationType``): every kind that evaluates masks
(single_head, all_but_one, custom, kv_group, prune_level, pairs, the L0 gates' closed-gate evaluations) and
gradient importance use the run's method through the workers' head gates (``headsweep.workers.ablation``).
``zero`` (the default) is what every earlier run did: configs that do not set it keep their hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation import METHODS, PATCH_NEEDS_PAIRS, PER_EXAMPLE_METHODS

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
    Adam updates per head and learning rate (``headsweep.workers.optimal_ablation``).
    """

    reference: dict | None = field(default=None, metadata={"data": True})
    positions: str = "all"
    keep_first: bool = False
    seed: int = 0
    resamples: int = 1
    allow_eval_data: bool = False
    direction: str = "noising"
    steps: int = 100
    lr: float = 0.01

    def check(self, method: str) -> None:
        """The section's own values, and those that mean nothing for ``method`` (``sweep.ablation``)."""
        if method not in METHODS:
            raise HeadsweepError(f"unknown sweep.ablation {method!r} (known: {', '.join(METHODS)})")
        if self.positions not in POSITIONS:
            raise HeadsweepError(f"unknown ablation.positions {self.positions!r} (known: {', '.join(POSITIONS)})")
        if self.resamples < 1:
            raise HeadsweepError(f"ablation.resamples must be at least 1, got {self.resamples}")
        if self.steps < 0:
            raise HeadsweepError(f"ablation.steps must be at least 0, got {self.steps}")
        if not self.lr > 0:
            raise HeadsweepError(f"ablation.lr must be positive, got {self.lr}")
        if self.direction not in DIRECTIONS:
            raise HeadsweepError(f"unknown ablation.direction {self.direction!r} (known: {', '.join(DIRECTIONS)})")
        meaningful = {"zero": ("keep_first",), "mean": ("reference", "positions", "keep_first"),
                      "resample": ("seed", "resamples", "keep_first"),
                      "optimal": ("reference", "keep_first", "allow_eval_data", "seed", "steps", "lr"),
                      "patch": ("keep_first", "direction")}[method]
        defaults = AblationSection()
        for name in ("reference", "positions", "seed", "resamples", "allow_eval_data", "direction", "steps", "lr"):
            if name not in meaningful and getattr(self, name) != getattr(defaults, name):
                raise HeadsweepError(f"ablation.{name} is set but sweep.ablation is {method}, which does not read "
                                     f"it: remove it, or set sweep.ablation to a method that does")


def averaged_outcomes(cfg: Any) -> bool:
    """Whether each example's statistics are a mean over several resample draws (``ablation.resamples`` > 1), so
    that a 0/1 outcome (accuracy) is one no longer."""
    return cfg.sweep.ablation == "resample" and cfg.ablation.resamples > 1


def ablation_settings(cfg: Any) -> tuple[str, AblationSection]:
    """The run's method and its settings."""
    return cfg.sweep.ablation, cfg.ablation


def check_paired(method: str, sections: list[tuple[str, Any]]) -> None:
    """Under ``patch``, every data set evaluated or differentiated under the fill is paired: the evaluation data,
    importance's and L0's (``sections``: the run's typed data sections by config key; roles reads attention, which no
    fill changes)."""
    if method != "patch":
        return
    for key, section in sections:
        if key != "roles.data" and not getattr(section, "paired", False):
            raise HeadsweepError(PATCH_NEEDS_PAIRS if key == "data" else
                                 f"{key} is not paired data, and sweep.ablation patch fills every head from the other "
                                 f"input of its pair: give {key} paired data (data.task: paired) too")


def _check_per_example(cfg: Any, family: Any) -> None:
    """resample and patch (per-example fills, ``headsweep.workers.donors``): patch needs paired data; resample draws
    donors over the whole evaluation set, which screening's subsets do not hold; fairseq translation's decoder
    attention cannot take another sentence's states (a donor's decoder states follow its own hypotheses)."""
    method = cfg.sweep.ablation
    if method not in PER_EXAMPLE_METHODS:
        return
    if method == "patch" and not getattr(cfg.data, "paired", False):
        raise HeadsweepError(PATCH_NEEDS_PAIRS)
    if method == "resample" and cfg.sweep.screen is not None:
        raise HeadsweepError("sweep.screen evaluates a subset of the examples first, and sweep.ablation resample draws "
                             "each example's donor from the whole evaluation set: remove sweep.screen, or use "
                             "sweep.ablation mean")
    if not family.fills_by_position:
        raise HeadsweepError(f"sweep.ablation {method} is not available for {family.name} models: a donor's decoder "
                             "states follow its own hypotheses in beam search, so decoder attention cannot take them; "
                             "use sweep.ablation mean")


def _check_optimal(cfg: Any, section: AblationSection) -> None:
    """optimal trains its constants on ``ablation.reference``: required, and not the evaluation set (its deltas would
    be fitted to the data they are measured on) unless ``ablation.allow_eval_data``."""
    if section.reference is None:
        raise HeadsweepError("sweep.ablation optimal trains each head's constant on ablation.reference: set it to "
                             "training or validation data (a data section like data, kept apart from the evaluation "
                             "set)")
    if not section.allow_eval_data:
        from headsweep.sweep.experiments.data_sections import refuse_eval_data, typed_data  # imports config

        advice = "train optimal ablation's constants on training or validation data"
        refuse_eval_data("ablation", section.reference, cfg, advice, advice,
                         resolved=typed_data(cfg, section.reference, "ablation.reference"), name="reference")


def check_for_model(cfg: Any) -> None:
    """What the run's model family cannot honour, refused before any worker starts: ``optimal`` without its own
    training data (``ablation.reference``, not the evaluation set nor a test split), and per-position fills or
    ``keep_first`` where the family's evaluation does not run whole sequences (``ModelFamily.fills_by_position``:
    fairseq translation's beam search runs decoder attention one position per step, and its sources are
    left-padded)."""
    from headsweep.workers.registry import model_family

    method, section = ablation_settings(cfg)
    if method == "optimal":
        _check_optimal(cfg, section)
    family = model_family(cfg.model.kind)
    _check_per_example(cfg, family)
    if family.fills_by_position:
        return
    for setting, on in (("ablation.positions: per_position", section.positions == "per_position"),
                        ("ablation.keep_first", section.keep_first)):
        if on:
            raise HeadsweepError(
                f"{setting} is not available for {family.name} models: beam search runs decoder attention one "
                "position per step and sources are padded on the left, so a position of the input is not a position "
                "of the sentence; use ablation.positions: all without keep_first")
