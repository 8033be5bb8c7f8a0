"""What roles reads of a transformers classifier: attention maps on its evaluation batches, and its examples'
pieces for syntactic heads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.head_roles import SiteAttention, TokenSide
from headsweep.workers.attention.reader import PieceSpans, Sink, special_mask
from headsweep.workers.attention.syntax import offset_spans
from headsweep.workers.families.hf_shared.attention import TransformersReader, transformers_attention


class ClassifierReader(TransformersReader):
    """A classifier adapter (``ClassifierAdapter``): every site is self-attention over the batch's tokens;
    [CLS]/[SEP] (the tokenizer's special ids but the unknown token) are special. Syntactic heads read the first
    text of each example."""

    def read(self, sink: Sink) -> Iterator[None]:
        adapter = self.adapter
        specials = self.specials
        now: dict[str, TokenSide] = {}
        adapter.gates.clear()
        with transformers_attention(adapter.model, adapter.gates.sites,
                                    lambda key, w: sink(key, SiteAttention(w, now["side"], now["side"]))):
            for idx, inputs in adapter.batches:
                ids = inputs["input_ids"]
                mask = inputs.get("attention_mask")
                real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
                now["side"] = TokenSide(ids, real, special_mask(ids, specials) & real, "text", idx)
                with torch.inference_mode():  # not across the yield: the caller's code runs as it chose
                    adapter.model(**inputs)
                yield

    def sentences(self) -> tuple[list[str], None]:
        return list(self.adapter.examples.texts), None

    def piece_spans(self, texts: Sequence[str]) -> list[PieceSpans]:
        """Each example's pieces (as the adapter tokenises it: the same truncation) as compact character spans of
        its first text; the second text of a pair and special tokens span nothing."""
        adapter = self.adapter
        tok = adapter.tokenizer
        if not getattr(tok, "is_fast", False):
            raise HeadsweepError(f"syntactic heads need a fast tokenizer (character offsets); {type(tok).__name__} "
                                 "gives none")
        ex = adapter.examples
        enc = tok(ex.texts, ex.text_pairs, truncation=True, max_length=adapter.max_length,
                  return_offsets_mapping=True, verbose=False)
        spans = []
        for i, text in enumerate(texts):
            first = [s == 0 for s in enc.sequence_ids(i)]
            offsets = [o if keep else (0, 0) for o, keep in zip(enc["offset_mapping"][i], first, strict=True)]
            spans.append(offset_spans(text, offsets))
        return spans
