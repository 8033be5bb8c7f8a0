"""The ``hf_causal_lm`` model family: transformers decoder-only language models saved with ``save_pretrained``.

Declared here with only its config sections imported: the methods import their modules when
called, so reading configs never imports transformers. What it shares with ``hf_classifier`` is
:class:`~headsweep.workers.families.hf_shared.family.TransformersFamily`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.hf_causal_lm.config import (
    CausalLMData,
    CausalLMModel,
    CausalLMRuntime,
    tokenizer_folder,
)
from headsweep.workers.families.hf_shared.family import TransformersFamily

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.attention.reader import AttentionReader
    from headsweep.workers.core.head_slicing import HeadSlice
    from headsweep.workers.families.hf_shared.loading import LoadedTransformers


class CausalLMFamily(TransformersFamily):
    """Llama, Mistral, Qwen2, Qwen3, Phi-3 and other Llama-style decoders, GPT-2 and GPTBigCode (query heads
    ``self:LAYER:HEAD``; grouped-query and multi-query attention). Physical pruning: Llama-style models with
    separate q/k/v projections, GPT-2 and GPTBigCode."""

    layouts = frozenset({"llama", "gpt2", "gpt_neox", "bloom", "falcon", "gptj", "opt", "phi", "mla"})

    def check_data(self, data_cfg: CausalLMData, key: str = "data") -> None:
        """The settings and the file; for perplexity also the corpus text itself (decoded, its rows read)."""
        from headsweep.workers.families.hf_causal_lm.by_task import check_data

        check_data(data_cfg, key)

    def tokenizer_folder(self, model_cfg: CausalLMModel, model_dir: Path) -> tuple[Path, str]:
        """``model.tokenizer``, else the model's folder."""
        given = model_cfg.tokenizer is not None
        return tokenizer_folder(model_cfg.tokenizer if given else str(model_dir), given)

    def load_model(self, model_cfg: CausalLMModel) -> LoadedTransformers:
        from headsweep.workers.families.hf_causal_lm.model.loading import load_causal_lm

        return load_causal_lm(model_cfg, "cpu")

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.hf_causal_lm.model.pruning import prune_causal_lm_heads

        return prune_causal_lm_heads(model, heads)

    def stock_sizes(self, model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
        """Llama-style models without the same heads in every layer and key/value group (GPT-2 and GPTBigCode:
        never) are refused (:mod:`~headsweep.workers.families.hf_causal_lm.model.stock`)."""
        from headsweep.workers.families.hf_causal_lm.model.stock import stock_sizes

        return stock_sizes(model, heads)

    def exports_architecture(self, name: str) -> bool:
        from headsweep.workers.families.hf_shared.architecture import is_causal_lm_architecture

        return is_causal_lm_architecture(name)

    def load_exported(self, folder: str | Path) -> nn.Module:
        from headsweep.workers.families.hf_causal_lm.model.pruning import load_pruned

        return load_pruned(folder)

    def attention_reader(self, adapter: Any) -> AttentionReader:
        """The perplexity adapter's windows; the multiple-choice adapter is refused."""
        from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter
        from headsweep.workers.families.hf_causal_lm.tasks.perplexity_attention import CausalLMReader

        if not isinstance(adapter, CausalLMAdapter):
            raise HeadsweepError(f"{type(adapter).__name__}: roles reads decoder-only models on perplexity windows "
                                 "(data.task: perplexity) only")
        return CausalLMReader(adapter)


HF_CAUSAL_LM = CausalLMFamily("hf_causal_lm", CausalLMModel, CausalLMData,
                              "headsweep.workers.families.hf_causal_lm.by_task:load_causal_lm_adapter",
                              hub_ids=True, runtime_options=CausalLMRuntime)
