"""The ``hf_classifier`` model family: transformers sequence classifiers saved with ``save_pretrained``.

Declared here with only its config sections imported: the methods import their modules when
called, so reading configs never imports transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.family import ModelFamily
from headsweep.workers.heads import Head, SiteKey

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.families.hf_classifier.model import LoadedClassifier
    from headsweep.workers.gates import AttentionSite
    from headsweep.workers.head_slicing import HeadSlice


class ClassifierFamily(ModelFamily):
    """BERT, RoBERTa, ELECTRA, MiniLM and DistilBERT classifiers (Llama-style models: gates only)."""

    def load_model(self, model_cfg: ClassifierModel) -> LoadedClassifier:
        from headsweep.workers.families.hf_classifier.model import LoadedClassifier, load_hf_model

        return LoadedClassifier(*load_hf_model(model_cfg, "cpu"))

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.transformers.sites import find_sites

        return find_sites(model)

    def owns(self, model: nn.Module) -> bool:
        """A bare model is this family's when all its attention modules have encoder layouts (bert, distilbert)."""
        from headsweep.workers.families.transformers.layout import only_layouts

        return only_layouts(self.find_sites(model), {"bert", "distilbert"})

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.hf_classifier.pruning import prune_hf_heads

        return prune_hf_heads(model, heads)

    def save_pruned(self, model_cfg: ClassifierModel, loaded: LoadedClassifier, heads: Sequence[Head],
                    out_dir: str | Path) -> None:
        """A ``save_pretrained`` folder with the tokenizer; ``config.pruned_heads`` lists the removed heads."""
        from headsweep.workers.families.hf_classifier.pruning import save_pruned

        save_pruned(loaded.model, out_dir, loaded.tokenizer)


HF_CLASSIFIER = ClassifierFamily("hf_classifier", ClassifierModel, ClassifierData,
                                 "headsweep.workers.families.hf_classifier.adapter:load_classifier")
