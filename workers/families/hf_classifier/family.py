"""The ``hf_classifier`` model family: transformers sequence classifiers saved with ``save_pretrained``.

Declared here with only its config sections imported: the methods import their modules when
called, so reading configs never imports transformers. What it shares with ``hf_causal_lm`` is
:class:`~headsweep.workers.families.hf_shared.family.TransformersFamily`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.hf_classifier.config import TOKENIZER_HINT, ClassifierData, ClassifierModel
from headsweep.workers.families.hf_shared.family import TransformersFamily

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.attention.reader import AttentionReader
    from headsweep.workers.core.head_slicing import HeadSlice
    from headsweep.workers.families.hf_shared.loading import LoadedTransformers


class ClassifierFamily(TransformersFamily):
    """BERT, RoBERTa, ELECTRA, MiniLM and DistilBERT classifiers (Llama-style models: gates only)."""

    layouts = frozenset({"bert", "distilbert", "modernbert", "albert"})

    def check_data(self, data_cfg: ClassifierData, key: str = "data") -> None:
        """The settings, and the file read and checked as the workers will read it."""
        from headsweep.workers.families.hf_classifier.data import read_examples

        read_examples(data_cfg, key)

    def tokenizer_folder(self, model_cfg: ClassifierModel, model_dir: Path) -> tuple[Path, str]:
        """The classifier's tokenizer lives in its folder."""
        return model_dir, TOKENIZER_HINT

    def load_model(self, model_cfg: ClassifierModel) -> LoadedTransformers:
        from headsweep.workers.families.hf_classifier.model import load_classifier_model

        return load_classifier_model(model_cfg, "cpu")

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.hf_classifier.pruning import prune_hf_heads

        return prune_hf_heads(model, heads)

    def exports_architecture(self, name: str) -> bool:
        """Every transformers folder but a causal LM's or an encoder-decoder generator's (a folder naming no
        architecture is refused by loading)."""
        from headsweep.workers.families.hf_shared.architecture import is_causal_lm_architecture, is_seq2seq_architecture

        return not is_causal_lm_architecture(name) and not is_seq2seq_architecture(name)

    def load_exported(self, folder: str | Path) -> nn.Module:
        from headsweep.workers.families.hf_classifier.pruning import load_pruned

        return load_pruned(folder)

    def attention_reader(self, adapter: Any) -> AttentionReader:
        from headsweep.workers.families.hf_classifier.attention import ClassifierReader

        return ClassifierReader(adapter)


HF_CLASSIFIER = ClassifierFamily("hf_classifier", ClassifierModel, ClassifierData,
                                 "headsweep.workers.families.hf_classifier.adapter:load_classifier",
                                 syntax_attention="self", hub_ids=True)
