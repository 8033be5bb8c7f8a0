"""What roles reads of a causal LM: attention maps on its perplexity windows."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch

from headsweep.workers.attention.head_roles import SiteAttention, TokenSide
from headsweep.workers.attention.reader import Sink, special_mask
from headsweep.workers.families.hf_shared.attention import TransformersReader, transformers_attention


class CausalLMReader(TransformersReader):
    """A perplexity adapter (``CausalLMAdapter``) on its evaluation windows: causal self-attention over each
    window; a window's BOS (``data.add_bos``) and any other special id are special."""

    def read(self, sink: Sink) -> Iterator[None]:
        adapter = self.adapter
        specials = self.specials
        model = adapter.model
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        now: dict[str, TokenSide] = {}
        adapter.gates.clear()
        with transformers_attention(model, adapter.gates.sites,
                                    lambda key, w: sink(key, SiteAttention(w, now["side"], now["side"],
                                                                           causal=True))):
            for idx in adapter.batches:
                ids = adapter.inputs[idx.to(adapter.inputs.device)]
                now["side"] = TokenSide(ids, torch.ones_like(ids, dtype=torch.bool), special_mask(ids, specials),
                                        "text")
                with torch.inference_mode():
                    model(input_ids=ids, use_cache=False, **extra)
                yield
