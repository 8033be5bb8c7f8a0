"""Which rows and columns survive when heads are physically removed from an attention module.

Head h of a module with ``H`` query heads of size ``d`` owns rows ``h*d .. h*d+d-1`` of the
query projection and columns ``h*d .. h*d+d-1`` of the output projection. With grouped-query
attention (``H_kv < H`` key/value heads), query head h reads key/value head
``h // (H / H_kv)``, so a key/value head is shared by a group of query heads: it is kept while
*any* query head of its group is kept, and its rows of the key and value projections go only
when the whole group goes. Plain multi-head attention is the case ``H_kv == H``.

This module knows nothing about model families; ``headsweep.workers.families.hf_classifier.pruning`` and
``headsweep.workers.families.fairseq_translation.pruning`` apply these plans to BERT-family and fairseq modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from headsweep.errors import HeadsweepError


@dataclass(frozen=True)
class HeadSlice:
    """The heads one attention module keeps, in their original numbering, ascending."""

    num_heads: int
    head_dim: int
    kept: tuple[int, ...]
    num_kv_heads: int
    kept_kv: tuple[int, ...]

    @property
    def removed(self) -> tuple[int, ...]:
        return tuple(h for h in range(self.num_heads) if h not in self.kept)

    @property
    def query_rows(self) -> torch.Tensor:
        """Rows of the query projection to keep; also the output projection's columns to keep."""
        return _rows(self.kept, self.head_dim)

    @property
    def kv_rows(self) -> torch.Tensor:
        """Rows of the key and value projections to keep."""
        return _rows(self.kept_kv, self.head_dim)

    @property
    def kv_index(self) -> tuple[int, ...]:
        """For each kept query head, the position of its key/value head among the kept ones.

        After pruning a grouped-query module the groups are no longer of equal size, so a
        forward pass must map query heads to key/value heads by this index instead of repeating
        each key/value head ``H / H_kv`` times.
        """
        group = self.num_heads // self.num_kv_heads
        position = {kv: i for i, kv in enumerate(self.kept_kv)}
        return tuple(position[h // group] for h in self.kept)


def plan_slice(num_heads: int, head_dim: int, removed: Iterable[int], num_kv_heads: int | None = None) -> HeadSlice:
    """The slice of a module with ``num_heads`` query heads once the heads in ``removed`` are gone."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise HeadsweepError(f"{num_heads} query heads cannot share {num_kv_heads} key/value heads evenly")
    gone = set(removed)
    outside = sorted(h for h in gone if not 0 <= h < num_heads)
    if outside:
        raise HeadsweepError(f"head {outside[0]} out of range (the module has {num_heads} heads, 0..{num_heads - 1})")
    kept = tuple(h for h in range(num_heads) if h not in gone)
    group = num_heads // num_kv_heads
    kept_kv = tuple(sorted({h // group for h in kept}))
    return HeadSlice(num_heads, head_dim, kept, num_kv_heads, kept_kv)


def _rows(heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    if not heads:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Keep only ``rows`` of a linear layer's output (weight rows and bias entries), in place.

    The module object stays the same (so references to it and its hooks stay valid); its
    parameters are replaced by new, smaller ones.
    """
    rows = rows.to(linear.weight.device)
    linear.weight = _parameter(linear.weight, linear.weight.detach().index_select(0, rows))
    if linear.bias is not None:
        linear.bias = _parameter(linear.bias, linear.bias.detach().index_select(0, rows))
    linear.out_features = int(rows.numel())


def keep_columns(linear: nn.Linear, columns: torch.Tensor) -> None:
    """Keep only ``columns`` of a linear layer's input, in place (the bias is untouched)."""
    columns = columns.to(linear.weight.device)
    linear.weight = _parameter(linear.weight, linear.weight.detach().index_select(1, columns))
    linear.in_features = int(columns.numel())


def _parameter(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.clone().contiguous(), requires_grad=old.requires_grad)
