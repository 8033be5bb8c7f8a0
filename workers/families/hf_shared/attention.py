"""Reading a transformers model's attention weights, for roles and relevance propagation (both transformers
families).

The model is switched to the eager attention path for the analysis (``set_attn_implementation("eager")``, the
implementation it had is put back afterwards) and a forward hook on each attention module takes the weights the
module returns. SDPA and flash kernels return none; a module that still returns none on the eager path is an
error, never a map of zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.reader import AttentionReader, Consumer, tokenizer_counts
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.heads import SiteKey


@contextmanager
def transformers_attention(model: nn.Module, sites: Sequence[AttentionSite],
                           consume: Consumer | None = None) -> Iterator[dict[SiteKey, torch.Tensor]]:
    """While inside, every forward of ``model`` leaves each site's attention weights (B, H, Q, K) in the
    yielded dict (replaced at each forward), or hands them to ``consume(key, weights)`` as each module
    returns them (so only one layer's maps are held at a time). The model runs the eager path meanwhile."""
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if previous != "eager":
        model.set_attn_implementation("eager")
        if config._attn_implementation != "eager":
            raise HeadsweepError(f"{type(model).__name__} cannot switch to the eager attention path "
                                 f"(it runs {previous!r}, whose kernel returns no attention weights): roles "
                                 "cannot read its heads' attention")
    captured: dict[SiteKey, torch.Tensor] = {}
    handles = []

    def recorder(site: AttentionSite) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not site.running():  # another application of a shared module (ALBERT)
                return
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or weights.shape[1] != site.num_heads:
                raise HeadsweepError(f"{site.module_name} returned no per-head attention weights on the eager "
                                     "path: roles cannot read this model's attention")
            if consume is None:
                captured[site.key] = weights.detach()
            else:
                consume(site.key, weights.detach())

        return hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_hook(recorder(site)))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        if previous != "eager" and previous is not None:
            model.set_attn_implementation(previous)


def tokenizer_specials(tokenizer: Any) -> set[int]:
    """A transformers tokenizer's special ids ([CLS], [SEP], BOS, EOS, padding...) except the unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None and i != unk}


class TransformersReader(AttentionReader):
    """A transformers adapter (``model``, ``gates``, ``tokenizer``): a corpus is counted as its tokenizer reads it,
    and its special ids (but the unknown token) are the special tokens."""

    @property
    def specials(self) -> set[int]:
        return tokenizer_specials(self.adapter.tokenizer)

    def corpus_counts(self, lines: Sequence[str]) -> tuple[str, np.ndarray]:
        return "text", tokenizer_counts(self.adapter.tokenizer, lines)
