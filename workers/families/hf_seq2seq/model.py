"""Loading a transformers encoder-decoder model and its tokenizer from local folders, offline (through the
transformers layer, :mod:`headsweep.workers.families.hf_shared.loading`)."""

from __future__ import annotations

from pathlib import Path

from headsweep.workers.families.hf_seq2seq.config import Seq2SeqModel
from headsweep.workers.families.hf_seq2seq.pruning import prune_seq2seq_heads
from headsweep.workers.families.hf_seq2seq.sites import SUPPORTED
from headsweep.workers.families.hf_shared.architecture import SEQ2SEQ
from headsweep.workers.families.hf_shared.loading import LoadedTransformers, load_folder
from headsweep.workers.families.hf_shared.tokenizer import load_tokenizer


def tokenizer_folder(cfg: Seq2SeqModel, model_dir: Path) -> tuple[Path, str]:
    """``model.tokenizer``, else the model's folder; and what an error about it ends with."""
    from headsweep.workers.families.hf_causal_lm.config import tokenizer_folder as folder_of

    given = cfg.tokenizer is not None
    return folder_of(cfg.tokenizer if given else str(model_dir), given)


def load_seq2seq(cfg: Seq2SeqModel, device: str) -> LoadedTransformers:
    """Model (eval mode, on ``device``) and tokenizer; a folder that is not an encoder-decoder model with its
    generation head is refused before transformers loads it."""
    return load_folder(cfg, device, SEQ2SEQ, "AutoModelForSeq2SeqLM",
                       tokenizer=lambda model_dir: load_tokenizer(*tokenizer_folder(cfg, model_dir)),
                       prune=prune_seq2seq_heads, cannot_load=_cannot_load)


def _cannot_load(model_dir: Path) -> str:
    return f"cannot load an encoder-decoder model from {model_dir} (model.kind hf_seq2seq takes {SUPPORTED})"
