"""The perplexity corpus: reading its text, and cutting the token sequence into scored windows.

The convention is documented on :class:`~headsweep.workers.families.hf_causal_lm.config.CausalLMData`
and in docs/families.md ("Perplexity: the convention"); :func:`plan_windows` is its one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.workers.data.text_files import check_encoding, check_file, data_file, decode, json_lines, read_bytes
from headsweep.workers.families.hf_causal_lm.config import CausalLMData

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def corpus_format(cfg: CausalLMData) -> str:
    """``data.format``, or the file's suffix (``.gz`` looked through): jsonl, parquet, else text."""
    if cfg.format:
        return cfg.format
    path = Path(cfg.path)
    suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    return SUFFIXES.get(suffix.lower(), "text")


def read_corpus(cfg: CausalLMData, key: str = "data") -> str:
    """The corpus text: a text file as it is, or the ``text_column`` of JSONL / Parquet rows joined by newlines."""
    path = check_file(cfg.path, data_file(key), f"{key}.path")
    fmt = corpus_format(cfg)
    if fmt == "text":
        data, where = read_bytes(path)
        return decode(data, cfg.encoding, f"data file {path}", where=where)
    if fmt == "jsonl":
        return "\n".join(_jsonl_texts(path, cfg))
    return "\n".join(_parquet_texts(path, cfg))


def _jsonl_texts(path: Path, cfg: CausalLMData) -> list[str]:
    data, where = read_bytes(path)
    text = decode(data, cfg.encoding, f"data file {path}", where=where)
    return [_text_of(row, cfg.text_column, f"data file {path}: line {number}")
            for number, row in json_lines(text, f"data file {path}")]


def _parquet_texts(path: Path, cfg: CausalLMData) -> list[str]:
    import pyarrow as pa  # here, not at the top: reading text corpora needs no pyarrow (bench/gpu_check.py)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise HeadsweepError(f"cannot read data file {path} as parquet: {str(exc).splitlines()[0]}") from None
    if cfg.text_column not in table.column_names:
        raise HeadsweepError(f"data file {path} has no column {cfg.text_column!r} (columns: "
                             f"{', '.join(table.column_names)}); set data.text_column")
    codec = check_encoding(cfg.encoding)
    texts = []
    for row, value in enumerate(table.column(cfg.text_column).to_pylist()):
        if isinstance(value, bytes):
            try:
                value = value.decode(codec)
            except UnicodeDecodeError as exc:
                raise HeadsweepError(f"data file {path}: column {cfg.text_column!r} row {row + 1} is not valid "
                                     f"{cfg.encoding} text (byte offset {exc.start} of the value)") from None
        texts.append(_text_of({cfg.text_column: value}, cfg.text_column, f"data file {path}: row {row + 1}"))
    return texts


def _text_of(row: object, column: str, where: str) -> str:
    if not isinstance(row, dict) or column not in row:
        raise HeadsweepError(f"{where} has no field {column!r}; set data.text_column")
    value = row[column]
    if not isinstance(value, str):
        raise HeadsweepError(f"{where}: field {column!r} is {type(value).__name__}, not text")
    return value


@dataclass(frozen=True)
class Window:
    """One window: text tokens ``start .. start + length - 1`` (after the BOS token, if any), of which the
    model input positions ``score_from .. window - 1`` are scored (predicted from the positions before)."""

    start: int
    length: int
    score_from: int

    def scored_tokens(self, bos: bool) -> tuple[int, int]:
        """First and last text token scored (indices into the tokenised corpus)."""
        offset = self.start - (1 if bos else 0)
        return offset + self.score_from, offset + self.length + (1 if bos else 0) - 1


def plan_windows(n_tokens: int, window: int, stride: int | None, add_bos: bool) -> list[Window]:
    """The windows over ``n_tokens`` text tokens.

    A window is ``window`` model positions: ``window`` text tokens, or BOS and ``window - 1`` text
    tokens with ``add_bos``. Windows start every ``stride`` text tokens (default: one window's text,
    no overlap); one that would run past the end is dropped. A window scores each position whose token
    has a token before it in the window (all text tokens with BOS, all but the first without), except
    tokens an earlier window scored already (overlapping windows score only their new tokens).
    """
    text = window - 1 if add_bos else window
    stride = text if stride is None else stride
    if not 1 <= stride <= text:
        raise HeadsweepError(f"data.stride must be between 1 and the window's {text} text tokens, got {stride}")
    offset = 1 if add_bos else 0
    windows = []
    scored_until = 0  # text tokens before this one were scored by an earlier window
    start = 0
    while start + text <= n_tokens:
        # model position p holds text token start + p - offset
        score_from = max(1, scored_until - start + offset)
        windows.append(Window(start, text, score_from))
        scored_until = start + text
        start += stride
    return windows
