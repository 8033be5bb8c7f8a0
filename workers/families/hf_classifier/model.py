"""Loading a transformers sequence classifier from a local directory, offline (stock or pruned)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_classifier.config import DEFAULT_MAX_LENGTH, ClassifierModel
from headsweep.workers.families.hf_classifier.pruning import PRUNED_HEADS_KEY, load_pruned
from headsweep.workers.families.transformers.architecture import CLASSIFIER, check_architecture, check_loaded_weights
from headsweep.workers.families.transformers.model_files import check_model_files
from headsweep.workers.families.transformers.tokenizer import load_tokenizer
from headsweep.workers.hub_cache import is_hub_id, resolve_snapshot

# What to do about a model folder without a usable tokenizer (the classifier's tokenizer lives in its folder).
TOKENIZER_HINT = "; save the model's tokenizer into that folder (tokenizer.save_pretrained)"

# Model types whose position ids start after the padding index (RoBERTa's scheme): of
# max_position_embeddings, pad_token_id + 1 are never used for tokens.
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod", "ibert",
                    "mpnet", "longformer"}


@dataclass
class LoadedClassifier:
    """A classifier and its tokenizer (what ``ModelFamily.load_model`` gives for export)."""

    model: nn.Module
    tokenizer: object


def resolve_model_dir(path: str) -> Path:
    """The local model directory, or a one-line error that says why it is not usable."""
    if not path:
        raise HeadsweepError("config key 'model.path' is required (a transformers model directory)")
    p = Path(path)
    if is_hub_id(path):  # org/name[@revision]: its snapshot in the local Hugging Face cache, never downloaded
        p = resolve_snapshot(path).folder
    if not p.exists():
        raise HeadsweepError(f"model directory not found: {path}")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise HeadsweepError(f"{path} is not a transformers model directory (no config.json)")
    if not os.access(p / "config.json", os.R_OK):
        raise HeadsweepError(f"model directory {path} is not readable")
    return p


def load_hf_model(cfg: ClassifierModel, device: str):
    """Load model and tokenizer from a local directory, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model_dir = resolve_model_dir(cfg.path)
    if cfg.attn_implementation not in (None, "eager", "sdpa"):
        raise HeadsweepError(f"model.attn_implementation must be eager or sdpa, got {cfg.attn_implementation!r}")
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise HeadsweepError(f"model.dtype {cfg.dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    config = check_model_files(model_dir)
    check_architecture(model_dir, config, CLASSIFIER)
    tokenizer = load_tokenizer(model_dir, TOKENIZER_HINT)
    if config.get(PRUNED_HEADS_KEY):
        # Written by `headsweep export`: stock from_pretrained refuses its smaller attention weights.
        model = load_pruned(model_dir, cfg.attn_implementation, device).to(dtype)
        return model, tokenizer
    extra = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    try:
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, output_loading_info=True, **extra
        )
    # Whatever a damaged or foreign directory makes transformers raise (safetensors raises its own
    # SafetensorError): one line that names the files, with the cause's first line.
    except Exception as exc:  # noqa: BLE001
        raise HeadsweepError(f"cannot load the model from {model_dir} ({_weights(model_dir)}): "
                             f"{_first_line(exc)}") from None
    check_loaded_weights(model_dir, model, loading, CLASSIFIER)
    return model.to(device).eval(), tokenizer


def _weights(model_dir: Path) -> str:
    files = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    return f"weights: {', '.join(files)}" if files else "no weights file"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def max_positions(config) -> int | None:
    """The longest input (in tokens) the model's position embeddings cover, or None if it does not say."""
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    if getattr(config, "model_type", None) in OFFSET_POSITIONS:
        pad = getattr(config, "pad_token_id", None)
        n -= (1 if pad is None else int(pad)) + 1
    return n


def resolve_positions(key: str, requested: int | None, limit: int | None, model_dir: str, default: int,
                      minimum: int = 1) -> int:
    """A setting counted in model positions (``data.max_length``, ``data.window``), checked against the model's
    maximum ``limit``; unset, ``default`` (or the model's maximum if smaller). Above the model's positions is
    refused, not clipped: the run would either fail on the first long example or not do what the config says."""
    if requested is None:
        return min(default, limit) if limit else default
    if requested < minimum:
        raise HeadsweepError(f"{key} must be at least {minimum}, got {requested}")
    if limit is not None and requested > limit:
        raise HeadsweepError(
            f"{key} {requested} is above the model's maximum of {limit} positions "
            f"({model_dir}/config.json, max_position_embeddings): set {key} to {limit} or less"
        )
    return requested


def resolve_max_length(requested: int | None, limit: int | None, model_dir: str) -> int:
    """``data.max_length`` (see :func:`resolve_positions`)."""
    return resolve_positions("data.max_length", requested, limit, model_dir, DEFAULT_MAX_LENGTH)
