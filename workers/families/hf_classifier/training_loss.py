"""The training loss of a classifier as gradient importance needs it: cross-entropy per batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from headsweep.workers.family import LossBatch, LossBatches
from headsweep.workers.gates import HeadGates

LOSS_NAME = "cross-entropy"


def classifier_loss_batches(model: nn.Module, gates: HeadGates, batches: Sequence[tuple[torch.Tensor, dict]],
                            labels: torch.Tensor, dtype: torch.dtype) -> LossBatches:
    """Batches of ``(example indices, tokenised inputs)`` as summed cross-entropy against ``labels``.

    Every site sees the batch's tokens as its inputs' ``attention_mask`` marks them (all tokens
    without one); the logits are cast to ``dtype`` before the loss.
    """
    return LossBatches([_batch(model, gates, idx, inputs, labels, dtype) for idx, inputs in batches], LOSS_NAME)


def _batch(model: nn.Module, gates: HeadGates, idx: torch.Tensor, inputs: dict, labels: torch.Tensor,
           dtype: torch.dtype) -> LossBatch:
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

    return LossBatch({site.key: real for site in gates.sites}, int(idx.numel()), loss, outputs)
