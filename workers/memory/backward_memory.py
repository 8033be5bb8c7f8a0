"""What a backward pass through the gates keeps, bounded: gradient importance at real sizes.

Gradient importance differentiates a loss batch's training loss at the gates. By default autograd keeps, until the
backward pass, every layer's activations of the whole batch and, for a language model, the logits over the
vocabulary: it grows with layers x rows x positions x width. Two things hold it to the activation budget of a
forward pass (``batch_budget.CPU_ACTIVATION_BYTES``, 1 GiB on a CPU):

* **layer checkpointing** (:func:`checkpointed`): while the loss runs, each transformer block keeps only its input;
  the backward pass recomputes one block's activations at a time (``torch.utils.checkpoint``, non-reentrant, so
  the gates, leaves set before the loss, get their gradients through the recomputed block, and the gate hooks run
  again with the same gates). It costs one more forward pass of the blocks.
* **loss batches sized to the budget** (:func:`backward_rows`): an adapter cuts each evaluation batch into pieces of
  as many rows as fit, each piece a ``LossBatch`` of the same ``group``, so batch-level importance (the absolute
  value of a whole batch's summed gradient) does not depend on the budget, and per-token importance is a sum over
  tokens that never depended on batching.

Measured on Qwen2.5-0.5B's shape (24 layers, vocabulary 151,936, float32 weights 1.84 GiB; importance over 8
windows of 256 tokens in batches of 4, two threads): the process peaked at 6,602 MiB with whole batches and no
checkpointing, and at 3,018 MiB with both (pieces of one window), in 39.1 s against 43.5 s, every score
bit-identical.

An adapter marks loss batches safe to recompute (``LossBatch.recompute``). A batch under a per-example fill
(resample ablation, activation patching) is not: the donors' fill is set while the loss runs and gone when the
backward pass would recompute, so such batches keep every layer and their rows are sized for that.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from headsweep.workers.core.family import LossBatch
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.memory.batch_budget import activation_budget


def blocks_of(model: nn.Module, sites: Sequence[AttentionSite]) -> list[nn.Module]:
    """The repeated blocks (elements of an ``nn.ModuleList``) that hold the attention ``sites``, in model order;
    a site outside any such list (a model with one attention module) gives none, and so does a site of a module run
    at several depths (ALBERT): recomputing its block in the backward pass would run the module again after the
    forward, where its call counter no longer names the application, so its gates would not act there."""
    names = dict(model.named_modules())
    blocks: dict[str, nn.Module] = {}
    for site in sites:
        if site.shared is not None:
            continue
        parts = site.module_name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:end - 1]) if end > 1 else ""
            if parts[end - 1].isdigit() and isinstance(names.get(parent), nn.ModuleList):
                name = ".".join(parts[:end])
                blocks.setdefault(name, names[name])
                break
    return list(blocks.values())


@contextlib.contextmanager
def checkpointed(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """While active, each of ``blocks`` keeps only its inputs for the backward pass and recomputes the rest there
    (hooks on its submodules, the gates' included, run again then). Restores each block's own ``forward``."""
    wrapped = []
    try:
        for block in blocks:
            if "forward" in vars(block):  # already wrapped (a nested call): leave it as it is
                continue
            block.forward = functools.partial(_recomputed, block.forward)
            wrapped.append(block)
        yield
    finally:
        for block in wrapped:
            del block.forward


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def backward_rows(bytes_per_row: int, device: torch.device, budget: int | None = None) -> int:
    """Rows of a loss batch whose backward pass keeps ``bytes_per_row`` each that fit ``budget`` bytes (None: the
    device's activation budget, ``batch_budget.activation_budget``); at least 1."""
    limit = activation_budget(device) if budget is None else budget
    return max(1, int(limit) // max(1, int(bytes_per_row)))


def pieces(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``rows`` (a batch's example indices) cut into consecutive pieces of at most ``size``."""
    return list(rows.split(max(1, size)))


def by_group(batches: Sequence[LossBatch]) -> list[list[LossBatch]]:
    """Loss batches gathered back into the evaluation batches they were cut from (consecutive pieces of one
    ``group``; a batch without a group is its own): what a training step takes as one batch."""
    groups: list[list[LossBatch]] = []
    for batch in batches:
        if groups and batch.group is not None and groups[-1][-1].group == batch.group:
            groups[-1].append(batch)
        else:
            groups.append([batch])
    return groups
