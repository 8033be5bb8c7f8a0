"""Config sections of the ``fairseq_translation`` model family (kept free of torch imports).

Defaults follow ``fairseq-generate``: beam 5, length penalty 1, maximum length
``max_len_a * source_length + max_len_b`` with a=0, b=200.
"""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.setting_ranges import MAX_EXAMPLES, ranged
from headsweep.workers.data.text_files import check_encoding

# fairseq-generate's usual --max-tokens for evaluation (see docs/families.md, "fairseq translation").
DEFAULT_MAX_TOKENS = 6000


@dataclass
class TranslationModel:
    """A fairseq translation checkpoint and how to decode with it.

    ``data_bin`` is the folder holding the model's ``dict.<src>.txt`` and ``dict.<tgt>.txt``.
    ``trusted`` allows loading a checkpoint that holds pickled Python objects (most fairseq
    checkpoints do: argparse / omegaconf objects), which ``torch.load`` can only read with
    ``weights_only=False``, i.e. by running code from the file. ``remove_bpe`` is fairseq's
    ``--post-process`` (``subword_nmt``, ``sentencepiece``, ``@@ ``, or null). ``detokenize``
    names the word tokenizer the model's data went through: ``moses`` (sacremoses: raw source
    text is Moses-tokenised before BPE and hypotheses are detokenised after it) or ``none``.
    """

    kind: str = "fairseq_translation"
    checkpoint: str = ""
    data_bin: str = ""
    trusted: bool = False
    name: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None
    beam: int = ranged(5, at_least=1)
    lenpen: float = ranged(1.0)  # fairseq takes any: below 1 favours short hypotheses, above 1 long ones
    max_len_a: float = ranged(0.0, at_least=0)
    max_len_b: int = ranged(200, at_least=1)
    min_len: int = ranged(1, at_least=0)
    unkpen: float = ranged(0.0)
    no_repeat_ngram_size: int = ranged(0, at_least=0, why=" (0: n-grams may repeat)")
    remove_bpe: str | None = None
    detokenize: str = "none"

    def check(self) -> None:
        """Decoding settings that fairseq would only refuse mid-run, with an assertion, on a worker."""
        shortest = int(self.max_len_a * 1 + self.max_len_b)  # a one-token source (its end-of-sentence)
        if self.min_len > shortest:
            raise HeadsweepError(
                f"model.min_len={self.min_len} is longer than the longest output a one-token source may have "
                f"(model.max_len_a * source length + model.max_len_b = {shortest}): lower model.min_len or raise "
                "model.max_len_b"
            )


@dataclass
class TranslationData:
    """The evaluation set: raw parallel text, or a split of a binarised fairseq data-bin.

    Raw text: ``source`` and ``target`` files, one sentence a line, plain or ``.gz``; the
    source side is encoded as the model's training data were (``detokenize: moses`` for Moses
    tokenisation, then ``bpe_codes`` for subword-nmt or ``sentencepiece_model``), and the
    target lines are the references as written. Binarised: ``data_bin`` and ``split``
    (``<split>.<src>-<tgt>.<lang>.{bin,idx}``), whose token ids must use the model's
    dictionaries; references are the decoded, detokenised targets. ``encoding`` is the raw text
    files' encoding: a byte it cannot decode stops the run with the file, line and byte offset.
    """

    source: str | None = None
    target: str | None = None
    bpe_codes: str | None = None
    sentencepiece_model: str | None = None
    data_bin: str | None = None
    split: str = "test"
    max_examples: int | None = ranged(None, within=MAX_EXAMPLES)
    name: str | None = None
    encoding: str = "utf-8"

    def check(self) -> None:
        """What can be checked without the model or the files (the worker checks the rest)."""
        check_encoding(self.encoding)


@dataclass
class TranslationRuntime(RuntimeOptions):
    """How the translation adapter runs: :class:`RuntimeOptions` and the family's own settings, from the ``sweep``
    keys of the same names."""

    # Sentences per batch bounded by a token budget, fairseq's --max-tokens (sentences x longest source <=
    # max_tokens), instead of batch_size sentences; 0: batches of batch_size sentences.
    max_tokens: int = DEFAULT_MAX_TOKENS
    # The per-example loss costs a pass of its own (a teacher-forced pass per mask): False stores no loss
    # (examples.loss null).
    loss: bool = False
    # fairseq's fast attention paths where gates allow them (the fused kernel in modules no mask of a batch gates;
    # encoder-decoder keys once per sentence, not per beam); False: neither, every gated module unfused (the plain
    # reference).
    fused_attention: bool = True
