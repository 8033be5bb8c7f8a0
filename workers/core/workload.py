"""The batch an adapter's ``workload`` runs (``EvalAdapter.workload``, what the efficiency experiment times): the
examples around the median length of its length-sorted batches, rows cycled up to the batch size asked for."""

from __future__ import annotations

from collections.abc import Callable

import torch


def take_rows(batch, n: int, rows: int):
    """The first ``rows`` rows of a (nested) batch of ``n`` rows, repeating rows when ``rows > n``."""
    if isinstance(batch, dict):
        return {k: take_rows(v, n, rows) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor) and batch.dim() > 0 and batch.shape[0] == n:
        index = torch.arange(rows, device=batch.device) % n
        return batch.index_select(0, index)
    return batch


def median_batch(batches: list, size: Callable[[object], int]):
    """The batch holding the median example of a length-sorted list of batches."""
    total = sum(size(b) for b in batches)
    seen = 0
    for batch in batches:
        seen += size(batch)
        if seen > total // 2:
            return batch
    return batches[-1]
