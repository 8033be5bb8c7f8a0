"""Language codes and task prefixes of multilingual encoder-decoder models, from the model folder's files alone.

NLLB-200, M2M100 and mBART-50 read the source language from the tokenizer (``src_lang``, a code token the tokenizer
puts in every source) and are forced to start their output with the target language's code
(``forced_bos_token_id``). mBART's first models (``MBartTokenizer``: mbart-large-cc25 and its fine-tuned pairs such
as mbart-large-en-ro) start decoding from the target code instead (``decoder_start_token_id``, as their configs'
``translation_en_to_ro`` settings say): forcing it after their start would put it in twice. Without the codes such a
model translates from and into whatever its tokenizer's defaults are, so :func:`check_language_codes` refuses a config
that leaves them unset (on the driver, from ``tokenizer_config.json`` and ``config.json``, before Ray starts). T5
takes its task as a text prefix (``model.prefix``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

# Tokenizer classes (as tokenizer_config.json names them, without "Fast") and model types that need the codes.
MULTILINGUAL_TOKENIZERS = ("NllbTokenizer", "M2M100Tokenizer", "MBartTokenizer", "MBart50Tokenizer")
MULTILINGUAL_TYPES = ("m2m_100", "nllb-moe", "nllb_moe")
# Tokenizers whose models start decoding from the target language's code rather than generate it first.
DECODER_START_TOKENIZERS = ("MBartTokenizer",)
EXAMPLES = {"NllbTokenizer": "eng_Latn / fra_Latn", "M2M100Tokenizer": "en / fr", "MBartTokenizer": "en_XX / fr_XX",
            "MBart50Tokenizer": "en_XX / fr_XX"}


@dataclass(frozen=True)
class TargetStart:
    """How generation starts with the target language's code: the generation setting that holds it, and its id."""

    setting: str  # "forced_bos_token_id" or "decoder_start_token_id"
    token_id: int


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def multilingual_kind(model_dir: Path, tokenizer_dir: Path) -> str | None:
    """The multilingual tokenizer class (or model type) the folders declare, or None for a one-pair model."""
    declared = str(_json(tokenizer_dir / "tokenizer_config.json").get("tokenizer_class") or "").removesuffix("Fast")
    if declared in MULTILINGUAL_TOKENIZERS:
        return declared
    model_type = _json(model_dir / "config.json").get("model_type")
    return str(model_type) if model_type in MULTILINGUAL_TYPES else None


def check_language_codes(model_dir: Path, tokenizer_dir: Path, source_lang: str | None,
                         target_lang: str | None) -> str | None:
    """Refuse (one line) a multilingual model without ``model.source_lang`` and ``model.target_lang``; returns its
    kind (None for a one-pair model)."""
    kind = multilingual_kind(model_dir, tokenizer_dir)
    if kind is not None and (not source_lang or not target_lang):
        missing = " and ".join(k for k, v in (("model.source_lang", source_lang), ("model.target_lang", target_lang))
                               if not v)
        example = EXAMPLES.get(kind, "the codes its tokenizer lists")
        raise HeadsweepError(f"{model_dir} is a multilingual model ({kind}): set {missing} to the language codes its "
                             f"tokenizer knows (e.g. {example}), or it translates between whatever languages its "
                             "defaults name")
    return kind


def apply_language_codes(tokenizer: Any, source_lang: str | None, target_lang: str | None) -> TargetStart | None:
    """Set the tokenizer's source (and target) language; returns how generation starts with the target code (None
    where no target code is set). A code the tokenizer does not know is refused in one line."""
    if not source_lang and not target_lang:
        return None
    if not hasattr(tokenizer, "src_lang"):
        raise HeadsweepError(f"model.source_lang / model.target_lang are set, but the tokenizer "
                             f"({type(tokenizer).__name__}) takes no language codes: remove them (a T5 model takes "
                             "its task as model.prefix)")
    ids: dict[str, int] = {}
    for key, code in (("model.source_lang", source_lang), ("model.target_lang", target_lang)):
        if code is None:
            continue
        token_id = _code_id(tokenizer, code)
        if token_id is None:
            raise HeadsweepError(f"{key} {code!r} is not a language code of the model's tokenizer "
                                 f"({type(tokenizer).__name__})")
        ids[key] = token_id
    if source_lang:
        tokenizer.src_lang = source_lang
    if target_lang:
        if hasattr(tokenizer, "tgt_lang"):
            tokenizer.tgt_lang = target_lang
        starts = type(tokenizer).__name__.removesuffix("Fast") in DECODER_START_TOKENIZERS
        return TargetStart("decoder_start_token_id" if starts else "forced_bos_token_id", ids["model.target_lang"])
    return None


def _code_id(tokenizer: Any, code: str) -> int | None:
    """The token id of a language code: M2M100's ``__en__`` through ``get_lang_id``, else the code as a token."""
    getter = getattr(tokenizer, "get_lang_id", None)
    if callable(getter):
        try:
            return int(getter(code))
        except (KeyError, ValueError):
            return None
    token_id = tokenizer.convert_tokens_to_ids(code)
    return None if token_id is None or token_id == tokenizer.unk_token_id else int(token_id)
