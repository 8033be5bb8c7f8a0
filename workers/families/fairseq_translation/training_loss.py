"""The training loss of a translation model as gradient importance needs it.

Teacher-forced label-smoothed cross-entropy (fairseq's ``label_smoothed_nll_loss``), summed over
the target tokens of each batch, as fairseq's ``label_smoothed_cross_entropy`` criterion trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from torch import nn

from headsweep.workers.core.family import LossBatch, LossBatches
from headsweep.workers.core.gates import HeadGates

# fairseq's recipes for the paper's IWSLT and WMT models (and fairseq_translation/train.py) train
# with label smoothing 0.1; used when the caller does not say otherwise.
DEFAULT_LABEL_SMOOTHING = 0.1


def translation_loss_batches(model: nn.Module, gates: HeadGates, samples: Sequence[dict], src_pad: int,
                             tgt_pad: int, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
    """fairseq samples as teacher-forced label-smoothed cross-entropy computed in ``dtype``.

    ``enc_self`` sites see the source tokens, ``enc_dec`` and ``dec_self`` sites the target-side
    (previous output) tokens. ``label_smoothing`` None is :data:`DEFAULT_LABEL_SMOOTHING`.
    """
    eps = float(DEFAULT_LABEL_SMOOTHING if label_smoothing is None else label_smoothing)
    decoder = getattr(model, "decoder", None)
    if hasattr(decoder, "set_beam_size"):
        # Beam search leaves the decoder's "beamable" encoder attention on, which would treat
        # teacher-forced rows as beams of one sentence.
        decoder.set_beam_size(1)
    batches = [_batch(model, gates, sample, src_pad, tgt_pad, eps, dtype) for sample in samples]
    return LossBatches(batches, f"teacher-forced label-smoothed cross-entropy (epsilon {eps:g})")


def _batch(model: nn.Module, gates: HeadGates, sample: dict, src_pad: int, tgt_pad: int, epsilon: float,
           dtype: torch.dtype) -> LossBatch:
    net = sample["net_input"]
    src_real = net["src_tokens"].ne(src_pad)
    tgt_real = net["prev_output_tokens"].ne(tgt_pad)
    tokens = {site.key: src_real if site.attention == "enc_self" else tgt_real for site in gates.sites}
    target = sample["target"]

    def loss() -> torch.Tensor:
        net_output = model(**net)
        if getattr(model.decoder, "adaptive_softmax", None) is None:
            # fairseq's get_normalized_probs always computes in float32; the same log-softmax in
            # the gate dtype keeps float64 models exact (finite-difference tests rely on it).
            lprobs = torch.log_softmax(net_output[0].to(dtype), dim=-1)
        else:
            lprobs = model.get_normalized_probs(net_output, log_probs=True)
        smoothed, _nll = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.reshape(-1), epsilon,
                                                 ignore_index=tgt_pad, reduce=True)
        return smoothed

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        return model(**net)[0], target.ne(tgt_pad)

    return LossBatch(tokens, int(target.shape[0]), loss, outputs)
