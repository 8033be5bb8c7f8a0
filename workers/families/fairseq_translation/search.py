"""Beam search pieces: fairseq's ``SequenceGenerator`` as configured, and gates that follow its rows.

Several masks share one beam search by packing: the batch is repeated once per mask
(:func:`repeat_sample`) and each row carries its mask's gates. Beam search reorders and shrinks
its batch as sentences finish; it does so by calling ``reorder_encoder_out(new_order)`` with the
rows every surviving hypothesis comes from, and the same index, applied to the row-to-mask map,
keeps every row's gates attached to its sentence (:class:`RoutedEnsemble`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from fairseq import utils as fairseq_utils
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from headsweep.workers.core.heads import SiteKey
from headsweep.workers.families.fairseq_translation.config import TranslationModel
from headsweep.workers.families.fairseq_translation.sites import FairseqHeadGates


@dataclass
class Hypothesis:
    """The best beam-search hypothesis of one sentence under one mask."""

    tokens: torch.Tensor
    score: float
    text: str


class RoutedEnsemble(EnsembleModel):
    """fairseq's ``EnsembleModel`` of one model, whose per-row gates follow beam search's reordering.

    ``tables[site]`` holds one gate row per mask and ``rows[i]`` is the mask of batch row i; or
    ``fixed`` sets one mask's gates for every row (called once the encoder output is there).
    The encoder runs once on the packed sentences (or ``encode()`` gives its output: encoder
    reuse); every later batch (the beams, then fewer as sentences finish) is formed by
    ``reorder_encoder_out(new_order)``, so applying ``new_order`` to ``rows`` too keeps each
    row's gates with the sentence whose encoder output it reads.
    """

    def __init__(self, model, gates: FairseqHeadGates, tables: dict[SiteKey, torch.Tensor] | None,
                 rows: torch.Tensor | None, encode: Callable[[], dict] | None = None,
                 fixed: Callable[[], None] | None = None):
        super().__init__([model])
        self._gates, self._tables, self._rows, self._encode, self._fixed = gates, tables, rows, encode, fixed

    def _route(self) -> None:
        if self._fixed is not None:
            return
        self._gates.set_values({key: table.index_select(0, self._rows) for key, table in self._tables.items()})

    def forward_encoder(self, net_input):
        if self._fixed is not None:
            # One mask for every row: set once the encoder output is there (encoder reuse clears gates).
            outs = [self._encode()] if self._encode is not None else None
            self._fixed()
            return outs if outs is not None else super().forward_encoder(net_input)
        if self._encode is not None:
            outs = [self._encode()]
            self._route()
            return outs
        self._route()
        return super().forward_encoder(net_input)

    def reorder_encoder_out(self, encoder_outs, new_order):
        if self._fixed is None:
            self._rows = self._rows.index_select(0, new_order)
            self._route()
        return super().reorder_encoder_out(encoder_outs, new_order)


def make_generator(cfg: TranslationModel, tgt_dict, models, beamable: bool = False) -> SequenceGenerator:
    """fairseq's beam search with the config's decoding options, over ``models`` (a list, or an ensemble).

    ``beamable``: encoder-decoder attention computes its keys and values once per sentence instead
    of once per beam (:func:`set_beamable`); the caller turns it off again after the search.
    """
    # Built per search: its constructor sets the beam size of models that have one (teacher forcing resets it).
    generator = SequenceGenerator(
        models, tgt_dict, beam_size=cfg.beam, max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b,
        min_len=cfg.min_len, len_penalty=cfg.lenpen, unk_penalty=cfg.unkpen,
        no_repeat_ngram_size=cfg.no_repeat_ngram_size,
    )
    if beamable:
        for model in generator.model.models:
            set_beamable(model, generator.beam_size)
    return generator


def set_beamable(model, beam: int) -> None:
    """fairseq's "beamable" encoder-decoder attention at ``beam`` (1: off), as BART models get it.

    fairseq's generator turns it on only for models with their own ``set_beam_size`` (BART), not
    for ``TransformerModel``, whose beam search then projects the encoder output to keys and values
    once per beam (identical rows) and reorders those caches every step. With it on, every
    encoder-decoder ``MultiheadAttention`` keeps one copy per sentence (the beams of a sentence read
    the same encoder output) and attends with it through its beam-shaped ``einsum``: the same
    products, without the copies. Teacher-forced rows are not beams: turn it off before scoring.
    """
    decoder = getattr(model, "decoder", None)
    if hasattr(decoder, "set_beam_size"):
        decoder.set_beam_size(beam)


def repeat_sample(sample: dict, k: int) -> dict:
    """The batch repeated ``k`` times, mask-major (rows m*B .. m*B+B-1 carry mask m)."""
    net = sample["net_input"]
    return {
        "id": sample["id"].repeat(k),
        "nsentences": sample["nsentences"] * k,
        "ntokens": sample["ntokens"] * k,
        "net_input": {key: v.repeat(k, *([1] * (v.dim() - 1))) for key, v in net.items()},
        "target": sample["target"].repeat(k, 1),
    }


def to_device(sample: dict, device: torch.device) -> dict:
    return fairseq_utils.move_to_cuda(sample, device) if device.type == "cuda" else sample
