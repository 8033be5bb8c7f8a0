"""Evaluation adapter for fairseq translation models: beam-search BLEU (and, with ``sweep.loss``,
teacher-forced loss) per mask.

Every mask is evaluated by a real ``fairseq.sequence_generator.SequenceGenerator`` beam
search over the whole evaluation set. Sentences are sorted by length into batches under a
token budget (``sweep.max_tokens``, fairseq's ``--max-tokens``), or of ``sweep.batch_size``
sentences. Several masks can share one beam search, as many as the token budget leaves room
for (a full batch: one): the batch is repeated once per mask and each row carries
its mask's gates, routed through beam search's reordering
(:class:`headsweep.workers.families.fairseq_translation.search.RoutedEnsemble`). Sentences never
interact in fairseq's beam search, and a packed batch holds exactly the sentences (and padding)
of the unpacked one, so packing changes nothing but floating-point summation order inside
matrix products.

With ``sweep.reuse`` (the default) the encoder is not run again for masks that leave it alone:
masks gating only ``enc_dec`` / ``dec_self`` heads read the baseline encoder output, and masks
gating ``enc_self`` heads start the encoder at their first gated layer
(:mod:`headsweep.workers.families.fairseq_translation.reuse`), in beam search and in
teacher-forced scoring alike. ``reuse: false`` runs the whole model for every mask (the reference).

With ``sweep.fused_attention`` (the default) modules no mask of a batch gates keep fairseq's
fused attention kernel (``sites.py``), and beam search computes encoder-decoder keys once per
sentence, not once per beam (``search.set_beamable``).

Per-sentence statistics are sacrebleu's own BLEU sufficient statistics of the detokenised
hypothesis against the reference; the corpus score is computed from their sum.

Under resample ablation (``sweep.ablation: resample``) gated-off ``enc_self`` heads take a donor sentence's
activations (:mod:`headsweep.workers.ablation.donors`): before a batch's searches, the donors' sources (each another
sentence of the same source length, from any batch) are padded as the batch (fairseq pads sources on the left, so
same-length sources padded to the batch's width line up position by position) and run once through the ungated
encoder alone, recording every encoder self-attention's output-projection input; that is the gates' per-example fill
while the batch's masks run. The fill acts inside the encoder, on the batch's sentences before beam search expands
them to beams (packed masks repeat it mask-major; encoder reuse's replayed layer reads it too). Decoder attention takes
no fill: a donor's decoder states follow its own hypotheses, so masks gating ``enc_dec`` or ``dec_self`` heads are
refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fairseq.data import LanguagePairDataset, data_utils
from sacrebleu.metrics import BLEU as SacreBLEU

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.donors import donors_for, refuse_unfillable, with_donors
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.core.family import DatasetInfo, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, mask_grid
from headsweep.workers.core.metrics import BLEU
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.data_report import report
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel, TranslationRuntime
from headsweep.workers.families.fairseq_translation.data import (
    ParallelExamples,
    TextPipeline,
    check_lengths,
    data_subject,
    findings,
    load_examples,
)
from headsweep.workers.families.fairseq_translation.model import load_model
from headsweep.workers.families.fairseq_translation.reuse import EncoderReuse
from headsweep.workers.families.fairseq_translation.search import (
    Hypothesis,
    RoutedEnsemble,
    make_generator,
    repeat_sample,
    set_beamable,
    to_device,
)
from headsweep.workers.families.fairseq_translation.sites import gate_fairseq_model
from headsweep.workers.families.fairseq_translation.training_loss import translation_loss_batches
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward
from headsweep.workers.memory.replay import ReuseUnsupported

logger = logging.getLogger(__name__)

# The attention types resample can fill from a donor: a donor's encoder states depend on its source alone, its
# decoder states on its own hypotheses (module docstring).
RESAMPLE_ATTENTION = ("enc_self",)


class TranslationAdapter:
    """A gated fairseq translation model with its evaluation set (an ``EvalAdapter``)."""

    metric = BLEU

    def __init__(self, model_cfg: TranslationModel, data_cfg: TranslationData, options: RuntimeOptions):
        runtime = TranslationRuntime.of(options)
        if model_cfg.beam < 1:
            raise HeadsweepError(f"model.beam must be at least 1, got {model_cfg.beam}")
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        self.cfg, self.runtime = model_cfg, runtime
        self.device = torch.device(runtime.device)
        loaded = load_model(model_cfg)
        self.model = loaded.model.to(self.device).eval()
        self.src_dict, self.tgt_dict = loaded.src_dict, loaded.tgt_dict
        self.source_lang, self.target_lang = loaded.source_lang, loaded.target_lang
        self.left_pad_source, self.num_updates = loaded.left_pad_source, loaded.num_updates
        self.gates = gate_fairseq_model(self.model, keep_fused=runtime.fused_attention)
        self.pipeline = TextPipeline(model_cfg, data_cfg, self.src_dict, self.tgt_dict,
                                     self.source_lang, self.target_lang)
        self.examples: ParallelExamples = at_positions(load_examples(data_cfg, self.pipeline), runtime.examples)
        limits = check_lengths(self.examples, self.model.max_positions())
        self.data_facts = {"encoding": data_cfg.encoding, "max_source_positions": limits[0],
                           "max_target_positions": limits[1],
                           **report(data_subject(data_cfg), findings(self.examples))}
        if runtime.max_tokens < 0:
            raise HeadsweepError(f"sweep.max_tokens must not be negative, got {runtime.max_tokens}")
        self.batches = self.batched(runtime.batch_size, runtime.max_tokens)
        # Resample's donors: another sentence of the same source length (EOS included), whatever its batch.
        self.donors = donors_for(runtime.ablation, self.gates, [len(s) for s in self.examples.source],
                                 what="sentences", where=data_subject(data_cfg),
                                 more="more sentences (a larger data.max_examples, or a larger test set)",
                                 attention=RESAMPLE_ATTENTION)
        self._bleu = _sacrebleu(self.examples.references)
        checkpoint = Path(model_cfg.checkpoint)
        self.model_name = model_cfg.name or f"{checkpoint.parent.name}/{checkpoint.name}"
        self._reuse: EncoderReuse | None = None
        self.reuse_note = "off (sweep.reuse: false): every mask runs the whole model"
        if runtime.reuse:
            try:
                self._reuse = EncoderReuse(self.model, self.gates, cache_budget(self.device))
                self.reuse_note = ("encoder: masks without enc_self heads share the baseline encoder output, "
                                   "enc_self masks start at their first gated encoder layer")
            except ReuseUnsupported as exc:
                self.reuse_note = f"plain path: encoder reuse does not support this model ({exc})"
                logger.warning("%s: %s", self.model_name, self.reuse_note)

    # -- data ----------------------------------------------------------------------------
    def batched(self, batch_size: int, max_tokens: int = 0) -> list[dict]:
        """fairseq samples (``LanguagePairDataset.collater``) of similar-length sentences.

        Sentences sorted by source length (then position) go into batches of ``batch_size``, or,
        with ``max_tokens`` > 0, into batches as large as fairseq's ``--max-tokens`` allows:
        sentences x longest source (EOS included) at most ``max_tokens`` (a longer sentence
        alone). Batches hold whole sentences and never mix them in a search, so batching changes
        nothing but the summation order of padded matrix products.
        """
        ex = self.examples
        ds = LanguagePairDataset(
            ex.source, np.array([len(s) for s in ex.source]), self.src_dict,
            ex.target, np.array([len(t) for t in ex.target]), self.tgt_dict,
            left_pad_source=self.left_pad_source, left_pad_target=False,
        )
        order = sorted(range(len(ex.source)), key=lambda i: (len(ex.source[i]), i))
        return [to_device(ds.collater([ds[i] for i in group]), self.device)
                for group in token_batches(order, [len(s) for s in ex.source], batch_size, max_tokens)]

    # -- EvalAdapter ---------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        method = method_of(self.runtime.ablation)
        if method.needs_pairs:  # no paired translation data: refused before anything runs
            raise HeadsweepError(method.family_refusal("fairseq_translation"))
        ex = self.examples
        return DatasetInfo(
            model=self.model_name,
            dataset=ex.name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=list(ex.ids),
            references=list(ex.references),
            inventory=self.gates.inventory,
            # the sources as the model saw them, subword marks removed (for the run's inputs table)
            inputs=[self.src_dict.string(s.int().cpu(), self.pipeline.post_process) for s in ex.source],
            facts={
                "model_class": type(self.model).__name__,
                "checkpoint": str(self.cfg.checkpoint),
                "num_updates": self.num_updates,
                "source_lang": self.source_lang,
                "target_lang": self.target_lang,
                "beam": self.cfg.beam,
                "lenpen": self.cfg.lenpen,
                "max_len_a": self.cfg.max_len_a,
                "max_len_b": self.cfg.max_len_b,
                "remove_bpe": self.pipeline.post_process,
                "detokenize": self.cfg.detokenize,
                "sacrebleu_signature": str(self._bleu.get_signature()),
                "unk_rate_source": ex.unk_rate_source,
                "unk_rate_target": ex.unk_rate_target,
                "loss": ("teacher-forced cross-entropy of the reference, nats per target token (EOS included)"
                         if self.runtime.loss else "not computed (sweep.loss: false): examples.loss is null"),
                "batching": (f"at most {self.runtime.max_tokens} source tokens per batch (sweep.max_tokens)"
                             if self.runtime.max_tokens > 0 else f"{self.runtime.batch_size} sentences per batch"),
                "fused_attention": ("kept by modules no mask of the batch gates" if self.runtime.fused_attention
                                    else "off for every gated module (sweep.fused_attention: false)"),
                "reuse": self.reuse_note,
                **self.data_facts,
            },
        )

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Each mask's per-sentence BLEU statistics (and loss, with ``sweep.loss``); under resample ablation with K
        draws (``ablation.resamples``), their mean over the draws (:mod:`headsweep.workers.ablation.donors`), and the
        hypotheses of the first draw."""
        self.check_fillable(masks)
        start = time.perf_counter()

        def scored() -> list:
            hyps = self.translate(masks)
            # The teacher-forced pass costs 13-28% of a beam search (measured, see bench/README.md): only when asked.
            losses = self.reference_loss(masks) if self.runtime.loss else [None] * len(masks)
            texts = [[h.text for h in mask_hyps] for mask_hyps in hyps]
            return [(t, self.sentence_stats(t), loss) for t, loss in zip(texts, losses, strict=True)]

        per_mask = self.donors.outputs_over_draws(masks, scored)
        seconds_each = (time.perf_counter() - start) / max(1, len(masks))
        return [MaskOutput(stats=stats, loss=loss, outputs=outputs, score=self.metric.score(stats),
                           seconds=seconds_each) for outputs, stats, loss in per_mask]

    def check_fillable(self, masks: Sequence[Sequence[Head]]) -> None:
        """Under resample ablation, every gated head is one a donor can fill (``enc_self``); the driver refuses
        configs that would gate others, so this catches only what it could not see (one line)."""
        refuse_unfillable(self.donors, self.runtime.ablation, "fairseq_translation", masks)

    def run_donors(self, donors: np.ndarray) -> None:
        """The per-batch donor pass of :class:`~headsweep.workers.ablation.donors.Donors`: the sources of sentences
        ``donors`` (one per row of the batch, each as long as that row's sentence) padded as fairseq pads the batch
        (``left_pad_source``, to the longest), through the ungated encoder alone; the decoder is not needed, as no
        decoder head takes a fill."""
        sources = [self.examples.source[int(d)] for d in donors]
        tokens = data_utils.collate_tokens(sources, self.src_dict.pad(), self.src_dict.eos(),
                                           left_pad=self.left_pad_source).to(self.device)
        lengths = torch.tensor([len(s) for s in sources], device=self.device)
        # Off the fused kernel: it never calls the output projections, whose inputs the donor pass records.
        with self.gates.unfused():
            self.model.encoder(tokens, src_lengths=lengths)

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The evaluation batches as teacher-forced label-smoothed cross-entropy (default epsilon 0.1), under the
        run's resample fill where it has one (:func:`~headsweep.workers.ablation.donors.with_donors`)."""
        return with_donors(translation_loss_batches(self.model, self.gates, self.batches, self.src_dict.pad(),
                                                    self.tgt_dict.pad(), label_smoothing, dtype),
                           self.donors, [sample["id"] for sample in self.batches], self.run_donors)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """The configured beam search of ``batch_size`` sentences around the median length (``max_length``
        does not apply: sentences are used whole, as evaluation uses them)."""
        sample = median_batch(self.batched(batch_size), lambda s: len(s["id"]))
        sample = take_rows(sample, len(sample["id"]), batch_size)
        tokens = int(sample["net_input"]["src_lengths"].sum())

        def run(model: torch.nn.Module):
            return make_generator(self.cfg, self.tgt_dict, [model]).generate([model], sample)

        return Workload(batch_size, tokens, run)

    # -- pieces --------------------------------------------------------------------------
    def bytes_per_sentence(self, sample: dict | None = None) -> int:
        """Bytes one sentence of ``sample`` (default: the longest batch) takes in a beam search (an
        estimate, see batch_budget).

        Per beam and decoder layer: cached self-attention keys and values over the hypothesis
        and encoder-attention keys and values over the source (2 x embed each position), plus
        the beam's scores over the target vocabulary (2 x vocab) and its encoder output.
        Hypotheses are taken to be at most twice the source plus 10 tokens (or max_len, if shorter).
        """
        samples = self.batches if sample is None else [sample]
        src = max(int(s["net_input"]["src_tokens"].shape[1]) for s in samples)
        tgt = min(int(self.cfg.max_len_a * src + self.cfg.max_len_b), 2 * src + 10)
        decoder = self.model.decoder
        layers = len(getattr(decoder, "layers", [])) or 6
        dim = int(getattr(decoder, "embed_dim", 0) or 512)
        per_beam = layers * 2 * dim * (src + tgt) + 2 * len(self.tgt_dict) + src * dim
        itemsize = next(self.model.parameters()).element_size()
        return self.cfg.beam * per_beam * itemsize

    def masks_per_forward(self, sample: dict | None = None) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of the batch ``sample``
        (default: the longest) as the activation budget holds and, with a token budget
        (``sweep.max_tokens``), as that budget holds: masks fill the budget a short batch leaves."""
        sample = sample if sample is not None else max(self.batches, key=self.bytes_per_sentence)
        rows = len(sample["id"])
        per = budget_masks_per_forward(self.runtime.masks_per_batch, rows, self.bytes_per_sentence(sample),
                                       self.device, dense=False)
        if self.runtime.masks_per_batch > 0 or self.runtime.max_tokens <= 0:
            return per
        return max(1, min(per, self.runtime.max_tokens // batch_tokens(sample)))

    def sentence_stats(self, hypotheses: list[str]) -> np.ndarray:
        """sacrebleu's per-sentence BLEU statistics (n, 10) of detokenised hypotheses."""
        # _extract_corpus_statistics is what sacrebleu's own significance tests use to get
        # per-sentence statistics against its cached references.
        return np.asarray(self._bleu._extract_corpus_statistics(hypotheses, None), dtype=np.float64)

    def _grid(self, masks: Sequence[Sequence[Head]], forward: Callable[[GridBatch[dict], list[Sequence[Head]]], Any],
              out: np.ndarray) -> np.ndarray:
        """Every mask over every batch (:func:`~headsweep.workers.core.mask_grid.mask_grid`) through ``forward``
        (a batch and a chunk of masks: a value per row, mask-major); resample's donors recorded once per batch,
        their fill read by every pass of the batch."""
        batches = [GridBatch(key, sample, sample["id"].cpu()) for key, sample in enumerate(self.batches)]
        return mask_grid(masks, batches, lambda batch: partial(forward, batch), out,
                         masks_per_forward=lambda batch: self.masks_per_forward(batch.inputs),
                         donors=self.donors, run_donors=self.run_donors)

    @torch.inference_mode()
    def translate(self, masks: Sequence[Sequence[Head]]) -> list[list[Hypothesis]]:
        """Beam-search every sentence under each mask: [mask][example] best hypotheses."""
        def best(hypo) -> Hypothesis:
            return Hypothesis(hypo[0]["tokens"].cpu(), float(hypo[0]["score"]), self.pipeline.decode(hypo[0]["tokens"]))

        def forward(batch: GridBatch[dict], chunk: list[Sequence[Head]]) -> list[Hypothesis]:
            return [best(hypo) for hypo in self._search(batch.key, batch.inputs, chunk)]

        return self._grid(masks, forward, np.empty((len(masks), len(self.examples.ids)), dtype=object)).tolist()

    def _search(self, key: int, sample: dict, chunk: list[Sequence[Head]]) -> list:
        """Beam search of one batch under each mask of ``chunk``: each row's beams, mask-major."""
        rows = len(sample["id"])
        beamable = self.runtime.fused_attention
        try:
            if self._reuse is None and len(chunk) == 1:
                self.gates.set_mask(chunk[0])
                return make_generator(self.cfg, self.tgt_dict, [self.model], beamable).generate([self.model], sample)
            # With reuse the encoder output comes from the reuse cache. One mask: its gates hold for
            # the whole search; several: every row's gates are routed.
            encode = None if self._reuse is None else (lambda: self._reuse.encode(key, sample["net_input"], chunk))
            if len(chunk) == 1:
                ensemble = RoutedEnsemble(self.model, self.gates, None, None, encode=encode,
                                          fixed=lambda: self.gates.set_mask(chunk[0]))
                return make_generator(self.cfg, self.tgt_dict, ensemble, beamable).generate([self.model], sample)
            row_mask = torch.arange(len(chunk), device=self.device).repeat_interleave(rows)
            ensemble = RoutedEnsemble(self.model, self.gates, self.gates.gate_tables(chunk, self.device), row_mask,
                                      encode=encode)
            return make_generator(self.cfg, self.tgt_dict, ensemble, beamable).generate(
                [self.model], repeat_sample(sample, len(chunk)))
        finally:
            self.gates.clear()
            if beamable:
                set_beamable(self.model, 1)

    @torch.inference_mode()
    def reference_loss(self, masks: Sequence[Sequence[Head]]) -> list[np.ndarray]:
        """Teacher-forced cross-entropy of each reference under each mask (nats per target token)."""
        # For models with set_beam_size (BART-style), a beam search leaves the "beamable" encoder
        # attention on, which would treat teacher-forced rows as beams of one sentence.
        self.model.decoder.set_beam_size(1)

        def forward(batch: GridBatch[dict], chunk: list[Sequence[Head]]) -> np.ndarray:
            if self._reuse is not None:
                try:
                    return self._token_nll_reused(batch.key, batch.inputs, chunk)
                finally:
                    self.gates.clear()
            stacked = batch.inputs if len(chunk) == 1 else repeat_sample(batch.inputs, len(chunk))
            with self.gates.packed(chunk, batch.rows):
                return self._token_nll(stacked)

        return list(self._grid(masks, forward, np.zeros((len(masks), len(self.examples.ids)))))

    def _token_nll(self, sample: dict) -> np.ndarray:
        return self._nll(self.model(**sample["net_input"]), sample)

    def _token_nll_reused(self, key: int, sample: dict, chunk: list[Sequence[Head]]) -> np.ndarray:
        """Teacher-forced NLL of a packed chunk, the decoder reading the reuse cache's encoder output."""
        net = sample["net_input"]
        encoder_out = self._reuse.encode(key, net, chunk)
        self.gates.set_masks_per_example([[h for h in m if h.attention != "enc_self"] for m in chunk],
                                         rows_per_mask=len(sample["id"]))
        stacked = repeat_sample(sample, len(chunk))
        # As fairseq's TransformerModel.forward calls its decoder.
        net_output = self.model.decoder(stacked["net_input"]["prev_output_tokens"], encoder_out=encoder_out,
                                        src_lengths=stacked["net_input"]["src_lengths"], return_all_hiddens=True)
        return self._nll(net_output, stacked)

    def _nll(self, net_output, sample: dict) -> np.ndarray:
        lprobs = self.model.get_normalized_probs(net_output, log_probs=True).float()
        target = sample["target"]
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        keep = target.ne(self.tgt_dict.pad())
        per_sentence = (nll * keep).sum(-1) / keep.sum(-1).clamp(min=1)
        return per_sentence.double().cpu().numpy()


def token_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """``order`` cut into consecutive batches: ``batch_size`` items each, or (``max_tokens`` > 0) as
    many as keep items x longest length within ``max_tokens`` (fairseq's ``batch_by_size`` rule,
    without its multiple-of-8 rounding); an item longer than the budget makes a batch alone."""
    if max_tokens <= 0:
        return [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        wider = max(longest, lengths[i])
        if current and wider * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, wider = [], lengths[i]
        current.append(i)
        longest = wider
    if current:
        batches.append(current)
    return batches


def batch_tokens(sample: dict) -> int:
    """Padded source tokens of a fairseq sample (what ``max_tokens`` bounds)."""
    return max(1, int(sample["net_input"]["src_tokens"].numel()))


def _sacrebleu(references: list[str]) -> SacreBLEU:
    # force: hypotheses are detokenised here, as the config says; sacrebleu's "tokenized period"
    # warning would fire on every evaluation of languages written with " ." otherwise.
    return SacreBLEU(force=True, references=[references])


def load_translation(
    model_cfg: TranslationModel, data_cfg: TranslationData, runtime: RuntimeOptions
) -> TranslationAdapter:
    """Loader named by the ``fairseq_translation`` model family."""
    return TranslationAdapter(model_cfg, data_cfg, runtime)
