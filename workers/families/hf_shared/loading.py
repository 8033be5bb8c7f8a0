"""Loading a transformers model folder offline, the same way for both transformers families.

The folder is a local ``save_pretrained`` directory or a hub id's snapshot in the local Hugging Face cache
(never downloaded). Before transformers reads it, its files are checked (:mod:`.model_files`), its
``config.json`` must name what the family evaluates (:mod:`.architecture`) and the load options must make sense;
after loading, a head transformers would have started from random numbers is refused, and so is a ``config.json``
that does not describe the weights (:mod:`.weights_fit`: tensors dropped, missing or of another shape). A folder
written by ``headsweep export`` (``config.pruned_heads``) is rebuilt by :func:`.pruning.load_pruned` with the
family's own pruning. The families differ only in the model class, the tokenizer's folder and the wording of a
failed load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_shared.architecture import check_architecture, check_loaded_weights
from headsweep.workers.families.hf_shared.model_files import (
    check_model_files,
    dtype_bytes,
    pickled_weights,
    resolve_model_dir,
    weight_files,
)
from headsweep.workers.families.hf_shared.pruning import PRUNED_HEADS_KEY, Pruner, load_pruned
from headsweep.workers.families.hf_shared.weights_fit import check_weights_fit
from headsweep.workers.memory.model_sharing import offered_models

# Model types whose position ids start after the padding index (RoBERTa's scheme): of
# max_position_embeddings, pad_token_id + 1 are never used for tokens.
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod", "ibert",
                    "mpnet", "longformer"}
ATTENTION_IMPLEMENTATIONS = (None, "eager", "sdpa")
# How torch's UnpicklingError begins when weights_only=True meets pickled objects (torch 2.6 to 2.13).
WEIGHTS_ONLY_REFUSED = "Weights only load failed"


@dataclass
class LoadedTransformers:
    """A transformers model and its tokenizer (what ``ModelFamily.load_model`` gives, for export)."""

    model: nn.Module
    tokenizer: object


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def model_dtype(cfg: Any, device: str = "cpu") -> torch.dtype:
    """``model.dtype`` as a torch floating-point dtype the ``device`` computes in, after checking
    ``model.attn_implementation``.

    bfloat16 on a CUDA GPU needs its arithmetic in hardware (compute capability 8.0, Ampere, or later): older GPUs
    only emulate it, in some kernels and not others. On CPUs every dtype of ``DTYPE_BYTES`` runs (torch 2.13:
    float16 and bfloat16 included).
    """
    if cfg.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise HeadsweepError(f"model.attn_implementation must be eager or sdpa, got {cfg.attn_implementation!r}")
    dtype_bytes(cfg.dtype)
    dtype = getattr(torch, cfg.dtype)
    if dtype == torch.bfloat16 and device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise HeadsweepError(
                f"model.dtype bfloat16 needs a GPU with bfloat16 arithmetic (compute capability 8.0 or later: A100, "
                f"H100, RTX 30xx and newer); {torch.cuda.get_device_name(device)} has {major}.{minor}: use "
                "model.dtype: float16 (or float32)"
            )
    return dtype


def weight_files_note(model_dir: Path) -> str:
    """The folder's weight files, for an error line (``weights: model.safetensors`` or ``no weights file``)."""
    files = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    return f"weights: {', '.join(files)}" if files else "no weights file"


def load_folder(cfg: Any, device: str, family: str, auto_class: str, tokenizer: Callable[[Path], object],
                prune: Pruner, cannot_load: Callable[[Path], str]) -> LoadedTransformers:
    """The model of ``cfg`` (``model.path``, ``attn_implementation``, ``dtype``) in eval mode on ``device``, with
    its tokenizer.

    ``family`` is the model.kind the folder is checked against, ``auto_class`` the transformers class that loads
    it (``AutoModelForSequenceClassification``...), ``tokenizer(model_dir)`` loads the tokenizer, ``prune``
    removes heads when the folder was exported pruned, and ``cannot_load(model_dir)`` begins the error line when
    transformers fails (its cause follows).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = resolve_model_dir(cfg.path)
    dtype = model_dtype(cfg, device)
    config = check_model_files(model_dir)
    check_architecture(model_dir, config, family)
    loaded_tokenizer = tokenizer(model_dir)
    if config.get(PRUNED_HEADS_KEY):
        # Written by `headsweep export`: stock from_pretrained refuses its smaller attention weights.
        model = load_pruned(model_dir, prune, cfg.attn_implementation, device, dtype)
        return LoadedTransformers(model, loaded_tokenizer)
    for model in offered_models():  # the worker already holds this model (workers.memory.model_sharing)
        if same_model(model, model_dir, dtype, device, cfg.attn_implementation):
            return LoadedTransformers(model, loaded_tokenizer)
    extra = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    try:
        # Tensors of another shape are reported, not raised: check_weights_fit names them on the console.
        model, loading = getattr(transformers, auto_class).from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True,
            **extra
        )
    # Whatever a damaged, foreign or unsupported folder makes transformers raise (safetensors raises its own
    # SafetensorError): one line, with the cause's first line.
    except Exception as exc:  # noqa: BLE001
        if WEIGHTS_ONLY_REFUSED in str(exc):  # torch's advice, weights_only=False, is not an option here
            binary = next((f for f in weight_files(model_dir) if f.suffix == ".bin"), model_dir / "pytorch_model.bin")
            raise HeadsweepError(pickled_weights(binary)) from None
        raise HeadsweepError(f"{cannot_load(model_dir)}: {first_line(exc)}") from None
    check_loaded_weights(model_dir, model, loading, family)
    check_weights_fit(model_dir, config, model, loading)
    return LoadedTransformers(model.to(device).eval(), loaded_tokenizer)


def same_model(model: nn.Module, model_dir: Path, dtype: Any, device: str, attn_implementation: str | None) -> bool:
    """Whether ``model`` is what :func:`load_folder` would load from ``model_dir``: the folder it came from, its dtype,
    device and (where the config names one) attention implementation."""
    config = getattr(model, "config", None)
    if config is None or str(getattr(config, "_name_or_path", "")) != str(model_dir):
        return False
    param = next(model.parameters(), None)
    want = torch.device(device)
    if param is None or param.dtype != dtype or param.device.type != want.type or (
            want.index is not None and param.device.index != want.index):
        return False
    return attn_implementation is None or getattr(config, "_attn_implementation", None) == attn_implementation


def max_positions(config: Any) -> int | None:
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
