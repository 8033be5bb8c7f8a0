"""What both transformers families do alike, as a ``ModelFamily`` base class.

Sites, exported folders and attention weights are the same for a classifier and a causal LM; each family says
which attention layouts are its own (``layouts``: a bare model is the family's when all its attention modules
have them), how it loads and prunes a model, and which exported folders are its. The methods import their
modules when called, so reading configs never imports transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from headsweep.workers.core.family import ModelFamily
from headsweep.workers.core.heads import Head

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.attention.reader import Consumer
    from headsweep.workers.core.gates import AttentionSite
    from headsweep.workers.families.hf_shared.loading import LoadedTransformers


class TransformersFamily(ModelFamily):
    """A family of transformers models saved with ``save_pretrained`` (``hf_classifier``, ``hf_causal_lm``)."""

    layouts: ClassVar[frozenset[str]] = frozenset()  # attention layouts (transformers.layout.LAYOUTS) of its models

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.hf_shared.sites import find_sites

        return find_sites(model)

    def owns(self, model: nn.Module) -> bool:
        """A bare model is this family's when all its attention modules have one of the family's ``layouts``
        (both transformers families recognise the same modules, so the layouts say whose a model is)."""
        from headsweep.workers.families.hf_shared.layout import only_layouts

        return only_layouts(self.find_sites(model), self.layouts)

    def save_pruned(self, model_cfg: Any, loaded: LoadedTransformers, heads: Sequence[Head],
                    out_dir: str | Path) -> None:
        """A ``save_pretrained`` folder with the tokenizer; ``config.pruned_heads`` lists the removed heads
        (``model.path`` of a config, or :meth:`load_exported`, loads it)."""
        from headsweep.workers.families.hf_shared.pruning import save_pruned

        save_pruned(loaded.model, out_dir, loaded.tokenizer)

    def stock_sizes(self, model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
        """BERT-family encoders derive the head size from ``hidden_size / num_attention_heads``: refused."""
        from headsweep.errors import HeadsweepError
        from headsweep.workers.families.hf_shared.stock import TIED_HEAD_SIZE

        raise HeadsweepError(TIED_HEAD_SIZE.format(name=type(model).__name__,
                                                   how="hidden_size / num_attention_heads"))

    def save_stock(self, model_cfg: Any, loaded: LoadedTransformers, sizes: dict[str, int],
                   out_dir: str | Path) -> None:
        """The ``save_pretrained`` folder (with the tokenizer) of the pruned model whose ``config.json`` states
        ``sizes`` (no ``pruned_heads``): stock ``from_pretrained`` loads it."""
        from headsweep.workers.families.hf_shared.pruning import save_pruned
        from headsweep.workers.families.hf_shared.stock import stock_config

        stock_config(loaded.model, sizes)
        save_pruned(loaded.model, out_dir, loaded.tokenizer)

    def loads_exported(self, folder: str | Path) -> bool:
        from headsweep.workers.families.hf_shared.architecture import exported_architecture

        name = exported_architecture(folder)
        return name is not None and self.exports_architecture(name)

    def exports_architecture(self, name: str) -> bool:
        """Whether a transformers folder whose ``config.json`` names the class ``name`` (``""``: none) is this
        family's."""
        return False

    def check_model(self, model_cfg: Any) -> None:
        """The model folder's files as the workers check them (``model_files.check_model_files``: JSON, safetensors
        headers, PyTorch files' ends) and its tokenizer's (a folder without a vocabulary is named here, not by every
        worker once Ray started)."""
        from headsweep.workers.families.hf_shared.model_files import check_model_files, resolve_model_dir
        from headsweep.workers.families.hf_shared.tokenizer import check_tokenizer_files

        model_dir = resolve_model_dir(model_cfg.path)
        check_model_files(model_dir)
        check_tokenizer_files(*self.tokenizer_folder(model_cfg, model_dir))

    def tokenizer_folder(self, model_cfg: Any, model_dir: Path) -> tuple[Path, str]:
        """The folder of the model's tokenizer and what an error about it ends with (what to do)."""
        return model_dir, ""

    def weight_bytes(self, model_cfg: Any) -> int | None:
        """The weight files' tensors at ``model.dtype`` (``model_files.weight_bytes``); a hub id is read from its
        cached snapshot. None where the folder cannot be read: loading it says why."""
        from headsweep.errors import HeadsweepError
        from headsweep.workers.families.hf_shared.model_files import dtype_bytes, resolve_model_dir, weight_bytes

        dtype_bytes(model_cfg.dtype)  # an unknown dtype is refused here, before Ray starts
        try:
            model_dir = resolve_model_dir(model_cfg.path)
        except HeadsweepError:
            return None
        return weight_bytes(model_dir, model_cfg.dtype)

    def weight_files(self, model_cfg: Any) -> list[Path] | None:
        """The weight files ``from_pretrained`` loads from the folder (a hub id's cached snapshot)."""
        from headsweep.workers.families.hf_shared.model_files import resolve_model_dir, weight_files

        return weight_files(resolve_model_dir(model_cfg.path)) or None

    def attention_weights(self, model: nn.Module, sites: Sequence[AttentionSite],
                          consume: Consumer) -> AbstractContextManager[None]:
        """On the eager attention path (put back as it was afterwards): the weights each module returns."""
        from headsweep.workers.families.hf_shared.attention import transformers_attention

        return transformers_attention(model, sites, consume)
