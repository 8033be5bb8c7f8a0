"""The ``hf_causal_lm`` model family: transformers decoder-only language models saved with ``save_pretrained``.

Declared here with only its config sections imported: the methods import their modules when
called, so reading configs never imports transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.family import ModelFamily

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.families.hf_causal_lm.model import LoadedCausalLM
    from headsweep.workers.gates import AttentionSite


class CausalLMFamily(ModelFamily):
    """Llama, Mistral, Qwen2, Qwen3, Phi-3 and other Llama-style decoders, GPT-2 and GPTBigCode (query heads
    ``self:LAYER:HEAD``; grouped-query and multi-query attention). Physical pruning is not implemented yet."""

    def load_model(self, model_cfg: CausalLMModel) -> LoadedCausalLM:
        from headsweep.workers.families.hf_causal_lm.model import load_causal_lm

        return load_causal_lm(model_cfg, "cpu")

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.hf_causal_lm.sites import find_sites

        return find_sites(model)


HF_CAUSAL_LM = CausalLMFamily("hf_causal_lm", CausalLMModel, CausalLMData,
                              "headsweep.workers.families.hf_causal_lm.adapter:load_causal_lm_adapter")
