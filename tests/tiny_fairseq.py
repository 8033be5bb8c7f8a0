"""A tiny real fairseq translation model, and fairseq-only reference routes to check gates against.

The model is trained for a few seconds on the synthetic task (so beam search produces
non-trivial, partly right translations) and saved with fairseq's own checkpoint writer. The
reference routes below use fairseq alone on a freshly loaded model with a head's W_O columns
set to zero: no hooks, no gate code, and fairseq's fused attention path where it takes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from headsweep.sweep.demo.translation import SyntheticData, prepare_synthetic
from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.train import TrainSettings, train_translation

TINY_SETTINGS = TrainSettings(
    encoder_layers=2, decoder_layers=2, embed_dim=32, ffn_dim=64, attention_heads=4, dropout=0.0,
    max_epochs=4, max_tokens=1024, lr=5e-3, warmup_updates=30, save_every_epoch=True,
)
# The summation-order bound's shape for this model (tests/tolerances.py): a decoder layer, with its two
# attentions, counts twice; the longest inner product is the feed-forward size (sentences have at most 14
# words, beam search stops at 24 tokens).
BOUND_SHAPE = {"depth": TINY_SETTINGS.encoder_layers + 2 * TINY_SETTINGS.decoder_layers,
               "width": TINY_SETTINGS.ffn_dim}


@dataclass
class TinyFairseq:
    data: SyntheticData
    checkpoint: Path
    epoch_checkpoints: list[Path]


def train_tiny(dest: Path) -> TinyFairseq:
    """Synthetic data (1200 training pairs, 40 test pairs) and a 2+2-layer, 4-head model, in ~3 s."""
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    data = prepare_synthetic(dest, n_train=1200, n_valid=40, n_test=40, seed=3)
    result = train_translation(data.data_bin, dest / "checkpoints", "src", "tgt", TINY_SETTINGS)
    return TinyFairseq(data, result.checkpoint, result.epoch_checkpoints)


def fairseq_load(checkpoint: Path, data_bin: Path):
    """Model and task through fairseq's own loader (torch's default weights_only load)."""
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                        arg_overrides={"data": str(data_bin)})
    return models[0].eval(), task


def attention_module(model, head: Head):
    if head.attention == "enc_self":
        return model.encoder.layers[head.layer].self_attn
    if head.attention == "enc_dec":
        return model.decoder.layers[head.layer].encoder_attn
    return model.decoder.layers[head.layer].self_attn


def zero_heads(model, heads: list[Head]):
    """Set the W_O columns of ``heads`` to zero, in place (the bias stays)."""
    with torch.no_grad():
        for head in heads:
            module = attention_module(model, head)
            d = module.head_dim
            module.out_proj.weight[:, head.head * d : (head.head + 1) * d] = 0.0
    return model


def collate(sources: list[torch.Tensor], targets: list[torch.Tensor] | None, src_dict, tgt_dict) -> dict:
    from fairseq.data import LanguagePairDataset

    ds = LanguagePairDataset(
        sources, np.array([len(s) for s in sources]), src_dict,
        targets, None if targets is None else np.array([len(t) for t in targets]), tgt_dict,
    )
    return ds.collater([ds[i] for i in range(len(sources))])


def plain_beam_search(model, task, sources: list[torch.Tensor], beam: int, max_len_b: int):
    """fairseq beam search of all ``sources`` in one batch: [(tokens, score)] in input order."""
    from fairseq.sequence_generator import SequenceGenerator

    sample = collate(sources, None, task.source_dictionary, task.target_dictionary)
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_b=max_len_b)
    with torch.no_grad():
        hypos = generator.generate([model], sample)
    out: list = [None] * len(sources)
    for i, hypo in zip(sample["id"].tolist(), hypos, strict=True):
        out[i] = (hypo[0]["tokens"].tolist(), float(hypo[0]["score"]))
    return out


def plain_reference_nll(model, task, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> np.ndarray:
    """Teacher-forced cross-entropy per sentence (mean over target tokens, nats), in input order."""
    sample = collate(sources, targets, task.source_dictionary, task.target_dictionary)
    pad = task.target_dictionary.pad()
    with torch.no_grad():
        logits = model(**sample["net_input"])[0].float()
    target = sample["target"]
    nll = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=pad, reduction="none").sum(1)
    per = (nll / target.ne(pad).sum(1)).double().numpy()
    out = np.empty(len(sources))
    out[sample["id"].numpy()] = per
    return out
