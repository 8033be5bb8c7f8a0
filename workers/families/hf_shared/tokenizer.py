"""Loading a transformers tokenizer from a local folder, and counting the tokens it could not read.

Given a model folder without its tokenizer files, transformers may still build a tokenizer from
``config.json`` alone: an empty one (BERT: its 5 special tokens, every word ``[UNK]``; GPT-2: one
token, every text no tokens at all). :func:`load_tokenizer` refuses both a folder without tokenizer
files and a tokenizer without a vocabulary. Both transformers families use it.

transformers 5 also overrides the class a folder's ``tokenizer_config.json`` declares when that class is the
generic one (``TokenizersBackend`` / ``PreTrainedTokenizerFast``) and the model type has its own: a word-level
vocabulary saved beside a Qwen2 ``config.json`` comes back as ``Qwen2Tokenizer``, whose byte-level rules turn
every sentence into a token or two, silently. :func:`load_tokenizer` compares the loaded tokenizer with the folder's
``tokenizer.json`` on a probe text and, where they disagree, loads the class the folder declares.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from headsweep.errors import HeadsweepError

# What save_pretrained writes for a tokenizer (fast, or slow with its vocabulary files); a SentencePiece
# ``*.model`` file counts too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt")
# Classes that mean "exactly what tokenizer.json says" in a tokenizer_config.json.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Words, digits, punctuation and a non-ASCII letter: where byte-level and word-level rules part ways.
PROBE = "The cat sat on the mat, 42 times; naïve dogs ran."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_tokenizer_files(folder: str | Path, hint: str = "") -> Path:
    """``folder`` as a path when it holds a tokenizer's vocabulary (``tokenizer.json``, or a slow tokenizer's
    vocabulary files); else a one-line error naming what is missing and ending in ``hint``. Reads no file and imports
    no transformers: the driver checks every model folder so before Ray starts."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise HeadsweepError(f"tokenizer directory not found: {folder}{hint}")
    present = sorted(p.name for p in path.iterdir() if p.is_file())
    if not any(name in TOKENIZER_FILES for name in present) and not any(name.endswith(".model") for name in present):
        raise HeadsweepError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}){hint}")
    if not any(_is_vocabulary(name) for name in present):
        # transformers would fail with "Couldn't instantiate the backend tokenizer from one of: ;", or build a
        # tokenizer of its special tokens alone
        found = ", ".join(name for name in present if name.startswith(("tokenizer", "special_tokens", "added_tokens")))
        raise HeadsweepError(f"no tokenizer vocabulary in {path}: tokenizer.json is missing (of a tokenizer's files "
                             f"the folder has only {found}){hint}")
    return path


def _is_vocabulary(name: str) -> bool:
    """Whether a file of this name holds a tokenizer's vocabulary: the fast tokenizer's ``tokenizer.json``, a slow
    one's ``vocab.*`` / ``merges.txt`` / ``bpe.codes``, or a SentencePiece model (``*.model``, ``*.spm``)."""
    return (name in ("tokenizer.json", "merges.txt", "bpe.codes") or name.startswith("vocab")
            or name.endswith((".model", ".spm")))


def load_tokenizer(folder: str | Path, hint: str = ""):
    """The tokenizer saved in ``folder``, or a one-line error ending in ``hint`` (what to do, e.g. which
    config key names the tokenizer's folder)."""
    from transformers import AutoTokenizer

    path = check_tokenizer_files(folder, hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # Whatever incomplete or foreign files make transformers raise: one line with the cause.
    except Exception as exc:  # noqa: BLE001
        raise HeadsweepError(f"cannot load the tokenizer from {path}: {_first_line(exc)}{hint}") from None
    tokenizer = _as_declared(tokenizer, path)
    special = set(tokenizer.all_special_ids)
    if len(tokenizer) <= len(special):
        raise HeadsweepError(
            f"the tokenizer in {path} has no vocabulary ({len(tokenizer)} tokens, all special: "
            f"{', '.join(tokenizer.all_special_tokens)}): its vocabulary files are missing{hint}"
        )
    return tokenizer


def _declared_class(path: Path) -> str | None:
    import json

    try:
        return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _as_declared(tokenizer, path: Path):
    """``tokenizer``, or the folder's ``tokenizer.json`` loaded as the generic class its config declares where
    transformers chose the model type's class instead and that class reads the probe text differently."""
    declared = _declared_class(path)
    file = path / "tokenizer.json"
    if declared not in GENERIC_CLASSES or type(tokenizer).__name__ in GENERIC_CLASSES or not file.is_file():
        return tokenizer
    from tokenizers import Tokenizer
    from transformers import TokenizersBackend

    saved = Tokenizer.from_file(str(file)).encode(PROBE, add_special_tokens=False).ids
    if tokenizer(PROBE, add_special_tokens=False)["input_ids"] == saved:
        return tokenizer
    import logging

    logging.getLogger(__name__).warning(
        "transformers loaded %s's tokenizer as %s, which reads text differently from its tokenizer.json; "
        "loading it as the %s its tokenizer_config.json declares", path, type(tokenizer).__name__, declared)
    return TokenizersBackend.from_pretrained(path, local_files_only=True)


def count_unknown(tokenizer, sequences: Iterable[Sequence[int]]) -> tuple[int, int]:
    """``(unknown, total)``: tokens of ``sequences`` that are the tokenizer's unknown token, and all tokens
    but the special ones the tokenizer adds (``[CLS]``, ``<s>``, padding...).

    A tokenizer whose "unknown" token is its BOS, EOS or padding token (GPT-2's ``<|endoftext|>``) has no
    unknown token of its own: byte-level BPE reads every text, and ``unknown`` is 0.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    others = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
    if unk in others:
        unk = None
    added = set(tokenizer.all_special_ids) - {unk}
    unknown = total = 0
    for ids in sequences:
        for token in ids:
            if token in added:
                continue
            total += 1
            unknown += token == unk
    return unknown, total


def bos_id(tokenizer) -> int:
    """The tokenizer's BOS token id, which ``data.add_bos`` puts before every window or prompt; refused with one
    line when it has none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise HeadsweepError("data.add_bos is true but the tokenizer has no BOS token (bos_token); "
                             "set data.add_bos: false")
    return int(bos)
