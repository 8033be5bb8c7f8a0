"""Config sections of the ``hf_causal_lm`` model family (kept free of torch imports)."""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.text_files import check_encoding

# data.window when unset: this many tokens, or the model's maximum positions if it has fewer.
DEFAULT_WINDOW = 512


@dataclass
class CausalLMModel:
    """A transformers causal language model saved on disk (``save_pretrained`` directory).

    ``tokenizer`` is a folder with the tokenizer files when they are not in ``path``.
    """

    kind: str = "hf_causal_lm"
    path: str = ""
    tokenizer: str | None = None
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"


@dataclass
class CausalLMData:
    """A text corpus scored by perplexity: plain text (``.txt``, or anything else; ``.gz`` is
    gunzipped), or JSONL / Parquet with the text in ``text_column`` (``format`` overrides the suffix).

    The convention (it is what makes numbers comparable with published ones): the file's text as it
    is (JSONL and Parquet rows joined by newlines) is tokenised once, without special tokens; windows
    of ``window`` tokens (what the model sees, a BOS token included) are cut from it, ``stride``
    tokens apart (default: no overlap), the last partial window dropped; each window scores its
    tokens after the first, and with ``stride`` below the window only the tokens no earlier window
    scored. ``add_bos`` puts the tokenizer's BOS token at the start of every window (unscored; the
    window then takes ``window - 1`` text tokens, all scored). ``max_windows`` keeps the first windows.
    """

    path: str = ""
    format: str | None = None  # text | jsonl | parquet; None: from the suffix
    text_column: str = "text"
    name: str | None = None
    window: int | None = None
    stride: int | None = None
    add_bos: bool = False
    max_windows: int | None = None
    encoding: str = "utf-8"

    def check(self) -> None:
        """What can be checked without the model or the file (the worker checks the rest)."""
        check_encoding(self.encoding)
        if not self.path:
            raise HeadsweepError("config key 'data.path' is required (a text, JSONL or Parquet file)")
        if self.format not in (None, "text", "jsonl", "parquet"):
            raise HeadsweepError(f"data.format must be text, jsonl or parquet, got {self.format!r}")
        if self.window is not None and self.window < 2:
            raise HeadsweepError(f"data.window must be at least 2 tokens (one to condition on, one to score), "
                                 f"got {self.window}")
        if self.stride is not None and self.stride < 1:
            raise HeadsweepError(f"data.stride must be at least 1, got {self.stride}")
        if self.max_windows is not None and self.max_windows < 1:
            raise HeadsweepError(f"data.max_windows must be at least 1, got {self.max_windows}")
