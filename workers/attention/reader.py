"""What roles reads of an evaluation adapter, the part each model family implements: an :class:`AttentionReader`.

``ModelFamily.attention_reader(adapter)`` gives it. Its ``read(sink)`` runs the adapter's evaluation batches
through the unmasked model and hands each site's weights ``(batch, heads, query, key)``, with the tokens its
queries and keys run over (:class:`~headsweep.workers.attention.head_roles.SiteAttention`), to ``sink(site_key, maps)``
as the module returns them (so one layer's maps are held at a time), yielding after each batch. The weights are
captured at the attention modules, on the path that computes them (``ModelFamily.attention_weights``). The reader
also counts a corpus's tokens as the model's inputs are tokenised (rare-word statistics), gives the family's own
token counts if it has any (fairseq's dictionaries), and, for syntactic heads, the evaluation text and where each
of the model's pieces lies in it.

A plugin family takes part by giving its adapter an ``attention_maps(sink)`` method that runs its batches, calls
``sink(site_key, SiteAttention)`` for every site and yields after each batch (:class:`AdapterReader`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.head_roles import FrequencyTable, SiteAttention
from headsweep.workers.core.heads import SiteKey

#: Takes each site's maps as its module returns them.
Sink = Callable[[SiteKey, SiteAttention], None]
#: Takes each site's raw per-head weights ``(batch, heads, query, key)``.
Consumer = Callable[[SiteKey, torch.Tensor], None]
#: Where each of a sentence's pieces lies in its compact text (None: a piece that spells no character).
PieceSpans = list[tuple[int, int] | None]


class AttentionReader:
    """What roles reads of one adapter; a family's reader overrides what its models support."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def read(self, sink: Sink) -> Iterator[None]:
        """Run the unmasked model on the evaluation batches, handing every site's maps to ``sink``; yields after
        each batch."""
        raise NotImplementedError

    def dictionaries(self, top: int) -> tuple[dict[str, FrequencyTable], str] | None:
        """The model's own token counts by vocabulary (``roles.frequencies: dictionary``, and the default where
        there are some) with a description, or None when the model has none."""
        return None

    def corpus_counts(self, lines: Sequence[str]) -> tuple[str, np.ndarray]:
        """The vocabulary a corpus is counted in, and each token id's count over ``lines`` tokenised as the model's
        inputs are (without special tokens)."""
        raise HeadsweepError(f"roles.frequencies: cannot tokenise a corpus for {type(self.adapter).__name__}")

    def sentences(self) -> tuple[list[str], list[PieceSpans | None] | None]:
        """The evaluation text, one sentence per example, and its pieces' spans when they come with it (None for a
        sentence that cannot be aligned); None: :meth:`piece_spans` gives them once the parses are checked."""
        raise HeadsweepError(f"{type(self.adapter).__name__}: syntactic heads need the evaluation text")

    def piece_spans(self, texts: Sequence[str]) -> list[PieceSpans]:
        """Each sentence's pieces, as the model reads them, as spans of its compact text."""
        raise HeadsweepError(f"{type(self.adapter).__name__}: syntactic heads need the model's pieces")


class AdapterReader(AttentionReader):
    """A plugin adapter's own ``attention_maps(sink)``; a corpus is counted with its ``tokenizer`` if it has one."""

    def read(self, sink: Sink) -> Iterator[None]:
        return self.adapter.attention_maps(sink)

    def corpus_counts(self, lines: Sequence[str]) -> tuple[str, np.ndarray]:
        tokenizer = getattr(self.adapter, "tokenizer", None)
        if tokenizer is None:
            return super().corpus_counts(lines)
        return "text", tokenizer_counts(tokenizer, lines)


def tokenizer_counts(tokenizer: Any, lines: Sequence[str]) -> np.ndarray:
    """Each token id's count over ``lines`` as a transformers-style tokenizer reads them, without special tokens."""
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    for ids in tokenizer(list(lines), add_special_tokens=False, verbose=False)["input_ids"]:
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    return counts


def special_mask(ids: torch.Tensor, special_ids: set[int]) -> torch.Tensor:
    """Where ``ids`` holds one of ``special_ids`` (BOS, EOS, padding, [CLS]...)."""
    if not special_ids:
        return torch.zeros_like(ids, dtype=torch.bool)
    return torch.isin(ids, torch.tensor(sorted(special_ids), device=ids.device))
