"""The training loss of a classifier as gradient importance needs it: cross-entropy per batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from headsweep.workers.core.family import LossBatch, LossBatches
from headsweep.workers.core.gates import HeadGates

LOSS_NAME = "cross-entropy"


def cut_batches(batches: Sequence[tuple[torch.Tensor, dict]], rows: Callable[[dict], int] | None = None
                ) -> list[tuple[int, torch.Tensor, dict]]:
    """Batches of ``(example indices, tokenised inputs)`` as ``(group, indices, inputs)`` pieces of at most
    ``rows(inputs)`` rows each (the backward pass's memory budget, :mod:`headsweep.workers.memory.backward_memory`;
    None: whole batches), ``group`` the batch's position."""
    out = []
    for group, (idx, inputs) in enumerate(batches):
        size = max(1, len(idx) if rows is None else rows(inputs))
        for start in range(0, len(idx), size):
            piece = slice(start, start + size)
            out.append((group, idx[piece], {k: v[piece] for k, v in inputs.items()}))
    return out


def classifier_loss_batches(model: nn.Module, gates: HeadGates, pieces: Sequence[tuple[int, torch.Tensor, dict]],
                            labels: torch.Tensor, dtype: torch.dtype, recompute: bool = False) -> LossBatches:
    """``(group, example indices, tokenised inputs)`` pieces (:func:`cut_batches`) as summed cross-entropy against
    ``labels``.

    Every site sees the batch's tokens as its inputs' ``attention_mask`` marks them (all tokens
    without one); the logits are cast to ``dtype`` before the loss. ``recompute``: the loss batches allow
    checkpointing the model's layers.
    """
    return LossBatches([_batch(model, gates, idx, inputs, labels, dtype, group, recompute)
                        for group, idx, inputs in pieces], LOSS_NAME)


def _batch(model: nn.Module, gates: HeadGates, idx: torch.Tensor, inputs: dict, labels: torch.Tensor,
           dtype: torch.dtype, group: int, recompute: bool) -> LossBatch:
    ids = inputs.get("input_ids")
    real = inputs.get("attention_mask")
    if real is None:
        real = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    real = real.bool()
    targets = labels[idx.to(labels.device)]

    def loss() -> torch.Tensor:
        logits = model(**inputs).logits
        return F.cross_entropy(logits.to(dtype), targets.to(logits.device), reduction="sum")

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**inputs).logits
        return logits, torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)

    return LossBatch({site.key: real for site in gates.sites}, int(idx.numel()), loss, outputs, group, recompute)
