"""What ``sweep.ablation`` asks of the rest of the run, checked before anything is written: the data its method
reads (paired data for ``patch``, ``ablation.reference`` for ``optimal``) and what the model family can honour.

Apart from the section itself (``headsweep.sweep.configuration.ablation``) because these checks read the run's
data sections, which are typed by the config.
"""

from __future__ import annotations

from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.ablation import AblationSection
from headsweep.sweep.experiments.data_sections import refuse_eval_data, typed_data
from headsweep.workers.ablation import PATCH_NEEDS_PAIRS, PER_EXAMPLE_METHODS
from headsweep.workers.registry import model_family


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
        advice = "train optimal ablation's constants on training or validation data"
        refuse_eval_data("ablation", section.reference, cfg, advice, advice,
                         resolved=typed_data(cfg, section.reference, "ablation.reference"), name="reference")


def check_for_model(cfg: Any) -> None:
    """What the run's model family cannot honour, refused before any worker starts: ``optimal`` without its own
    training data (``ablation.reference``, not the evaluation set nor a test split), and per-position fills or
    ``keep_first`` where the family's evaluation does not run whole sequences (``ModelFamily.fills_by_position``:
    fairseq translation's beam search runs decoder attention one position per step, and its sources are
    left-padded)."""
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
