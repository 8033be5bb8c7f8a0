"""The ``hf_seq2seq`` model family: transformers encoder-decoder models for translation and summarisation.

Declared here with only its config sections imported: the methods import their modules when called, so reading
configs never imports transformers. What it shares with the other transformers families (model folder checks, weight
sizes and files, attention weights) is :class:`~headsweep.workers.families.hf_shared.family.TransformersFamily`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.workers.families.hf_seq2seq.config import Seq2SeqData, Seq2SeqModel, Seq2SeqRuntime
from headsweep.workers.families.hf_shared.family import TransformersFamily

if TYPE_CHECKING:
    from torch import nn

    from headsweep.workers.core.gates import AttentionSite
    from headsweep.workers.core.head_slicing import HeadSlice
    from headsweep.workers.core.heads import Head, SiteKey
    from headsweep.workers.families.hf_shared.loading import LoadedTransformers


# Sinusoidal position tables transformers builds when it loads a model and never saves, by model type: the rows
# beyond max_position_embeddings (M2M100 / NLLB offset their positions by 2). Marian's are parameters, M2M100's
# buffers: memory a worker holds that no weight file counts. (Pegasus saves its tables.)
UNSAVED_POSITION_ROWS = {"marian": 0, "m2m_100": 2}


class Seq2SeqFamily(TransformersFamily):
    """Marian, M2M100 / NLLB, mBART, BART, Pegasus, T5 / mT5 (``enc_self``, ``enc_dec`` and ``dec_self`` heads),
    evaluated by beam search (``model.generate``) and BLEU or chrF. Physical pruning and export of BART-style and
    T5-style attention (:mod:`~headsweep.workers.families.hf_seq2seq.pruning`; FSMT and UMT5 refused in one line);
    resample ablation on ``enc_self`` heads only, as ``fairseq_translation`` (a donor's decoder states follow its own
    hypotheses); LRP importance on BART-style and T5-style models, explaining the teacher-forced top-1 logits of the
    reference tokens (FSMT, PegasusX and mixture-of-experts types refused in one line: :mod:`.relevance`)."""

    def check_data(self, data_cfg: Seq2SeqData, key: str = "data") -> None:
        """The settings and the pairs themselves, before Ray starts: raw parallel text decoded, line-aligned and not
        empty, or every line of a TSV / JSONL file a pair with a non-empty source and target."""
        from headsweep.workers.data.text_files import check_max_examples
        from headsweep.workers.families.hf_seq2seq.data import read_seq2seq_data

        data_cfg.check(key)
        check_max_examples(data_cfg.max_examples, f"{key}.max_examples")
        read_seq2seq_data(data_cfg, key)

    def check_model(self, model_cfg: Seq2SeqModel) -> None:
        """The folder's files and tokenizer (as the other transformers families), its ``config.json`` against this
        family, and the language codes a multilingual model needs, before Ray starts."""
        import json

        from headsweep.workers.families.hf_seq2seq.languages import check_language_codes
        from headsweep.workers.families.hf_shared.architecture import SEQ2SEQ, check_architecture
        from headsweep.workers.families.hf_shared.model_files import resolve_model_dir

        super().check_model(model_cfg)
        model_dir = resolve_model_dir(model_cfg.path)
        check_architecture(model_dir, json.loads((model_dir / "config.json").read_text()), SEQ2SEQ)
        check_language_codes(model_dir, self.tokenizer_folder(model_cfg, model_dir)[0], model_cfg.source_lang,
                             model_cfg.target_lang)

    def weight_bytes(self, model_cfg: Seq2SeqModel) -> int | None:
        """The weight files' tensors (as the other transformers families), plus the encoder's and decoder's
        sinusoidal position tables of the model types that build them at load (:data:`UNSAVED_POSITION_ROWS`)."""
        import json

        from headsweep.workers.families.hf_shared.model_files import dtype_bytes, resolve_model_dir

        total = super().weight_bytes(model_cfg)
        if total is None:
            return None
        config = json.loads((resolve_model_dir(model_cfg.path) / "config.json").read_text())
        extra_rows = UNSAVED_POSITION_ROWS.get(config.get("model_type"))
        if extra_rows is None:
            return total
        rows = int(config.get("max_position_embeddings") or 0) + extra_rows
        return total + 2 * rows * int(config.get("d_model") or 0) * dtype_bytes(model_cfg.dtype)

    def tokenizer_folder(self, model_cfg: Seq2SeqModel, model_dir: Path) -> tuple[Path, str]:
        from headsweep.workers.families.hf_seq2seq.model import tokenizer_folder

        return tokenizer_folder(model_cfg, model_dir)

    def load_model(self, model_cfg: Seq2SeqModel) -> LoadedTransformers:
        from headsweep.workers.families.hf_seq2seq.model import load_seq2seq

        return load_seq2seq(model_cfg, "cpu")

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        from headsweep.workers.families.hf_seq2seq.sites import find_seq2seq_sites

        return find_seq2seq_sites(model)

    def owns(self, model: nn.Module) -> bool:
        """An encoder-decoder model (``config.is_encoder_decoder``) with encoder-decoder attention sites."""
        if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return any(site.attention == "enc_dec" for site in self.find_sites(model))

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        from headsweep.workers.families.hf_seq2seq.pruning import prune_seq2seq_heads

        return prune_seq2seq_heads(model, heads)

    def stock_sizes(self, model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
        """T5-style configs state ``num_heads`` apart from ``d_kv``; BART-style ones derive the head size (refused):
        :func:`~headsweep.workers.families.hf_seq2seq.pruning.stock_sizes`."""
        from headsweep.workers.families.hf_seq2seq.pruning import stock_sizes

        return stock_sizes(model, heads)

    def exports_architecture(self, name: str) -> bool:
        from headsweep.workers.families.hf_shared.architecture import is_seq2seq_architecture

        return is_seq2seq_architecture(name)

    def load_exported(self, folder: str | Path) -> nn.Module:
        from headsweep.workers.families.hf_seq2seq.pruning import load_pruned

        return load_pruned(folder)

    def attention_weights(self, model: nn.Module, sites: Sequence[AttentionSite], consume: Any) -> Any:
        """On the eager attention path (put back afterwards): the weights each module returns
        (:func:`~headsweep.workers.families.hf_seq2seq.attention.seq2seq_attention`). Relevance propagation enters it,
        so a model whose blocks the LRP rules do not cover (PegasusX, T5Gemma:
        :mod:`.relevance`) is refused here in one line."""
        from headsweep.errors import HeadsweepError
        from headsweep.workers.families.hf_seq2seq.attention import seq2seq_attention
        from headsweep.workers.families.hf_seq2seq.relevance import relevance_problem

        problem = relevance_problem(model)
        if problem is not None:
            raise HeadsweepError(problem)
        return seq2seq_attention(model, sites, consume)

    def attention_reader(self, adapter: Any) -> Any:
        """Teacher-forced attention maps of every site (:mod:`.attention`): what roles reads."""
        from headsweep.workers.families.hf_seq2seq.attention import Seq2SeqReader

        return Seq2SeqReader(adapter)


HF_SEQ2SEQ = Seq2SeqFamily("hf_seq2seq", Seq2SeqModel, Seq2SeqData,
                           "headsweep.workers.families.hf_seq2seq.adapter:load_seq2seq_adapter",
                           hub_ids=True, fills_by_position=False, resample_attention=("enc_self",),
                           runtime_options=Seq2SeqRuntime)
