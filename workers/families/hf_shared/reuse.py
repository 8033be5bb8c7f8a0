"""What prefix reuse does alike in both transformers families: a masked pass starts at its first gated layer.

The layers below that layer are skipped (the one just below returns its cached output, repeated once per mask)
and the input embeddings return zeros of their recorded shape and dtype: the model still builds its masks,
positions and rotary tables from them, but their values go nowhere. Each family's reuse module
(``hf_classifier.reuse``, ``hf_causal_lm.reuse.prefix``) says where its layers, attention cores and embeddings are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from headsweep.workers.memory.replay import ReuseUnsupported, pass_through, returning

logger = logging.getLogger(__name__)

OFF_NOTE = "off (sweep.reuse: false): every mask runs the whole model"
T = TypeVar("T")


class PrefixReuseSwitch:
    """An adapter's prefix reuse, and its fallback: the plain path runs, with a warning that says why, when the
    model's layout does not fit (found when the strategy is built, or later, on the model itself).

    The adapter holds ``model_name``; ``reuse_note`` says which path runs (``describe().facts["reuse"]``).
    """

    model_name: str
    reuse_note: str = OFF_NOTE
    _reuse: Any = None

    def start_reuse(self, enabled: bool, build: Callable[[], Any], note: str) -> None:
        """``build()`` the strategy unless ``sweep.reuse`` is off; ``note`` describes it when it is built."""
        self._reuse, self.reuse_note = None, OFF_NOTE
        if not enabled:
            return
        try:
            self._reuse = build()
        except ReuseUnsupported as exc:
            self._no_reuse(str(exc))
        else:
            self.reuse_note = note

    def _no_reuse(self, reason: str) -> None:
        self._reuse = None
        self.reuse_note = f"plain path: prefix reuse does not support this model ({reason})"
        logger.warning("%s: %s", self.model_name, self.reuse_note)

    def reused_or_plain(self, reused: Callable[[], T], plain: Callable[[], T]) -> T:
        """``reused()`` while reuse runs, else (or once it turns out not to fit the model) ``plain()``."""
        if self._reuse is not None:
            try:
                return reused()
            except ReuseUnsupported as exc:
                self._no_reuse(str(exc))
        return plain()


def repeat_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` stacked ``k`` times along its first axis (one copy per mask)."""
    return t if k == 1 else t.repeat(k, *([1] * (t.dim() - 1)))


def start_at_layer(layers: Sequence[nn.Module], layer: int, hidden: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
                   copies: int, embeddings: nn.Module | None = None,
                   embedding_shape: tuple[int, ...] | None = None,
                   embedding_dtype: torch.dtype | None = None) -> dict[nn.Module, Callable]:
    """Forward replacements that start a pass over ``copies`` copies of a batch at layer ``layer``: layers below
    ``layer - 1`` pass their input through, layer ``layer - 1`` returns its cached output ``hidden[layer - 1]``,
    and ``embeddings`` (when its baseline output's shape was recorded) returns zeros of that shape, in
    ``embedding_dtype`` (default: the layers' dtype). Nothing is replaced for layer 0."""
    if layer == 0:
        return {}
    before = hidden[layer - 1]
    replacements: dict[nn.Module, Callable] = {layers[j]: pass_through for j in range(layer - 1)}
    replacements[layers[layer - 1]] = returning(repeat_rows(before, copies))
    if embeddings is not None and embedding_shape is not None:
        shape = (embedding_shape[0] * copies, *embedding_shape[1:])
        replacements[embeddings] = returning(before.new_zeros(shape, dtype=embedding_dtype or before.dtype))
    return replacements
