"""Loading a transformers causal language model and its tokenizer from local folders, offline (through the
transformers layer, :mod:`headsweep.workers.families.hf_shared.loading`), gates on its attention sites, and the
facts a run records about it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.families.hf_causal_lm.config import CausalLMModel, tokenizer_folder
from headsweep.workers.families.hf_causal_lm.model.pruning import prune_causal_lm_heads
from headsweep.workers.families.hf_causal_lm.model.sites import SUPPORTED, kv_groups, sites_or_error
from headsweep.workers.families.hf_shared.architecture import CAUSAL_LM
from headsweep.workers.families.hf_shared.loading import LoadedTransformers, load_folder
from headsweep.workers.families.hf_shared.tokenizer import load_tokenizer as load_tokenizer_from


def load_causal_lm(cfg: CausalLMModel, device: str) -> LoadedTransformers:
    """Load model (eval mode, on ``device``) and tokenizer from local folders, offline.

    Encoder-decoder models, bidirectional encoders and sequence classifiers are refused before transformers loads
    them (it would load T5 or BERT with a causal LM head).
    """
    return load_folder(cfg, device, CAUSAL_LM, "AutoModelForCausalLM",
                       tokenizer=lambda model_dir: load_tokenizer(cfg.tokenizer or str(model_dir),
                                                                  given=cfg.tokenizer is not None),
                       prune=prune_causal_lm_heads, cannot_load=_cannot_load)


class GatedCausalLM:
    """What every causal-LM adapter starts with: the run's threads, device and options, the model with its
    tokenizer, and gates on its attention sites."""

    def load_gated(self, model_cfg: CausalLMModel, runtime: RuntimeOptions) -> None:
        """Loads the model of ``model_cfg`` onto ``runtime.device`` and puts gates on it (call it after the data
        is read and checked: a bad data file then costs no model load)."""
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        self.device = torch.device(runtime.device)
        self.runtime = runtime
        loaded = load_causal_lm(model_cfg, runtime.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.gates = HeadGates(sites_or_error(self.model))


def _cannot_load(model_dir: Path) -> str:
    return f"cannot load a causal LM from {model_dir} (model.kind hf_causal_lm takes {SUPPORTED})"


def load_tokenizer(folder: str, given: bool):
    """The tokenizer in ``folder`` (``model.tokenizer`` when ``given``, else the model's folder)."""
    return load_tokenizer_from(*tokenizer_folder(folder, given))


def model_facts(model: nn.Module, sites) -> dict:
    """What ``runs.facts`` records about a causal LM: class, type, attention implementation, dtype, and its
    key/value heads (their number per layer and the query heads each serves)."""
    cfg = model.config
    groups = kv_groups(sites)
    return {"model_class": type(model).__name__, "model_type": getattr(cfg, "model_type", None),
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "dtype": str(model.dtype).removeprefix("torch."),
            "num_key_value_heads": {k: len(v) for k, v in groups.items()}, "kv_groups": groups}
