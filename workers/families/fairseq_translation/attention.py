"""Reading a fairseq translation model's attention weights (roles, relevance propagation), and what roles reads of
its adapter.

Each ``MultiheadAttention`` is taken off its fused path for the analysis (``F.multi_head_attention_forward``
returns the heads' average at best) and asked for per-head weights (``need_head_weights``); its caller gets back
what it asked for (no weights, or the head average), so the model computes what its unfused path computes without
the analysis. Roles reads the model teacher-forced on the references: the decoder reads the reference's previous
tokens.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.head_roles import FrequencyTable, SiteAttention, TokenSide
from headsweep.workers.attention.reader import AttentionReader, Consumer, PieceSpans, Sink, special_mask
from headsweep.workers.attention.syntax import piece_string_spans
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.heads import SiteKey


@contextmanager
def fairseq_attention(sites: Sequence[AttentionSite],
                      consume: Consumer | None = None) -> Iterator[dict[SiteKey, torch.Tensor]]:
    """While inside, every forward through the sites' fairseq ``MultiheadAttention`` modules leaves their
    per-head weights (B, H, Q, K) in the yielded dict, or hands them to ``consume(key, weights)``; callers
    still get the weights they asked for."""
    captured: dict[SiteKey, torch.Tensor] = {}
    asked: dict[int, list[tuple[bool, bool]]] = {}
    handles, flags = [], []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        asked.setdefault(id(module), []).append((bool(kwargs.get("need_weights", True)),
                                                 bool(kwargs.get("need_head_weights", False))))
        return args, {**kwargs, "need_weights": True, "need_head_weights": True}

    def recorder(site: AttentionSite) -> Callable:
        def after(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
            need_weights, need_heads = asked[id(module)].pop()
            attn, weights = output
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
                raise HeadsweepError(f"{site.module_name} returned no per-head attention weights: roles cannot "
                                     "read this model's attention")
            per_head = weights.detach().transpose(0, 1)  # fairseq: (H, B, Q, K)
            if consume is None:
                captured[site.key] = per_head
            else:
                consume(site.key, per_head)
            if need_heads:
                return attn, weights
            # As MultiheadAttention averages when only need_weights is asked for.
            return attn, weights.mean(dim=0) if need_weights else None

        return after

    try:
        for site in sites:
            module = site.module
            if hasattr(module, "skip_embed_dim_check"):
                # Off the fused path (F.multi_head_attention_forward), which averages the heads' weights.
                flags.append((module, module.skip_embed_dim_check))
                module.skip_embed_dim_check = True
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(recorder(site), with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in flags:
            module.skip_embed_dim_check = flag


def dictionary_side(tokens: torch.Tensor, dictionary: Any, vocab: str, examples: torch.Tensor | None = None
                    ) -> TokenSide:
    """Tokens of a fairseq dictionary: padding is not real; EOS, BOS and padding are special."""
    real = tokens.ne(dictionary.pad())
    special = special_mask(tokens, {dictionary.bos(), dictionary.eos(), dictionary.pad()}) & real
    return TokenSide(tokens, real, special, vocab, examples)


class TranslationReader(AttentionReader):
    """A translation adapter (``TranslationAdapter``), teacher-forced on the references: ``enc_self`` over the
    source, ``dec_self`` (causal) over the decoder's input (EOS, then the reference but its last token),
    ``enc_dec`` from the decoder's input to the source. Its dictionaries' counts are its own token frequencies, a
    corpus is counted on the source side, and syntactic heads read the source sentences as its pieces spell them.
    """

    def read(self, sink: Sink) -> Iterator[None]:
        adapter = self.adapter
        model = adapter.model
        if hasattr(model.decoder, "set_beam_size"):
            model.decoder.set_beam_size(1)  # a beam search may have left "beamable" encoder attention on
        sides: dict[str, tuple[TokenSide, TokenSide, bool]] = {}
        adapter.gates.clear()
        with fairseq_attention(adapter.gates.sites, lambda key, w: sink(key, SiteAttention(w, *sides[key[0]]))):
            for sample in adapter.batches:
                net = sample["net_input"]
                source = dictionary_side(net["src_tokens"], adapter.src_dict, "source", sample["id"])
                target = dictionary_side(net["prev_output_tokens"], adapter.tgt_dict, "target")
                sides.update({"enc_self": (source, source, False), "dec_self": (target, target, True),
                              "enc_dec": (target, source, False)})
                with torch.inference_mode():
                    model(**net)
                yield

    def dictionaries(self, top: int) -> tuple[dict[str, FrequencyTable], str]:
        adapter = self.adapter
        tables = {"source": FrequencyTable(np.asarray(adapter.src_dict.count), top, "source dictionary"),
                  "target": FrequencyTable(np.asarray(adapter.tgt_dict.count), top, "target dictionary")}
        return tables, (f"fairseq dictionaries' counts (dict.{adapter.source_lang}.txt, dict.{adapter.target_lang}.txt"
                        f" of the model's data_bin); rare: outside the {top} most frequent types")

    def corpus_counts(self, lines: Sequence[str]) -> tuple[str, np.ndarray]:
        """Counted on the source side: its tokenisation and dictionary (only source keys get frequencies)."""
        adapter = self.adapter
        counts = np.zeros(len(adapter.src_dict), dtype=np.int64)
        for line in lines:
            ids = adapter.pipeline.encode(line, "source")[:-1].numpy()  # without the EOS it appends
            np.add.at(counts, ids, 1)
        return "source", counts

    def sentences(self) -> tuple[list[str], list[PieceSpans | None]]:
        """Each source sentence spelled by its pieces (BPE markers removed, Moses escapes undone) and the pieces'
        compact spans (EOS spans nothing); None for a sentence holding ``<unk>`` (it spells no characters)."""
        adapter = self.adapter
        d = adapter.src_dict
        pipeline = getattr(adapter, "pipeline", None)
        continuation = "" if getattr(pipeline, "post_process", None) == "sentencepiece" else "@@"
        texts, spans = [], []
        for ids in adapter.examples.source:
            ids = [int(i) for i in ids]
            pieces = [html.unescape(d[i]) for i in ids if i != d.eos()]
            text, piece_spans = piece_string_spans(pieces, continuation)
            texts.append(text)
            spans.append(None if d.unk() in ids else [*piece_spans, None])
        return texts, spans
