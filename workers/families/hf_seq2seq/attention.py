"""What roles reads of a transformers encoder-decoder model: per-head attention maps, teacher-forced on the
references, as ``fairseq_translation`` reads its models.

``enc_self`` runs over the source, ``dec_self`` (causal) over the decoder's input (the decoder start token, then the
reference but its last token, as transformers shifts ``labels``), ``enc_dec`` from the decoder's input to the source.
The model runs on the eager attention path with ``output_attentions`` set in its config (both put back afterwards)
and a forward hook on each attention module takes the weights it returns. Where they sit in the module's output
depends on the layout: BART-style modules return ``(output, weights)``, T5's ``(output, position_bias, weights)``,
and its position bias has the weights' shape: so the place is read from the layout (``site_table``), never guessed
by shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.head_roles import SiteAttention, TokenSide
from headsweep.workers.attention.reader import Consumer, Sink, special_mask, tokenizer_counts
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.families.hf_shared.attention import TransformersReader
from headsweep.workers.families.hf_shared.site_table import spec_of

# Where each layout's attention module returns its per-head weights (FSMT's and MVP's only when asked:
# ``output_attentions``).
WEIGHTS_AT = {"bart": 1, "t5": 2, "fsmt": 1}


@contextmanager
def seq2seq_attention(model: nn.Module, sites: Sequence[AttentionSite], consume: Consumer) -> Iterator[None]:
    """While inside, every forward of ``model`` hands each site's attention weights (B, H, Q, K) to
    ``consume(key, weights)`` as its module returns them, on the eager path."""
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if previous != "eager":
        model.set_attn_implementation("eager")
    # Asked for in the config, so that a forward that does not ask (relevance propagation's loss batches) still gets
    # the weights of the modules that return them only when asked.
    asked = config.output_attentions
    config.output_attentions = True
    handles = []

    def recorder(site: AttentionSite, at: int) -> Callable:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            weights = output[at] if isinstance(output, tuple) and len(output) > at else None
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or weights.shape[1] != site.num_heads:
                raise HeadsweepError(f"{site.module_name} returned no per-head attention weights on the eager "
                                     "path: roles cannot read this model's attention")
            consume(site.key, weights.detach())

        return hook

    try:
        for site in sites:
            spec = spec_of(site.module)
            at = WEIGHTS_AT.get(spec.layout) if spec is not None else None
            if at is None:
                raise HeadsweepError(f"{site.module_name} ({type(site.module).__name__}): roles does not know where "
                                     "this attention layout returns its weights")
            handles.append(site.module.register_forward_hook(recorder(site, at)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        config.output_attentions = asked
        if previous != "eager" and previous is not None:
            model.set_attn_implementation(previous)


class Seq2SeqReader(TransformersReader):
    """An hf_seq2seq adapter (``Seq2SeqAdapter``), teacher-forced on its references (module docstring). Special
    tokens are the tokenizer's special ids but the unknown token (the decoder start and end tokens, padding); a
    corpus is counted as the tokenizer reads source text, so only source keys get frequencies. Syntactic heads are
    not read (refused in one line)."""

    def read(self, sink: Sink) -> Iterator[None]:
        adapter = self.adapter
        model = adapter.model
        specials = self.specials
        sides: dict[str, tuple[TokenSide, TokenSide, bool]] = {}
        adapter.gates.clear()
        with seq2seq_attention(model, adapter.gates.sites, lambda key, w: sink(key, SiteAttention(w, *sides[key[0]]))):
            for batch in adapter.batches:
                labels = adapter.reference_labels(batch)
                decoder_ids = adapter.decoder_input_ids(labels)
                src, real_src = batch.inputs["input_ids"], batch.inputs["attention_mask"].bool()
                real_tgt = labels.ne(-100)
                source = TokenSide(src, real_src, special_mask(src, specials) & real_src, "source", batch.examples)
                target = TokenSide(decoder_ids, real_tgt, special_mask(decoder_ids, specials) & real_tgt, "target",
                                   batch.examples)
                sides.update({"enc_self": (source, source, False), "dec_self": (target, target, True),
                              "enc_dec": (target, source, False)})
                with torch.inference_mode():  # not across the yield: the caller's code runs as it chose
                    model(**batch.inputs, decoder_input_ids=decoder_ids, use_cache=False)
                yield

    def corpus_counts(self, lines: Sequence[str]) -> tuple[str, np.ndarray]:
        return "source", tokenizer_counts(self.adapter.tokenizer, lines)
