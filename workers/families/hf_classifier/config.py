"""Config sections of the ``hf_classifier`` model family (kept free of torch imports)."""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.setting_ranges import MAX_EXAMPLES, check_ranges, ranged
from headsweep.workers.data.text_files import check_encoding

# data.max_length when unset: this many tokens, or the model's maximum positions if it has fewer.
DEFAULT_MAX_LENGTH = 128
# What to do about a model folder without a usable tokenizer (the classifier's tokenizer lives in its folder).
TOKENIZER_HINT = "; save the model's tokenizer into that folder (tokenizer.save_pretrained)"
TASKS = ("classification", "paired")


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

    ``task: paired`` reads clean / corrupted input pairs for activation patching instead: a JSONL file in
    :mod:`headsweep.workers.data.paired_data`'s format, ``answer`` and ``wrong_answer`` labels (names or ids) of the
    model; the metric is ``logit_diff`` (the answer's logit minus the wrong answer's), ``max_examples`` keeps the
    first pairs.
    """

    path: str = ""
    format: str | None = None
    text_column: str = "sentence"
    text_pair_column: str | None = None
    label_column: str = "label"
    id_column: str | None = None
    name: str | None = None
    max_examples: int | None = ranged(None, within=MAX_EXAMPLES)
    max_length: int | None = ranged(None, at_least=1)
    encoding: str = "utf-8"
    task: str = "classification"  # classification | paired

    @property
    def paired(self) -> bool:
        """Whether the data are clean / corrupted input pairs (what ``sweep.ablation: patch`` needs)."""
        return self.task == "paired"

    def check(self, key: str = "data") -> None:
        """What can be checked without the model or the file (the worker checks the rest)."""
        check_encoding(self.encoding, f"{key}.encoding")
        check_ranges(self, key)
        if self.task not in TASKS:
            raise HeadsweepError(f"{key}.task must be {' or '.join(TASKS)}, got {self.task!r}")
        if self.paired:
            if self.format not in (None, "jsonl"):
                raise HeadsweepError(f"{key}.task paired reads JSONL (one pair per line), so {key}.format must be "
                                     f"jsonl or unset, got {self.format!r}")
            defaults = ClassifierData()
            for name in ("text_column", "text_pair_column", "label_column", "id_column"):
                if getattr(self, name) != getattr(defaults, name):
                    raise HeadsweepError(f"{key}.{name} applies to {key}.task classification, not paired (pairs "
                                         "have the fields clean, corrupted, answer and wrong_answer): remove it")
