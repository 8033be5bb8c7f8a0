"""Loading a transformers sequence classifier from a local directory, offline (stock or pruned)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_classifier.config import ClassifierModel
from headsweep.workers.families.hf_classifier.pruning import PRUNED_HEADS_KEY, load_pruned


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
    if not p.exists():
        looks_like_hub_id = not path.startswith((".", "/", "~")) and path.count("/") <= 1
        if looks_like_hub_id:
            raise HeadsweepError(
                f"model {path!r} is not a local directory, and headsweep never downloads models: "
                f"fetch it first (e.g. `hf download {path} --local-dir models/{path.split('/')[-1]}`) "
                "and set model.path to that folder"
            )
        raise HeadsweepError(f"model directory not found: {path}")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise HeadsweepError(f"{path} is not a transformers model directory (no config.json)")
    if not os.access(p / "config.json", os.R_OK):
        raise HeadsweepError(f"model directory {path} is not readable")
    return p


def load_hf_model(cfg: ClassifierModel, device: str):
    """Load model and tokenizer from a local directory, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model_dir = resolve_model_dir(cfg.path)
    if cfg.attn_implementation not in (None, "eager", "sdpa"):
        raise HeadsweepError(f"model.attn_implementation must be eager or sdpa, got {cfg.attn_implementation!r}")
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise HeadsweepError(f"model.dtype {cfg.dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    if json.loads((model_dir / "config.json").read_text()).get(PRUNED_HEADS_KEY):
        # Written by `headsweep export`: stock from_pretrained refuses its smaller attention weights.
        model = load_pruned(model_dir, cfg.attn_implementation, device).to(dtype)
        return model, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    try:
        extra = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, **extra
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HeadsweepError(f"cannot load model from {model_dir}: {str(exc).splitlines()[0]}") from None
    return model.to(device).eval(), tokenizer
