"""Config sections of the ``hf_classifier`` model family (kept free of torch imports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClassifierModel:
    """A transformers sequence classifier saved on disk (``save_pretrained`` directory)."""

    kind: str = "hf_classifier"
    path: str = ""
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"


@dataclass
class ClassifierData:
    """A labelled classification file: TSV, CSV, JSONL or Parquet."""

    path: str = ""
    format: str | None = None
    text_column: str = "sentence"
    text_pair_column: str | None = None
    label_column: str = "label"
    id_column: str | None = None
    name: str | None = None
    max_examples: int | None = None
    max_length: int = 128
