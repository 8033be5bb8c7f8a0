"""Translation evaluation data: raw parallel text or a binarised split, as token ids and references.

Text becomes tokens the way ``fairseq-interactive`` does it (word tokenizer, then BPE, then
the dictionary), and tokens become text the way ``fairseq-generate`` does it (dictionary
string with ``--post-process``, then detokenisation), with fairseq's own encoder classes.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.workers.data.data_report import UNKNOWN_SHARE_WARN, Finding
from headsweep.workers.data.text_files import check_file, check_max_examples, parallel_set_name, read_text, split_lines
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

if TYPE_CHECKING:  # the driver checks the data files (check_data) without torch
    import torch

logger = logging.getLogger(__name__)

# fairseq's --post-process values (fairseq.data.data_utils.post_process).
POST_PROCESS = ("subword_nmt", "sentencepiece", "@@ ", "@@", "wordpiece", "letter", "silence", "_EOW", "none")
DETOKENIZERS = ("none", "moses")
# Above UNK_WARN of unknown tokens (the threshold every family warns at) the data are probably not what
# the model was trained on; above UNK_ERROR translation refuses them.
UNK_WARN = UNKNOWN_SHARE_WARN
UNK_ERROR = 0.50


def resolve_post_process(model_cfg: TranslationModel, data_cfg: TranslationData) -> str | None:
    """``model.remove_bpe``, or the one implied by the data's BPE model when it is unset."""
    if model_cfg.remove_bpe is not None:
        if model_cfg.remove_bpe not in POST_PROCESS:
            raise HeadsweepError(
                f"model.remove_bpe {model_cfg.remove_bpe!r} is not a fairseq post-process option "
                f"(one of: {', '.join(POST_PROCESS)}, or null)"
            )
        return model_cfg.remove_bpe
    if data_cfg.sentencepiece_model:
        return "sentencepiece"
    if data_cfg.bpe_codes:
        return "subword_nmt"
    return None


class TextPipeline:
    """Encode raw text into dictionary ids and decode ids into detokenised text."""

    def __init__(self, model_cfg: TranslationModel, data_cfg: TranslationData, src_dict, tgt_dict,
                 source_lang: str, target_lang: str):
        if model_cfg.detokenize not in DETOKENIZERS:
            raise HeadsweepError(f"model.detokenize must be one of {', '.join(DETOKENIZERS)}, "
                                 f"got {model_cfg.detokenize!r}")
        if data_cfg.bpe_codes and data_cfg.sentencepiece_model:
            raise HeadsweepError("set at most one of data.bpe_codes (subword-nmt) and data.sentencepiece_model")
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.post_process = resolve_post_process(model_cfg, data_cfg)
        self.tokenizers = {}
        if model_cfg.detokenize == "moses":
            self.tokenizers = {lang: _moses(lang) for lang in {source_lang, target_lang}}
        self.source_lang, self.target_lang = source_lang, target_lang
        self.bpe = _bpe(data_cfg)

    def encode(self, line: str, side: str) -> torch.Tensor:
        """Ids of one raw sentence on ``side`` ("source" or "target"), ending in EOS."""
        lang, dictionary = (self.source_lang, self.src_dict) if side == "source" else (self.target_lang, self.tgt_dict)
        text = line.strip()
        if lang in self.tokenizers:
            text = self.tokenizers[lang].encode(text)
        if self.bpe is not None:
            text = self.bpe.encode(text)
        return dictionary.encode_line(text, add_if_not_exist=False, append_eos=True).long()

    def decode(self, tokens: torch.Tensor) -> str:
        """Detokenised text of target-side ids (EOS and padding dropped)."""
        text = self.tgt_dict.string(tokens.int().cpu(), self.post_process)
        if self.target_lang in self.tokenizers:
            text = self.tokenizers[self.target_lang].decode(text)
        return text


def _moses(lang: str):
    try:
        from fairseq.data.encoders.moses_tokenizer import MosesTokenizer, MosesTokenizerConfig

        # One instance per language: it tokenises and detokenises that language.
        return MosesTokenizer(MosesTokenizerConfig(source_lang=lang, target_lang=lang))
    except ImportError:
        raise HeadsweepError("model.detokenize=moses needs the sacremoses package (pip install sacremoses)") from None


def _bpe(data_cfg: TranslationData):
    if data_cfg.bpe_codes:
        path = _existing(data_cfg.bpe_codes, "data.bpe_codes")
        try:
            from fairseq.data.encoders.subword_nmt_bpe import SubwordNMTBPE, SubwordNMTBPEConfig

            return SubwordNMTBPE(SubwordNMTBPEConfig(bpe_codes=str(path)))
        except ImportError:
            raise HeadsweepError("data.bpe_codes needs the subword-nmt package (pip install subword-nmt)") from None
    if data_cfg.sentencepiece_model:
        path = _existing(data_cfg.sentencepiece_model, "data.sentencepiece_model")
        try:
            from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE, SentencepieceConfig

            return SentencepieceBPE(SentencepieceConfig(sentencepiece_model=str(path)))
        except ImportError:
            raise HeadsweepError(
                "data.sentencepiece_model needs the sentencepiece package (pip install sentencepiece)"
            ) from None
    return None


def _existing(path: str, key: str) -> Path:
    try:
        return check_file(path, "file", key)
    except HeadsweepError as exc:
        raise HeadsweepError(f"{key}: {exc}") from None


def read_lines(path: str | Path, key: str, encoding: str = "utf-8") -> list[str]:
    """Lines of a text file, plain or gzip, decoded strictly with ``encoding``, without their line endings."""
    p = _existing(str(path), key)
    return split_lines(read_text(p, encoding))


@dataclass
class ParallelExamples:
    """An evaluation set as token ids (each ending in EOS) with its references."""

    name: str
    ids: list[str]
    source: list[torch.Tensor]
    target: list[torch.Tensor]
    references: list[str]
    unk_rate_source: float
    unk_rate_target: float
    # Where the examples come from, for messages: example i is ``<unit> <i + 1>`` of these files (counted from 1,
    # as every data message counts); binarised sentences also by fairseq's id, which counts from 0 (``S-0``).
    source_file: str = ""
    target_file: str = ""
    unit: str = "line"

    def where(self, i: int) -> str:
        """Example ``i`` as messages name it: ``line 3``, or ``sentence 3 (fairseq id 2)``."""
        return f"{self.unit} {i + 1}" + (f" (fairseq id {i})" if self.unit == "sentence" else "")


def load_examples(data_cfg: TranslationData, pipeline: TextPipeline) -> ParallelExamples:
    """Read the configured evaluation set and check how much of it the dictionaries cover."""
    has_text = bool(data_cfg.source or data_cfg.target)
    if has_text and data_cfg.data_bin:
        raise HeadsweepError("set either data.source/data.target (raw text) or data.data_bin (binarised), not both")
    if has_text:
        examples = _from_text(data_cfg, pipeline)
    elif data_cfg.data_bin:
        examples = _from_data_bin(data_cfg, pipeline)
    else:
        raise HeadsweepError(
            "config needs data.source and data.target (raw text files) or data.data_bin and data.split (binarised)"
        )
    if not examples.ids:
        raise HeadsweepError(f"evaluation set {examples.name!r} has no sentences")
    _check_unknowns(examples, pipeline)
    return examples


def _from_text(data_cfg: TranslationData, pipeline: TextPipeline) -> ParallelExamples:
    src, tgt = read_parallel_text(data_cfg)
    n = len(src)
    name = data_cfg.name or parallel_set_name(Path(data_cfg.source))
    s_ids = [pipeline.encode(line, "source") for line in src]
    t_ids = [pipeline.encode(line, "target") for line in tgt]
    return ParallelExamples(
        name=name,
        ids=[str(i) for i in range(n)],
        source=s_ids,
        target=t_ids,
        references=[line.strip() for line in tgt],
        unk_rate_source=_unk_rate(s_ids, pipeline.src_dict),
        unk_rate_target=_unk_rate(t_ids, pipeline.tgt_dict),
        source_file=f"data.source {data_cfg.source}",
        target_file=f"data.target {data_cfg.target}",
    )


def check_data(data_cfg: TranslationData, key: str = "data") -> None:
    """Everything a translation data section (config key ``key``) says that needs no model: its settings, the
    files it names, and raw parallel text itself (decoded, line-aligned, not empty)."""
    data_cfg.check()
    check_max_examples(data_cfg.max_examples, f"{key}.max_examples")
    if data_cfg.bpe_codes:
        _existing(data_cfg.bpe_codes, f"{key}.bpe_codes")
    if data_cfg.sentencepiece_model:
        _existing(data_cfg.sentencepiece_model, f"{key}.sentencepiece_model")
    if data_cfg.source or data_cfg.target:
        if data_cfg.data_bin:
            raise HeadsweepError(f"set either {key}.source/{key}.target (raw text) or {key}.data_bin (binarised), "
                                 "not both")
        if not read_parallel_text(data_cfg, key)[0]:
            raise HeadsweepError(f"{key}.source {data_cfg.source} has no sentences")
    elif not data_cfg.data_bin:
        raise HeadsweepError(f"config needs {key}.source and {key}.target (raw text files) or {key}.data_bin and "
                             f"{key}.split (binarised)")
    elif not Path(data_cfg.data_bin).is_dir():
        raise HeadsweepError(f"{key}.data_bin folder not found: {data_cfg.data_bin}")


def read_parallel_text(data_cfg: TranslationData, key: str = "data") -> tuple[list[str], list[str]]:
    """The source and target lines of raw parallel text, checked to be line-aligned, cut to ``max_examples``."""
    if not data_cfg.source or not data_cfg.target:
        raise HeadsweepError(f"raw-text data need both {key}.source and {key}.target")
    src = read_lines(data_cfg.source, f"{key}.source", data_cfg.encoding)
    tgt = read_lines(data_cfg.target, f"{key}.target", data_cfg.encoding)
    if len(src) != len(tgt):
        raise HeadsweepError(
            f"{key}.source has {len(src)} lines but {key}.target has {len(tgt)}: they must be line-aligned"
        )
    n = len(src) if data_cfg.max_examples is None else min(len(src), data_cfg.max_examples)
    return src[:n], tgt[:n]


def _from_data_bin(data_cfg: TranslationData, pipeline: TextPipeline) -> ParallelExamples:
    from fairseq.data import Dictionary, data_utils

    folder = Path(data_cfg.data_bin)
    if not folder.is_dir():
        raise HeadsweepError(f"data.data_bin folder not found: {folder}")
    src, tgt, split = pipeline.source_lang, pipeline.target_lang, data_cfg.split
    for lang, model_dict in ((src, pipeline.src_dict), (tgt, pipeline.tgt_dict)):
        dict_file = folder / f"dict.{lang}.txt"
        if dict_file.is_file() and Dictionary.load(str(dict_file)).symbols != model_dict.symbols:
            raise HeadsweepError(
                f"{dict_file} differs from the model's dictionary: token ids in {folder} would mean other words"
            )
    for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
        if (folder / f"{split}.{pair}.{src}.idx").is_file():
            break
    else:
        raise HeadsweepError(
            f"no binarised split {split!r} for {src}->{tgt} in {folder} "
            f"(expected {split}.{src}-{tgt}.{src}.bin/.idx)"
        )
    datasets = []
    for lang, dictionary in ((src, pipeline.src_dict), (tgt, pipeline.tgt_dict)):
        ds = data_utils.load_indexed_dataset(str(folder / f"{split}.{pair}.{lang}"), dictionary)
        if ds is None:
            raise HeadsweepError(f"cannot read binarised data {folder / f'{split}.{pair}.{lang}'}")
        datasets.append(ds)
    if len(datasets[0]) != len(datasets[1]):
        raise HeadsweepError(f"split {split!r} in {folder}: source and target have different sentence counts")
    n = len(datasets[0]) if data_cfg.max_examples is None else min(len(datasets[0]), data_cfg.max_examples)
    s_ids = [datasets[0][i].long() for i in range(n)]
    t_ids = [datasets[1][i].long() for i in range(n)]
    return ParallelExamples(
        name=data_cfg.name or f"{folder.name}:{split}",
        ids=[str(i) for i in range(n)],
        source=s_ids,
        target=t_ids,
        references=[pipeline.decode(t) for t in t_ids],
        unk_rate_source=_unk_rate(s_ids, pipeline.src_dict),
        unk_rate_target=_unk_rate(t_ids, pipeline.tgt_dict),
        source_file=f"{folder / f'{split}.{pair}.{src}'}",
        target_file=f"{folder / f'{split}.{pair}.{tgt}'}",
        unit="sentence",
    )


def _unk_rate(seqs: list[torch.Tensor], dictionary) -> float:
    # EOS is not a word of the sentence; leave it out of the rate.
    total = sum(max(0, len(s) - 1) for s in seqs)
    unk = sum(int((s == dictionary.unk()).sum()) for s in seqs)
    return unk / total if total else 0.0


def _check_unknowns(ex: ParallelExamples, pipeline: TextPipeline) -> None:
    side, rate = max((("source", ex.unk_rate_source), ("target", ex.unk_rate_target)), key=lambda x: x[1])
    hint = ("check data.source/data.target languages, model.detokenize and the BPE settings "
            "(data.bpe_codes / data.sentencepiece_model) against how the model's training data were prepared")
    if rate > UNK_ERROR:
        raise HeadsweepError(
            f"{rate:.0%} of the {side} tokens of {ex.name!r} are unknown to the model's dictionary: {hint}"
        )
    if rate > UNK_WARN:
        message = f"{rate:.1%} of the {side} tokens of {ex.name!r} are unknown to the model's dictionary; {hint}"
        logger.warning(message)
        warnings.warn(message, stacklevel=3)


def check_lengths(ex: ParallelExamples, max_positions: object) -> tuple[int | None, int | None]:
    """Refuse sentences longer than the model's source or target positions (``model.max_positions()``),
    as fairseq-generate does; returns the two limits (None where the model sets none)."""
    limits = tuple(max_positions) if isinstance(max_positions, (tuple, list)) else (max_positions, max_positions)
    limits = tuple(int(x) if isinstance(x, (int, float)) and x > 0 else None for x in limits[:2])
    for side, seqs, limit, where in (("source", ex.source, limits[0], ex.source_file),
                                     ("target", ex.target, limits[1], ex.target_file)):
        long = [i for i, s in enumerate(seqs) if limit is not None and len(s) > limit]
        if long:
            i = long[0]
            more = f" ({len(long)} {ex.unit}s in all)" if len(long) > 1 else ""
            raise HeadsweepError(
                f"{where}: {ex.where(i)} is {len(seqs[i])} tokens long (after BPE, with EOS), more than "
                f"the model's {limit} {side} positions{more}: shorten or remove it (fairseq-generate refuses it too)"
            )
    return limits


def findings(ex: ParallelExamples) -> list[Finding]:
    """Sentence pairs that look wrong but are evaluated as they are: an empty source or target
    (nothing but the EOS every sentence ends in), and a source that repeats an earlier one."""
    empty_source = Finding("empty_sources", "empty source sentences")
    empty_target = Finding("empty_targets", "empty target sentences")
    repeated = Finding("duplicate_sources", "repeated source sentences")
    seen: set[tuple[int, ...]] = set()
    for example_id, s, t in zip(ex.ids, ex.source, ex.target, strict=True):
        if len(s) <= 1:
            empty_source.ids.append(example_id)
        if len(t) <= 1:
            empty_target.ids.append(example_id)
        key = tuple(s.tolist())
        if key in seen:
            repeated.ids.append(example_id)
        seen.add(key)
    return [empty_source, empty_target, repeated]


def data_subject(data_cfg: TranslationData) -> str:
    """How a warning names the evaluation data."""
    if data_cfg.source:
        return f"data {data_cfg.source} / {data_cfg.target}"
    return f"data {data_cfg.data_bin} split {data_cfg.split!r}"
