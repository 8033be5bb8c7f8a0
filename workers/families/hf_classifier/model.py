"""Loading a transformers sequence classifier from a local directory, offline (stock or pruned).

The folder checks and the loading itself are the transformers layer's
(:mod:`headsweep.workers.families.hf_shared.loading`); what is the classifier's own: its model class, its
tokenizer in the model's folder, and ``data.max_length``.
"""

from __future__ import annotations

from pathlib import Path

from headsweep.workers.families.hf_classifier.config import DEFAULT_MAX_LENGTH, TOKENIZER_HINT, ClassifierModel
from headsweep.workers.families.hf_classifier.pruning import prune_hf_heads
from headsweep.workers.families.hf_shared.architecture import CLASSIFIER
from headsweep.workers.families.hf_shared.loading import (
    LoadedTransformers,
    load_folder,
    resolve_positions,
    weight_files_note,
)
from headsweep.workers.families.hf_shared.tokenizer import load_tokenizer


def load_classifier_model(cfg: ClassifierModel, device: str) -> LoadedTransformers:
    """The classifier (eval mode, on ``device``) and its tokenizer from the folder ``model.path``, offline."""
    return load_folder(cfg, device, CLASSIFIER, "AutoModelForSequenceClassification",
                       tokenizer=lambda model_dir: load_tokenizer(model_dir, TOKENIZER_HINT), prune=prune_hf_heads,
                       cannot_load=_cannot_load)


def _cannot_load(model_dir: Path) -> str:
    return f"cannot load the model from {model_dir} ({weight_files_note(model_dir)})"


def resolve_max_length(requested: int | None, limit: int | None, model_dir: str) -> int:
    """``data.max_length`` (see :func:`~headsweep.workers.families.hf_shared.loading.resolve_positions`)."""
    return resolve_positions("data.max_length", requested, limit, model_dir, DEFAULT_MAX_LENGTH)
