"""The mask-grid loop: every mask over every batch of an adapter's evaluation set, the one loop every family's
evaluation runs.

Per batch (:class:`GridBatch`, in the adapter's order):

1. the family's per-batch start (``start(batch)``): whatever its forward passes over this batch share, such as
   prefix reuse's baseline states, recorded before any fill is installed; it returns the batch's forward pass;
2. the batch's per-example fill, installed once for all its masks (resample's donors, patching's other input:
   :meth:`~headsweep.workers.ablation.donors.Donors.batch`), skipped when no mask gates a head;
3. the masks cut into chunks of as many as one forward pass holds (``masks_per_forward(batch)``, the memory
   budget), within groups that must not share a pass (prefix reuse: one first gated layer per pass);
4. each chunk through the forward pass, which gives one value per row of the batch repeated once per mask of the
   chunk (mask-major: the layout of :meth:`~headsweep.workers.core.gates.HeadGates.packed`), scattered into the
   output at (mask, example).

The family supplies only its forward pass (what one packed pass computes per row: summed NLL, logits, a beam
search's hypotheses) and turns the filled output into its statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from headsweep.workers.core.heads import Head

T = TypeVar("T")
Out = TypeVar("Out", np.ndarray, torch.Tensor)

#: One packed forward pass over a batch: the masks of a chunk -> one value per row, mask-major (a tensor or an
#: array with the rows on its first axis, or a list of per-row objects).
Pass = Callable[[list[Sequence[Head]]], Any]


@dataclass(frozen=True)
class GridBatch(Generic[T]):
    """One batch of an adapter's evaluation set."""

    key: int  # its position in the adapter's batches (what reuse caches key on)
    inputs: T  # what the family's forward pass reads
    examples: torch.Tensor  # the positions of its rows in the evaluation set, in row order (CPU, int64)

    @property
    def rows(self) -> int:
        return int(self.examples.numel())


def grid_batches(inputs: Sequence[T], examples: Callable[[T], torch.Tensor]) -> list[GridBatch[T]]:
    """An adapter's batches ``inputs`` as :class:`GridBatch` es; ``examples(b)``: batch ``b``'s example positions."""
    return [GridBatch(key, b, examples(b).cpu()) for key, b in enumerate(inputs)]


class PerExampleFill(Protocol):
    """What the loop asks of a per-example fill (:class:`~headsweep.workers.ablation.donors.Donors`)."""

    def batch(self, rows: torch.Tensor, run_donors: Callable[[np.ndarray], Any], needed: bool = True
              ) -> AbstractContextManager[Any]:
        """The fill of examples ``rows`` installed inside; ``run_donors`` runs their donor pass."""
        ...


def mask_grid(masks: Sequence[Sequence[Head]], batches: Sequence[GridBatch[T]],
              start: Callable[[GridBatch[T]], Pass], out: Out, *,
              masks_per_forward: Callable[[GridBatch[T]], int],
              donors: PerExampleFill | None = None, run_donors: Callable[[np.ndarray], Any] | None = None,
              groups: Sequence[Sequence[int]] | None = None) -> Out:
    """Fill ``out`` (shape ``(len(masks), n_examples, ...)``: a NumPy array, an object array for per-row objects,
    or a tensor on any device) with every mask's value for every example (module docstring).

    ``start(batch)``: the batch's forward pass (called once per batch, before its fill is installed);
    ``masks_per_forward(batch)``: how many masks one pass over the batch holds; ``donors``: the adapter's
    per-example fill (:class:`~headsweep.workers.ablation.donors.Donors`, None: the family has none) and
    ``run_donors(donors)`` its donor pass; ``groups``: mask positions that may share a pass (default: all).
    """
    groups = [range(len(masks))] if groups is None else groups
    gates_any = any(len(m) for m in masks)  # a grid of empty masks needs no donors
    for batch in batches:
        forward = start(batch)
        per = max(1, masks_per_forward(batch))
        fill = (nullcontext() if donors is None or run_donors is None
                else donors.batch(batch.examples, run_donors, needed=gates_any))
        with fill:
            for members in groups:
                for first in range(0, len(members), per):
                    chunk = list(members[first : first + per])
                    scatter(out, chunk, batch.examples, forward([masks[i] for i in chunk]))
    return out


def scatter(out: np.ndarray | torch.Tensor, chunk: Sequence[int], examples: torch.Tensor, values: Any) -> None:
    """``values`` (one per row of the batch repeated ``len(chunk)`` times, mask-major) into ``out`` at masks
    ``chunk`` and examples ``examples``."""
    k, rows = len(chunk), int(examples.numel())
    if isinstance(out, torch.Tensor):
        which = torch.tensor(chunk, device=out.device)
        cols = examples.to(out.device)
        out[which.unsqueeze(1), cols.unsqueeze(0)] = values.view(k, rows, *values.shape[1:])
        return
    index = np.ix_(list(chunk), examples.numpy())
    if isinstance(values, torch.Tensor):
        out[index] = values.view(k, rows, *values.shape[1:]).cpu().numpy()
    elif isinstance(values, np.ndarray):
        out[index] = values.reshape(k, rows, *values.shape[1:])
    else:  # per-row objects: placed one by one (NumPy would unpack a tuple-like object into an axis)
        for n, value in enumerate(values):
            out[chunk[n // rows], int(examples[n % rows])] = value
