"""Config sections of the ``hf_classifier`` model family (kept free of torch imports)."""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.text_files import check_encoding

# data.max_length when unset: this many tokens, or the model's maximum positions if it has fewer.
DEFAULT_MAX_LENGTH = 128


@dataclass
class ClassifierModel:
    """A transformers sequence classifier saved on disk (``save_pretrained`` directory)."""

    kind: str = "hf_classifier"
    path: str = ""
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"


@dataclass
class ClassifierData:
    """A labelled classification file: TSV, CSV, JSONL or Parquet.

    ``encoding`` is the text encoding of a TSV, CSV or JSONL file (and of Parquet ``binary``
    columns); a byte it cannot decode stops the run with the file, line and byte offset.
    ``max_length`` (tokens per example; longer examples are truncated and counted) may not exceed
    the model's maximum positions; unset, it is 128 or the model's maximum if that is smaller.
    """

    path: str = ""
    format: str | None = None
    text_column: str = "sentence"
    text_pair_column: str | None = None
    label_column: str = "label"
    id_column: str | None = None
    name: str | None = None
    max_examples: int | None = None
    max_length: int | None = None
    encoding: str = "utf-8"

    def check(self, key: str = "data") -> None:
        """What can be checked without the model or the file (the worker checks the rest)."""
        check_encoding(self.encoding, f"{key}.encoding")
        if self.max_length is not None and self.max_length < 1:
            raise HeadsweepError(f"{key}.max_length must be at least 1, got {self.max_length}")
