"""Whether a transformers model folder is one the family it was given to evaluates correctly.

transformers loads nearly any folder as nearly any head: a causal LM as a sequence classifier (with a
classification head of random weights), BERT as a causal LM (``BertLMHeadModel``, attending both ways,
its "perplexity" no perplexity), a base model as either. It says so only in a log line ("newly
initialized"), and the numbers that follow mean nothing. Two checks refuse such folders with one line
naming the architecture and the family that fits:

* :func:`check_architecture` reads ``config.json`` (``architectures``, ``model_type``,
  ``is_encoder_decoder``) before any weight is loaded;
* :func:`check_loaded_weights` reads what transformers reports after loading: head weights the folder
  lacks, which it would have started from random numbers (a classifier saved without its trained head).

Both transformers families (``hf_classifier``, ``hf_causal_lm``) call them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

CLASSIFIER = "hf_classifier"
CAUSAL_LM = "hf_causal_lm"
SEQ2SEQ = "hf_seq2seq"
CLASSIFIER_SUFFIX = "ForSequenceClassification"
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
SHOWN_KEYS = 3  # missing head weights named in the error line (the count is complete)

# What each family needs of a folder, for the error lines.
TAKES = {
    CLASSIFIER: "sequence classifiers (...ForSequenceClassification) with their trained classification head",
    CAUSAL_LM: "decoder-only causal LMs (...ForCausalLM, GPT-2's GPT2LMHeadModel) with their language-model head",
    SEQ2SEQ: "encoder-decoder models that generate text (...ForConditionalGeneration, MarianMTModel, "
             "FSMTForConditionalGeneration) with their language-model head",
}
HEAD = {CLASSIFIER: "classification head", CAUSAL_LM: "language-model head", SEQ2SEQ: "language-model head"}


def encoder_model_types() -> frozenset[str]:
    """``model_type`` values of bidirectional (masked-LM) encoders, as transformers lists them, without
    encoder-decoder models (refused on their own)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_MASKED_LM_MAPPING_NAMES) - {"bart", "mbart", "mvp"}


def architecture_name(config: Mapping[str, Any]) -> str:
    """The class ``config.json`` names (its first ``architectures`` entry), else its ``model_type``."""
    names = config.get("architectures") or []
    return str(names[0]) if names else f"model_type {config.get('model_type', '?')!r}"


def check_architecture(model_dir: Path, config: Mapping[str, Any], family: str) -> None:
    """Refuse a folder whose ``config.json`` says it is not what ``family`` evaluates, before loading it.

    A folder whose config names no ``architectures`` passes (older saves): :func:`check_loaded_weights`
    still refuses it if the family's head is missing from its weights.
    """
    names = [str(n) for n in config.get("architectures") or []]
    name = architecture_name(config)
    encoder_decoder = bool(config.get("is_encoder_decoder"))
    encoder = config.get("model_type") in encoder_model_types()
    classifier = any(n.endswith(CLASSIFIER_SUFFIX) for n in names)
    causal_lm = (not encoder and not encoder_decoder
                 and any(n.endswith(CAUSAL_LM_SUFFIXES) for n in names))
    if family == CLASSIFIER:
        if not names or classifier:
            return
        if causal_lm:
            raise HeadsweepError(
                f"{model_dir} holds a causal language model ({name}), not a sequence classifier: as "
                f"model.kind {CLASSIFIER} it would get a classification head of random weights; "
                f"set model.kind: {CAUSAL_LM} to evaluate it by perplexity or multiple choice"
            )
        raise HeadsweepError(
            f"{model_dir} holds a {name}, not a sequence classifier: as model.kind {CLASSIFIER} it would get a "
            f"classification head of random weights; model.kind {CLASSIFIER} takes {TAKES[CLASSIFIER]}"
        )
    if family == SEQ2SEQ:
        _check_seq2seq(model_dir, name, encoder_decoder, classifier, causal_lm)
        return
    if encoder_decoder:
        raise HeadsweepError(
            f"{model_dir} holds an encoder-decoder model ({name}): model.kind {CAUSAL_LM} takes {TAKES[CAUSAL_LM]}; "
            f"set model.kind: {SEQ2SEQ} to evaluate it by translation (beam search, BLEU)"
        )
    if encoder:
        fits = (f"set model.kind: {CLASSIFIER} to sweep it as a classifier" if classifier else
                f"model.kind {CLASSIFIER} takes such encoders fine-tuned as sequence classifiers")
        raise HeadsweepError(
            f"{model_dir} holds a bidirectional encoder ({name}, model_type {config.get('model_type')!r}), not a "
            f"decoder-only causal LM: its tokens see the tokens after them, so a perplexity would mean nothing; {fits}"
        )
    if classifier and not causal_lm:
        raise HeadsweepError(
            f"{model_dir} holds a sequence classifier ({name}), not a causal LM: as model.kind {CAUSAL_LM} it "
            f"would get a language-model head of random weights; set model.kind: {CLASSIFIER}"
        )


def _check_seq2seq(model_dir: Path, name: str, encoder_decoder: bool, classifier: bool, causal_lm: bool) -> None:
    """``hf_seq2seq`` takes encoder-decoder models with their generation head, nothing else."""
    if encoder_decoder and not classifier:
        return
    if causal_lm:
        fits = f"set model.kind: {CAUSAL_LM} to evaluate it by perplexity or multiple choice"
    elif classifier:
        fits = f"set model.kind: {CLASSIFIER} to sweep it as a classifier"
    else:
        fits = f"model.kind {SEQ2SEQ} takes {TAKES[SEQ2SEQ]}"
    what = "a sequence classifier" if classifier else "a causal language model" if causal_lm else "a model"
    raise HeadsweepError(f"{model_dir} holds {what} ({name}), not an encoder-decoder model (config.json has no "
                         f"is_encoder_decoder: true), so there is nothing to translate with: {fits}")


def check_loaded_weights(model_dir: Path, model: Any, loading_info: Mapping[str, Iterable[str]], family: str) -> None:
    """Refuse a model that transformers completed with a head of random weights because the folder lacks it.

    ``loading_info`` is what ``from_pretrained(..., output_loading_info=True)`` returns; its
    ``missing_keys`` are the parameters the folder's weights do not hold. Those outside the base model
    (``model.base_model_prefix``) are the family's head; other missing weights are a config that does not
    match its weights (:func:`.weights_fit.check_weights_fit`).
    """
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    head = sorted(k for k in loading_info.get("missing_keys") or [] if not k.startswith(prefix))
    if not head:
        return
    shown = ", ".join(head[:SHOWN_KEYS])
    more = f" and {len(head) - SHOWN_KEYS} more" if len(head) > SHOWN_KEYS else ""
    raise HeadsweepError(
        f"{model_dir} has no trained {HEAD[family]}: its weights lack {shown}{more} of {type(model).__name__}, "
        f"which transformers would start from random numbers; model.kind {family} takes {TAKES[family]}"
    )


def exported_architecture(folder: str | Path) -> str | None:
    """The class a transformers folder's ``config.json`` names (``""`` when it names none), or None when the folder
    has no readable ``config.json`` (it is not a transformers folder)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = config.get("architectures") if isinstance(config, dict) else None
    return str(names[0]) if names else ""


def is_seq2seq_architecture(name: str) -> bool:
    """Whether an architecture class name is a transformers encoder-decoder generator's
    (``...ForConditionalGeneration``, ``MarianMTModel``)."""
    return name.endswith(("ForConditionalGeneration", "MTModel"))


def is_causal_lm_architecture(name: str) -> bool:
    """Whether an architecture class name is a causal LM's (``...ForCausalLM``, GPT-2's ``GPT2LMHeadModel``)."""
    return name.endswith(CAUSAL_LM_SUFFIXES)
