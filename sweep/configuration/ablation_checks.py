"""What ``sweep.ablation`` asks of the rest of the run, checked before anything is written: the data its method
reads (paired data for ``patch``, ``ablation.reference`` for ``optimal``) and what the model family can honour.

Apart from the section itself (``headsweep.sweep.configuration.ablation``) because these checks read the run's
data sections, which are typed by the config.
"""

from __future__ import annotations

from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.ablation import AblationSection
from headsweep.sweep.experiments import experiments_of
from headsweep.sweep.experiments.data_sections import refuse_eval_data, typed_data
from headsweep.workers.ablation.spec import (
    PATCH_NEEDS_PAIRS,
    PER_EXAMPLE_METHODS,
    patch_unavailable,
    resample_unavailable,
)
from headsweep.workers.core.heads import Head
from headsweep.workers.core.registry import model_family


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
    """resample and patch (per-example fills, ``headsweep.workers.ablation.donors``): patch needs paired data (a family
    with no paired data format, fairseq translation, refuses it in its own line); resample draws donors over the whole
    evaluation set, which screening's subsets do not hold, and where the family fills only some attention types
    (``ModelFamily.resample_attention``: fairseq translation's ``enc_self``, since a donor's decoder states follow
    its own hypotheses) every head the run gates must be of those types (:func:`_check_resample_scope`)."""
    method = cfg.sweep.ablation
    if method not in PER_EXAMPLE_METHODS:
        return
    if method == "patch" and not hasattr(family.data_config, "paired"):
        raise HeadsweepError(patch_unavailable(family.name))
    if method == "patch" and not getattr(cfg.data, "paired", False):
        raise HeadsweepError(PATCH_NEEDS_PAIRS)
    if method == "resample" and cfg.sweep.screen is not None:
        raise HeadsweepError("sweep.screen evaluates a subset of the examples first, and sweep.ablation resample draws "
                             "each example's donor from the whole evaluation set: remove sweep.screen, or use "
                             "sweep.ablation mean")
    if method == "resample" and family.resample_attention is not None:
        _check_resample_scope(cfg, family.name, tuple(family.resample_attention))


def _check_resample_scope(cfg: Any, family: str, allowed: tuple[str, ...]) -> None:
    """Under resample, every head any kind of the run would gate (or score against its donor) is of the ``allowed``
    attention types, refused in one line before anything runs otherwise: ``sweep.attention`` (the single-head,
    all-but-one and pairs grids: required, since unset means every type), ``sweep.masks`` (custom), ``pairs.heads``,
    ``prune.attention`` and ``l0.attention`` (unset: every type), and gradient importance, which scores every head
    of the model by attribution patching against its donor (decoder heads have none). A kind gating heads some
    other way is stopped by the adapter's own check when its first mask arrives."""
    def refuse(what: str, fix: str) -> None:
        raise HeadsweepError(resample_unavailable(family, allowed, what, fix))

    scope = f"[{', '.join(allowed)}]"

    def within(key: str, types: list[str] | None) -> None:
        # unset means every attention type the model has, decoder attention included
        if not types:
            refuse(f"{key} is unset (every attention type)", f"set {key}: {scope}")
        bad = [a for a in types if a not in allowed]
        if bad:
            refuse(f"{key} takes in {', '.join(bad)} heads", f"set {key}: {scope}")

    kinds = {kind.name for kind in experiments_of(cfg)}
    within("sweep.attention", cfg.sweep.attention)
    for key, names in (("sweep.masks", [n for mask in cfg.sweep.masks for n in mask] if "custom" in kinds else []),
                       ("pairs.heads", (cfg.pairs.heads or []) if "pairs" in kinds and cfg.pairs.select == "list"
                        else [])):
        named = next((n for n in names if Head.parse(n).attention not in allowed), None)
        if named is not None:
            refuse(f"{key} names {named}", f"name only {', '.join(allowed)} heads in {key}")
    if "prune_level" in kinds:
        within("prune.attention", cfg.prune.attention)
    if "l0" in kinds:
        within("l0.attention", cfg.l0.attention)
    if "importance" in kinds and cfg.importance.method == "gradient":
        refuse("gradient importance scores every head of the model against its donor's activations",
               "use importance.method lrp, or ablation with importance.from_run")


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
    training data (``ablation.reference``, not the evaluation set nor a test split), resample and patch where the
    family cannot fill the heads the run gates (:func:`_check_per_example`), and per-position fills or
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
