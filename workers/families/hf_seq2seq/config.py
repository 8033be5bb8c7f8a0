"""Config sections of the ``hf_seq2seq`` model family (kept free of torch imports).

The data section reads the ``fairseq_translation`` family's raw-text keys (``data.source`` / ``data.target``,
``data.max_examples``, ``data.name``, ``data.encoding``), so a translation config moves between the two families by
its ``model`` section alone; the transformers tokenizer does what fairseq's BPE keys do there.
"""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.setting_ranges import MAX_EXAMPLES, ranged
from headsweep.workers.core.translation_scores import check_translation_metric
from headsweep.workers.data.text_files import check_encoding


@dataclass
class Seq2SeqModel:
    """A transformers encoder-decoder model (Marian, M2M100 / NLLB, mBART, BART, T5 / mT5) saved with
    ``save_pretrained``, or a hub id in the local cache, and how to decode with it.

    Decoding is ``model.generate`` with beam search: ``num_beams``, ``max_new_tokens`` and ``length_penalty`` come
    from the model's own generation config (``generation_config.json``) unless set here. ``source_lang`` /
    ``target_lang`` are the language codes a multilingual tokenizer needs (NLLB ``eng_Latn`` / ``fra_Latn``, M2M100
    ``en`` / ``fr``, mBART ``en_XX`` / ``fr_XX``): the target's code is the token generation is forced to start with.
    ``prefix`` is put before every source sentence (T5's task prefix, e.g. ``"translate English to German: "``).
    """

    kind: str = "hf_seq2seq"
    path: str = ""
    tokenizer: str | None = None
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"
    name: str | None = None
    num_beams: int | None = ranged(None, at_least=1)
    max_new_tokens: int | None = ranged(None, at_least=1)
    length_penalty: float | None = ranged(None)
    source_lang: str | None = None
    target_lang: str | None = None
    prefix: str = ""


@dataclass
class Seq2SeqData:
    """The evaluation set: raw parallel text, ``source`` and ``target`` files (one sentence a line, plain or ``.gz``)
    as ``fairseq_translation`` reads them; the target lines are the references as written. ``max_examples`` keeps
    the first sentences. ``metric`` scores the hypotheses: ``bleu`` (sacrebleu's corpus BLEU) or ``chrf`` (sacrebleu's
    chrF), from per-sentence statistics either way."""

    source: str | None = None
    target: str | None = None
    max_examples: int | None = ranged(None, within=MAX_EXAMPLES)
    name: str | None = None
    encoding: str = "utf-8"
    metric: str = "bleu"

    def check(self) -> None:
        """What can be checked without the model or the files (the worker checks the rest)."""
        check_encoding(self.encoding)
        check_translation_metric(self.metric)
        if not self.source or not self.target:
            raise HeadsweepError("config needs data.source and data.target (raw parallel text files, one sentence "
                                 "a line)")


@dataclass
class Seq2SeqRuntime(RuntimeOptions):
    """How the hf_seq2seq adapter runs: :class:`RuntimeOptions` and ``sweep.loss``, as ``fairseq_translation`` reads
    it: the teacher-forced pass per mask that fills ``examples.loss`` (else null; it costs a pass of its own)."""

    loss: bool = False
