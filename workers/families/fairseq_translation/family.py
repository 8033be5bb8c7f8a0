"""The ``fairseq_translation`` model family: fairseq encoder-decoder Transformers for translation.

Declared here with only its config sections imported: the methods import their modules when
called, so a run over another family never imports fairseq.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.workers.core.family import ModelFamily
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel, TranslationRuntime

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.attention.reader import AttentionReader, Consumer
    from headsweep.workers.core.gates import AttentionSite
    from headsweep.workers.core.head_slicing import HeadSlice
    from headsweep.workers.families.fairseq_translation.model import LoadedTranslation


class TranslationFamily(ModelFamily):
    """fairseq ``TransformerModel`` and relatives (``enc_self``, ``enc_dec`` and ``dec_self`` heads)."""

    def check_data(self, data_cfg: TranslationData, key: str = "data") -> None:
        """The settings and the files (raw text read and decoded; a data-bin split's files present)."""
        from headsweep.workers.families.fairseq_translation.data import check_data

        check_data(data_cfg, key)

    def load_model(self, model_cfg: TranslationModel) -> LoadedTranslation:
        from headsweep.workers.families.fairseq_translation.model import load_model

        loaded = load_model(model_cfg)
        loaded.model.eval()
        return loaded

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.fairseq_translation.sites import find_fairseq_sites, has_layer_stacks

        return find_fairseq_sites(model) if has_layer_stacks(model) else []

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.fairseq_translation.pruning import prune_fairseq_heads

        return prune_fairseq_heads(model, heads)

    def save_pruned(self, model_cfg: TranslationModel, loaded: LoadedTranslation, heads: Sequence[Head],
                    out_dir: str | Path) -> None:
        """``checkpoint.pt`` (removed heads under ``headsweep_pruned_heads``) with the model's dictionaries."""
        from headsweep.workers.families.fairseq_translation.checkpoint import read_checkpoint
        from headsweep.workers.families.fairseq_translation.pruning import copy_dictionaries, save_pruned_checkpoint

        state = read_checkpoint(model_cfg.checkpoint, model_cfg.trusted)
        save_pruned_checkpoint(state, loaded.model, heads, Path(out_dir) / "checkpoint.pt")
        copy_dictionaries(model_cfg.data_bin, [loaded.source_lang, loaded.target_lang], out_dir)

    def attention_weights(self, model: nn.Module, sites: Sequence[AttentionSite],
                          consume: Consumer) -> AbstractContextManager[None]:
        """Each ``MultiheadAttention`` off its fused path, asked for per-head weights (its caller still gets what
        it asked for)."""
        from headsweep.workers.families.fairseq_translation.attention import fairseq_attention

        return fairseq_attention(sites, consume)

    def attention_reader(self, adapter: Any) -> AttentionReader:
        from headsweep.workers.families.fairseq_translation.attention import TranslationReader

        return TranslationReader(adapter)

    def weight_bytes(self, model_cfg: TranslationModel) -> int | None:
        """The checkpoint file's size: ``torch.load`` reads all of it (an optimizer state saved with the model
        included) before the model is built from it, in the dtype it was saved in (there is no ``model.dtype``)."""
        checkpoint = Path(model_cfg.checkpoint)
        return checkpoint.stat().st_size if checkpoint.is_file() else None

    def weight_files(self, model_cfg: TranslationModel) -> list[Path] | None:
        """The checkpoint file (the model, its options and whatever else it was saved with)."""
        checkpoint = Path(model_cfg.checkpoint)
        return [checkpoint] if checkpoint.is_file() else None

    def training_label_smoothing(self, model_cfg: TranslationModel) -> float | None:
        """The label smoothing stored with the checkpoint's criterion options."""
        from headsweep.workers.families.fairseq_translation.checkpoint import trained_label_smoothing

        return trained_label_smoothing(model_cfg.checkpoint)


FAIRSEQ_TRANSLATION = TranslationFamily("fairseq_translation", TranslationModel, TranslationData,
                                        "headsweep.workers.families.fairseq_translation.adapter:load_translation",
                                        checkpoint_key="checkpoint", batches_by_tokens=True,
                                        syntax_attention="enc_self", fills_by_position=False,
                                        resample_attention=("enc_self",), runtime_options=TranslationRuntime)
