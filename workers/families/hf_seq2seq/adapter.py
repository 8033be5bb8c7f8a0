"""Evaluation adapter for transformers encoder-decoder models: beam-search BLEU or chrF per mask through
``model.generate``.

Every mask is evaluated by the model's own ``generate`` (beam search with the run's ``num_beams``,
``max_new_tokens`` and ``length_penalty``, the model's generation config for the rest) over the whole evaluation set,
sentences sorted by token length into batches of ``sweep.batch_size``. Hypotheses are decoded as users decode them
(``tokenizer.batch_decode(..., skip_special_tokens=True)``) and scored against the references with sacrebleu's BLEU or
chrF (``data.metric``, :mod:`headsweep.workers.core.translation_scores`): each sentence's sufficient statistics are
stored, the corpus score is computed from their sum, and the driver's paired bootstrap resamples them as it does for
``fairseq_translation``.

Several masks share one search (:mod:`.generation`): the batch is repeated once per mask and every row carries its
mask's gates. With ``sweep.reuse`` (the default) masks that gate no ``enc_self`` head read the batch's baseline
encoder output, computed once (``generate(encoder_outputs=...)``); masks gating encoder heads run the whole model.

With ``sweep.loss`` each mask also gets each reference's teacher-forced cross-entropy (nats per target token, EOS
included, no label smoothing: as ``fairseq_translation`` stores it), from one more pass per mask chunk, packed and
reusing the encoder output as the search does.

Under resample ablation (``sweep.ablation: resample``) gated-off ``enc_self`` heads take a donor sentence's
activations, as in ``fairseq_translation`` (:mod:`headsweep.workers.ablation.donors`): before a batch's searches the
donors' sources (each another sentence of the same token length, from any batch) are tokenised and padded as the
batch and run once through the ungated encoder alone, recording every encoder self-attention's output-projection
input; that is the gates' per-example fill while the batch's masks run. ``generate`` runs the encoder once on the
batch (repeated once per mask: the fill repeats mask-major) before expanding it to beams, so the fill acts there and
nowhere else; masks gating ``enc_self`` heads never read the cached encoder output. Decoder attention takes no fill: a
donor's decoder states follow its own hypotheses, so masks gating ``enc_dec`` or ``dec_self`` heads are refused.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.donors import donors_for, refuse_unfillable, with_donors
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, mask_grid
from headsweep.workers.core.metrics import Metric
from headsweep.workers.core.translation_scores import sentence_scorer
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_seq2seq.config import Seq2SeqData, Seq2SeqModel, Seq2SeqRuntime
from headsweep.workers.families.hf_seq2seq.data import read_seq2seq_data
from headsweep.workers.families.hf_seq2seq.generation import gates_encoder, row_gates
from headsweep.workers.families.hf_seq2seq.languages import TargetStart, apply_language_codes
from headsweep.workers.families.hf_seq2seq.model import load_seq2seq
from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error
from headsweep.workers.families.hf_shared.loading import max_positions
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

logger = logging.getLogger(__name__)

# fairseq's recipes (and fairseq_translation's importance) train translation models with label smoothing 0.1.
DEFAULT_LABEL_SMOOTHING = 0.1

# The attention types resample can fill from a donor: a donor's encoder states depend on its source alone, its
# decoder states on its own hypotheses (module docstring).
RESAMPLE_ATTENTION = ("enc_self",)


@dataclass
class Pairs:
    """The evaluation set: source sentences as the model reads them (task prefix included) and references."""

    ids: list[str]
    sources: list[str]
    references: list[str]
    places: list[str]  # each source as messages name it (``data.source line 3``)


@dataclass
class Batch:
    """Sentences of similar length, tokenised and padded as the tokenizer pads."""

    examples: torch.Tensor  # positions in the evaluation set (CPU, int64)
    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask

    @property
    def rows(self) -> int:
        return int(self.examples.numel())


class Seq2SeqAdapter:
    """A gated transformers encoder-decoder model with its evaluation set (an ``EvalAdapter``)."""

    def __init__(self, model_cfg: Seq2SeqModel, data_cfg: Seq2SeqData, runtime: RuntimeOptions):
        runtime = Seq2SeqRuntime.of(runtime)
        method = method_of(runtime.ablation)
        if method.needs_pairs:
            raise HeadsweepError(method.family_refusal("hf_seq2seq"))
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        self.cfg, self.runtime = model_cfg, runtime
        self.device = torch.device(runtime.device)
        text = read_seq2seq_data(data_cfg)
        pairs = Pairs([str(i) for i in range(len(text.sources))], [model_cfg.prefix + s.strip() for s in text.sources],
                      [t.strip() for t in text.targets], text.source_places)
        self.pairs: Pairs = at_positions(pairs, runtime.examples)
        self.dataset_name = text.name
        loaded = load_seq2seq(model_cfg, runtime.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        target_start = apply_language_codes(self.tokenizer, model_cfg.source_lang, model_cfg.target_lang)
        self.generation = resolve_generation(self.model, model_cfg, target_start)
        self.gates = HeadGates(seq2seq_sites_or_error(self.model))
        self.source_lengths = [len(ids) for ids in self.tokenizer(self.pairs.sources)["input_ids"]]
        self.batches = self.batched(runtime.batch_size)
        self._check_lengths()
        # Resample's donors: another sentence of the same source token length (EOS and prefix included), any batch.
        self.donors = donors_for(runtime.ablation, self.gates, self.source_lengths, what="sentences",
                                 where=f"the evaluation data ({self.dataset_name})",
                                 more="more sentences (a larger data.max_examples, or a larger test set)",
                                 attention=RESAMPLE_ATTENTION)
        self.scorer = sentence_scorer(data_cfg.metric, self.pairs.references)
        self.metric: Metric = self.scorer.metric
        self.model_name = model_cfg.name or Path(model_cfg.path).name
        self._encoded: dict[int, torch.Tensor] = {}
        self.reuse_note = ("encoder: masks without enc_self heads share the batch's baseline encoder output "
                           "(generate(encoder_outputs=...)); enc_self masks run the whole model"
                           if runtime.reuse else "off (sweep.reuse: false): every mask runs the whole model")

    # -- data ----------------------------------------------------------------------------
    def batched(self, batch_size: int) -> list[Batch]:
        """Sentences sorted by token length (then position), ``batch_size`` a batch, padded by the tokenizer."""
        lengths = self.source_lengths
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        batches = []
        for first in range(0, len(order), max(1, batch_size)):
            rows = order[first : first + max(1, batch_size)]
            batches.append(Batch(torch.tensor(rows, dtype=torch.long), self.encoded(rows)))
        return batches

    def encoded(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The sources of sentences ``rows`` tokenised and padded as the tokenizer pads (a batch, or its donors)."""
        inputs = self.tokenizer([self.pairs.sources[int(i)] for i in rows], padding=True, return_tensors="pt")
        return {k: inputs[k].to(self.device) for k in ("input_ids", "attention_mask")}

    def _check_lengths(self) -> None:
        limit = max_positions(self.model.config)
        for batch in self.batches:
            lengths = batch.inputs["attention_mask"].sum(dim=1)
            if limit is not None and int(lengths.max()) > limit:
                row = int(lengths.argmax())
                place = self.pairs.places[int(batch.examples[row])]
                raise HeadsweepError(f"{place} is {int(lengths[row])} tokens long, more than the model's {limit} "
                                     "positions: shorten or remove it")

    # -- EvalAdapter ---------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        gen = self.generation
        cfg = self.model.config
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=list(self.pairs.ids),
            references=list(self.pairs.references),
            inventory=self.gates.inventory,
            inputs=list(self.pairs.sources),
            facts={
                "model_class": type(self.model).__name__,
                "model_type": getattr(cfg, "model_type", None),
                "path": str(self.cfg.path),
                "attn_implementation": getattr(cfg, "_attn_implementation", None),
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "num_beams": gen.num_beams,
                "max_new_tokens": gen.max_new_tokens,
                "max_length": gen.max_length if gen.max_new_tokens is None else None,
                "length_penalty": gen.length_penalty,
                "early_stopping": gen.early_stopping,
                "forced_bos_token_id": gen.forced_bos_token_id,
                "decoder_start_token_id": gen.decoder_start_token_id,
                "source_lang": self.cfg.source_lang,
                "target_lang": self.cfg.target_lang,
                "prefix": self.cfg.prefix,
                "decode": "tokenizer.batch_decode(skip_special_tokens=True)",
                "sacrebleu_signature": self.scorer.signature,
                "loss": ("teacher-forced cross-entropy of the reference, nats per target token (EOS included)"
                         if self.runtime.loss else "not computed (sweep.loss: false): examples.loss is null"),
                "batching": f"{self.runtime.batch_size} sentences per batch",
                "reuse": self.reuse_note,
            },
        )

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Each mask's per-sentence metric statistics and hypotheses; under resample ablation with K draws
        (``ablation.resamples``), the statistics' (and losses') mean over the draws
        (:mod:`headsweep.workers.ablation.donors`), and the hypotheses of the first draw."""
        refuse_unfillable(self.donors, self.runtime.ablation, "hf_seq2seq", masks)
        start = time.perf_counter()

        def scored() -> list:
            hypotheses = self.translate(masks)
            losses = self.reference_loss(masks) if self.runtime.loss else [None] * len(masks)
            return [(h, self.sentence_stats(h), loss) for h, loss in zip(hypotheses, losses, strict=True)]

        per_mask = self.donors.outputs_over_draws(masks, scored)
        seconds_each = (time.perf_counter() - start) / max(1, len(masks))
        return [MaskOutput(stats=stats, loss=loss, outputs=outputs, score=self.metric.score(stats),
                           seconds=seconds_each) for outputs, stats, loss in per_mask]

    def run_donors(self, donors: np.ndarray) -> None:
        """The per-batch donor pass of :class:`~headsweep.workers.ablation.donors.Donors`: the sources of sentences
        ``donors`` (one per row of the batch, each as long as that row's sentence, so padded to the batch's width
        and layout) through the ungated encoder alone; the decoder is not needed, as no decoder head takes a fill."""
        self.model.get_encoder()(**self.encoded(donors))

    def sentence_stats(self, hypotheses: list[str]) -> np.ndarray:
        """sacrebleu's per-sentence statistics of detokenised hypotheses: (n, 10) for BLEU (as fairseq_translation),
        (n, 18) for chrF."""
        return self.scorer.sentence_stats(hypotheses)

    @torch.inference_mode()
    def translate(self, masks: Sequence[Sequence[Head]]) -> list[list[str]]:
        """Beam-search every sentence under each mask: [mask][example] decoded hypotheses."""
        grid = [GridBatch(key, batch, batch.examples) for key, batch in enumerate(self.batches)]
        # Masks with and without encoder heads never share a search: only the second kind reads the cached encoder.
        encoder = [i for i, m in enumerate(masks) if gates_encoder(m)]
        decoder = [i for i, m in enumerate(masks) if not gates_encoder(m)]
        out = np.empty((len(masks), len(self.pairs.ids)), dtype=object)
        mask_grid(masks, grid, lambda b: partial(self._search, b), out,
                  masks_per_forward=lambda b: self.masks_per_forward(b.inputs),
                  groups=[g for g in (encoder, decoder) if g], donors=self.donors, run_donors=self.run_donors)
        return out.tolist()

    @torch.inference_mode()
    def reference_loss(self, masks: Sequence[Sequence[Head]]) -> list[np.ndarray]:
        """Teacher-forced cross-entropy of each reference under each mask: [mask] (examples,) nats per target token."""
        grid = [GridBatch(key, batch, batch.examples) for key, batch in enumerate(self.batches)]
        encoder = [i for i, m in enumerate(masks) if gates_encoder(m)]
        decoder = [i for i, m in enumerate(masks) if not gates_encoder(m)]
        out = np.zeros((len(masks), len(self.pairs.ids)))
        mask_grid(masks, grid, lambda b: partial(self._teacher_forced, b), out,
                  masks_per_forward=lambda b: self.masks_per_forward(b.inputs),
                  groups=[g for g in (encoder, decoder) if g], donors=self.donors, run_donors=self.run_donors)
        return list(out)

    def reference_labels(self, batch: Batch) -> torch.Tensor:
        """The batch's references as labels, padding as -100 (transformers shifts them into the decoder's input)."""
        references = [self.pairs.references[int(i)] for i in batch.examples]
        labels = self.tokenizer(text_target=references, padding=True, return_tensors="pt")["input_ids"].to(self.device)
        return labels.masked_fill(labels.eq(self.tokenizer.pad_token_id), -100)

    def decoder_input_ids(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's teacher-forced input for ``labels``: the references shifted right behind the decoder start
        token, as the model's own ``prepare_decoder_input_ids_from_labels`` shifts them (on a copy: FSMT's shift
        writes into its argument), or, for models without one (M2M100 / NLLB, Blenderbot), as their
        ``shift_tokens_right`` does. Passed explicitly rather than as ``labels``: FSMT given only labels decodes
        from the shifted *source*, and the model's own loss would be computed for nothing."""
        prepare = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is not None:
            return prepare(labels=labels.clone())
        config = self.model.config
        shifted = labels.new_full(labels.shape, config.decoder_start_token_id)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted.eq(-100), config.pad_token_id)

    def _teacher_forced(self, batch: GridBatch[Batch], chunk: list[Sequence[Head]]) -> np.ndarray:
        """One teacher-forced pass over the batch repeated once per mask of ``chunk``: per-row mean NLL, mask-major."""
        inputs, rows, k = batch.inputs.inputs, batch.rows, len(chunk)
        labels = self.reference_labels(batch.inputs).repeat(k, 1)
        stacked = {name: t.repeat(k, 1) for name, t in inputs.items()}
        if self.runtime.reuse and not any(gates_encoder(m) for m in chunk):
            from transformers.modeling_outputs import BaseModelOutput

            hidden = self._encoder_output(batch.key, inputs)
            # input_ids stay although the encoder is skipped: FSMT builds the decoder's causal mask only when given
            # them, and without it teacher forcing would read later target tokens
            stacked = {"input_ids": stacked["input_ids"], "attention_mask": stacked["attention_mask"],
                       "encoder_outputs": BaseModelOutput(last_hidden_state=hidden.repeat(k, 1, 1))}
        try:
            if k == 1:
                self.gates.set_mask(chunk[0])
            else:  # teacher forcing: one decoder row per sentence (a beam of one)
                self.gates.set_values(row_gates(self.gates, chunk, rows, 1, self.device))
            logits = self.model(**stacked, decoder_input_ids=self.decoder_input_ids(labels), use_cache=False).logits
        finally:
            self.gates.clear()
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        real = labels.ne(-100)
        nll = -lprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per_sentence = (nll * real).sum(-1) / real.sum(-1).clamp(min=1)
        return per_sentence.double().cpu().numpy()

    def _search(self, batch: GridBatch[Batch], chunk: list[Sequence[Head]]) -> list[str]:
        """One ``generate`` over the batch repeated once per mask of ``chunk``: decoded hypotheses, mask-major."""
        inputs, rows, k = batch.inputs.inputs, batch.rows, len(chunk)
        stacked = {name: t.repeat(k, 1) for name, t in inputs.items()}
        extra = {}
        if self.runtime.reuse and not any(gates_encoder(m) for m in chunk):
            from transformers.modeling_outputs import BaseModelOutput

            hidden = self._encoder_output(batch.key, inputs)
            extra["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden.repeat(k, 1, 1))
        try:
            if k == 1:
                self.gates.set_mask(chunk[0])
            else:
                self.gates.set_values(row_gates(self.gates, chunk, rows, self.generation.num_beams, self.device))
            sequences = self.model.generate(**stacked, **extra, generation_config=self.generation)
        finally:
            self.gates.clear()
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=True)

    def _encoder_output(self, key: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's ungated encoder output (kept for the adapter's life: one tensor per batch)."""
        if key not in self._encoded:
            self.gates.clear()
            self._encoded[key] = self.model.get_encoder()(**inputs).last_hidden_state
        return self._encoded[key]

    def bytes_per_sentence(self, inputs: dict[str, torch.Tensor]) -> int:
        """Bytes one sentence takes in a beam search (an estimate, see batch_budget): per beam and decoder layer the
        cached self-attention keys and values over the hypothesis and the cross-attention ones over the source, the
        beam's scores over the vocabulary, and the encoder output."""
        cfg = self.model.config
        src = int(inputs["input_ids"].shape[1])
        tgt = self.generation.max_new_tokens or self.generation.max_length or 2 * src + 10
        layers = int(getattr(cfg, "decoder_layers", 0) or getattr(cfg, "num_decoder_layers", 0)
                     or getattr(cfg, "num_layers", 0) or 6)
        dim = int(getattr(cfg, "d_model", 0) or 512)
        vocab = int(getattr(cfg, "vocab_size", 0) or 32000)
        itemsize = next(self.model.parameters()).element_size()
        per_beam = layers * 2 * dim * (src + tgt) + 2 * vocab + src * dim
        return self.generation.num_beams * per_beam * itemsize

    def masks_per_forward(self, batch: Batch) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of the batch as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, batch.rows, self.bytes_per_sentence(batch.inputs),
                                        self.device, dense=False)

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The evaluation batches as teacher-forced label-smoothed cross-entropy of the references (fairseq's
        ``label_smoothed_nll_loss``, epsilon 0.1 unless given), summed over each batch's target tokens; under the
        run's resample fill where it has one (:func:`~headsweep.workers.ablation.donors.with_donors`)."""
        eps = float(DEFAULT_LABEL_SMOOTHING if label_smoothing is None else label_smoothing)
        batches = [self._loss_batch(batch, eps, dtype) for batch in self.batches]
        return with_donors(LossBatches(batches, f"teacher-forced label-smoothed cross-entropy (epsilon {eps:g})"),
                           self.donors, [batch.examples for batch in self.batches], self.run_donors)

    def _loss_batch(self, batch: Batch, epsilon: float, dtype: torch.dtype) -> LossBatch:
        labels = self.reference_labels(batch)
        real_target = labels.ne(-100)
        real_source = batch.inputs["attention_mask"].bool()
        tokens = {s.key: real_source if s.attention == "enc_self" else real_target for s in self.gates.sites}

        def logits() -> torch.Tensor:
            return self.model(**batch.inputs, decoder_input_ids=self.decoder_input_ids(labels), use_cache=False).logits

        def loss() -> torch.Tensor:
            lprobs = torch.log_softmax(logits().to(dtype), dim=-1)
            target = labels.clamp(min=0).unsqueeze(-1)
            nll = -lprobs.gather(-1, target).squeeze(-1)
            smooth = -lprobs.sum(dim=-1)
            eps_i = epsilon / (lprobs.size(-1) - 1)
            per_token = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
            return (per_token * real_target).sum()

        return LossBatch(tokens, batch.rows, loss, lambda: (logits(), real_target), recompute=True)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """The configured beam search of ``batch_size`` sentences around the median length (``max_length`` does not
        apply: sentences are used whole)."""
        batch = median_batch(self.batches, lambda b: b.rows)
        inputs = take_rows(batch.inputs, batch.rows, batch_size)
        tokens = int(inputs["attention_mask"].sum())
        generation = self.generation
        return Workload(batch_size, tokens, lambda model: model.generate(**inputs, generation_config=generation))


# generate's own defaults for the settings a run reads (GenerationConfig._get_default_generation_params)
GENERATE_DEFAULTS = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False, "max_length": 20}


def resolve_generation(model: torch.nn.Module, cfg: Seq2SeqModel, target_start: TargetStart | None):
    """The model's generation config with the run's settings: ``num_beams``, ``max_new_tokens`` and
    ``length_penalty`` where the config sets them, the target language's code first (forced, or as the decoder's
    start: :class:`.TargetStart`), and no sampling (a sweep compares masks on the same deterministic search)."""
    generation = copy.deepcopy(model.generation_config)
    for key in ("num_beams", "max_new_tokens", "length_penalty"):
        value = getattr(cfg, key)
        if value is not None:
            setattr(generation, key, value)
    if target_start is not None:
        setattr(generation, target_start.setting, target_start.token_id)
    generation.do_sample = False
    generation.num_return_sequences = 1
    # transformers 5 leaves what a checkpoint does not set as None and fills its defaults inside generate (T5Gemma's
    # generation config sets no beams): the same values here, where the run reads them (the batch budget counts
    # beams, runs.facts shows the search)
    for key, value in GENERATE_DEFAULTS.items():
        if getattr(generation, key, None) is None and not (key == "max_length" and generation.max_new_tokens):
            setattr(generation, key, value)
    return generation


def load_seq2seq_adapter(model_cfg: Seq2SeqModel, data_cfg: Seq2SeqData, runtime: RuntimeOptions) -> Seq2SeqAdapter:
    """Loader named by the ``hf_seq2seq`` model family."""
    return Seq2SeqAdapter(model_cfg, data_cfg, runtime)
