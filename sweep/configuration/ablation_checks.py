"""What ``sweep.ablation`` asks of the rest of the run, checked before anything is written: the data its method
reads (paired data for a method that ``needs_pairs``, ``ablation.reference`` for one that trains on it) and what
the model family can honour. Every check asks the method what it declares
(:class:`~headsweep.workers.ablation.method.AblationMethod`) and the run's kinds which heads they gate
(``Experiment.gated_attention``): no method or kind is named here.

Apart from the section itself (``headsweep.sweep.configuration.ablation``) because these checks read the run's
data sections, which are typed by the config.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.ablation import method_settings
from headsweep.sweep.configuration.data_sections import refuse_eval_data, typed_data
from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.ablation.registry import ablation_method
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import model_family


def check_paired(method: str, sections: list[tuple[str, Any]], unfilled: Collection[str] = ()) -> None:
    """Under a method that ``needs_pairs`` (patch), every data set evaluated or differentiated under the fill is
    paired: the evaluation data, importance's and L0's (``sections``: the run's typed data sections by config key;
    ``unfilled``: config sections whose data no fill changes, such as roles', which reads attention)."""
    declared = ablation_method(method)
    if not declared.needs_pairs:
        return
    for key, section in sections:
        if key.split(".")[0] not in unfilled and not getattr(section, "paired", False):
            raise HeadsweepError(declared.unpaired_refusal() if key == "data" else
                                 f"{key} is not paired data, and sweep.ablation {method} fills every head from the "
                                 f"other input of its pair: give {key} paired data (data.task: paired) too")


def _check_per_example(cfg: Any, family: Any, method: AblationMethod) -> None:
    """Per-example fills (``headsweep.workers.ablation.donors``): a method that needs pairs needs paired data (a
    family with no paired data format, fairseq translation, refuses it in its own line); one that draws donors over
    the whole evaluation set refuses screening, whose subsets do not hold them; and where the family fills only some
    attention types (``ModelFamily.resample_attention``: fairseq translation's ``enc_self``, since a donor's decoder
    states follow its own hypotheses) every head the run gates must be of those types (:func:`_check_scope`)."""
    if method.fill != "per_example":
        return
    if method.needs_pairs and not hasattr(family.data_config, "paired"):
        raise HeadsweepError(method.family_refusal(family.name, family.resample_attention != ()))
    if method.needs_pairs and not getattr(cfg.data, "paired", False):
        raise HeadsweepError(method.unpaired_refusal())
    if method.needs_whole_set and cfg.sweep.screen is not None:
        raise HeadsweepError(f"sweep.screen evaluates a subset of the examples first, and sweep.ablation {method.name} "
                             "draws each example's donor from the whole evaluation set: remove sweep.screen, or use "
                             "sweep.ablation mean")
    if family.resample_attention is not None:
        _check_scope(cfg, method, family.name, tuple(family.resample_attention))


def _check_scope(cfg: Any, method: AblationMethod, family: str, allowed: tuple[str, ...]) -> None:
    """Every head any kind of the run would gate (or score against its donor) is of the ``allowed`` attention
    types, refused in one line before anything runs otherwise: ``sweep.attention`` (the grids that read it: required,
    since unset means every type), then what each kind declares it gates beyond it (``Experiment.gated_attention``:
    attention types by a key, heads named one by one, or every head of the model). A kind gating heads some other way
    is stopped by the adapter's own check when its first mask arrives."""
    def refuse(what: str, fix: str) -> None:
        raise HeadsweepError(method.attention_refusal(family, allowed, what, fix))

    scope = f"[{', '.join(allowed)}]"

    def within(key: str, types: list[str] | tuple[str, ...] | None) -> None:
        # unset means every attention type the model has, decoder attention included
        if not types:
            refuse(f"{key} is unset (every attention type)", f"set {key}: {scope}")
        bad = [a for a in types or () if a not in allowed]
        if bad:
            refuse(f"{key} takes in {', '.join(bad)} heads", f"set {key}: {scope}")

    from headsweep.sweep.experiments import experiments_of  # the kinds build on configuration/: asked when checked

    within("sweep.attention", cfg.sweep.attention)
    for kind in experiments_of(cfg):
        for gated in kind.gated_attention(cfg):
            if gated.every_head is not None:
                refuse(*gated.every_head)
            elif gated.named is not None:
                named = next((n for n in gated.named if Head.parse(n).attention not in allowed), None)
                if named is not None:
                    refuse(f"{gated.key} names {named}", f"name only {', '.join(allowed)} heads in {gated.key}")
            else:
                within(gated.key, gated.attention)


def _check_training_reference(cfg: Any, settings: Any, method: str) -> None:
    """A method that trains its constants on ``ablation.reference`` (optimal; its settings declare ``reference`` and
    ``allow_eval_data``, ``REFERENCE_SETTINGS``): required, and not the evaluation set (its deltas would be fitted to
    the data they are measured on) unless ``ablation.allow_eval_data``."""
    if settings.reference is None:
        raise HeadsweepError(f"sweep.ablation {method} trains each head's constant on ablation.reference: set it to "
                             "training or validation data (a data section like data, kept apart from the evaluation "
                             "set)")
    if not settings.allow_eval_data:
        advice = f"train {method} ablation's constants on training or validation data"
        refuse_eval_data("ablation", settings.reference, cfg, advice, advice,
                         resolved=typed_data(cfg, settings.reference, "ablation.reference"), name="reference")


def check_for_model(cfg: Any) -> None:
    """What the run's model family cannot honour, refused before any worker starts: a method that trains on
    ``ablation.reference`` without its own training data (not the evaluation set nor a test split), per-example
    methods where the family cannot fill the heads the run gates (:func:`_check_per_example`), and per-position
    fills or ``keep_first`` where the family's evaluation does not run whole sequences
    (``ModelFamily.fills_by_position``: fairseq translation's beam search runs decoder attention one position per
    step, and its sources are left-padded)."""
    method, settings = method_settings(cfg)
    if method.reference == "training":
        _check_training_reference(cfg, settings, method.name)
    family = model_family(cfg.model.kind)
    _check_per_example(cfg, family, method)
    if family.fills_by_position:
        return
    for setting in (method.per_position(settings), "ablation.keep_first" if cfg.ablation.keep_first else None):
        if setting is not None:
            raise HeadsweepError(
                f"{setting} is not available for {family.name} models: beam search runs decoder attention one "
                "position per step and sources are padded on the left, so a position of the input is not a position "
                "of the sentence; use ablation.positions: all without keep_first")
