"""The ``hf_causal_lm`` model family: transformers decoder-only language models saved with ``save_pretrained``.

Declared here with only its config sections imported: the methods import their modules when
called, so reading configs never imports transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.family import ModelFamily
from headsweep.workers.heads import Head, SiteKey

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.families.hf_causal_lm.model import LoadedCausalLM
    from headsweep.workers.gates import AttentionSite
    from headsweep.workers.head_slicing import HeadSlice


class CausalLMFamily(ModelFamily):
    """Llama, Mistral, Qwen2, Qwen3, Phi-3 and other Llama-style decoders, GPT-2 and GPTBigCode (query heads
    ``self:LAYER:HEAD``; grouped-query and multi-query attention). Physical pruning: Llama-style models with
    separate q/k/v projections, GPT-2 and GPTBigCode."""

    def load_model(self, model_cfg: CausalLMModel) -> LoadedCausalLM:
        from headsweep.workers.families.hf_causal_lm.model import load_causal_lm

        return load_causal_lm(model_cfg, "cpu")

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.hf_causal_lm.sites import find_sites

        return find_sites(model)

    def owns(self, model: nn.Module) -> bool:
        """A bare model is this family's when all its attention modules have decoder layouts (llama, gpt2)."""
        from headsweep.workers.families.transformers.layout import only_layouts

        return only_layouts(self.find_sites(model), {"llama", "gpt2"})

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.hf_causal_lm.pruning import prune_causal_lm_heads

        return prune_causal_lm_heads(model, heads)

    def save_pruned(self, model_cfg: CausalLMModel, loaded: LoadedCausalLM, heads: Sequence[Head],
                    out_dir: str | Path) -> None:
        """A ``save_pretrained`` folder with the tokenizer; ``config.pruned_heads`` lists the removed heads
        (``model.path`` of a config, or ``headsweep.workers.families.hf_causal_lm.pruning.load_pruned``, loads it)."""
        from headsweep.workers.families.hf_causal_lm.pruning import save_pruned

        save_pruned(loaded.model, out_dir, loaded.tokenizer)


HF_CAUSAL_LM = CausalLMFamily("hf_causal_lm", CausalLMModel, CausalLMData,
                              "headsweep.workers.families.hf_causal_lm.adapter:load_causal_lm_adapter")
