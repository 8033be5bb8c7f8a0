"""Task adapter for fairseq translation models: beam-search BLEU and teacher-forced loss per mask.

Every mask is evaluated by a real ``fairseq.sequence_generator.SequenceGenerator`` beam
search over the whole evaluation set. Sentences are sorted by length into batches. Several
masks can share one beam search: the batch is repeated once per mask and each row carries
its mask's gates. Beam search reorders and shrinks its batch as sentences finish; it does so
by calling ``reorder_encoder_out(new_order)`` with the rows every surviving hypothesis comes
from, and the same index, applied to the row-to-mask map, keeps every row's gates attached
to its sentence (see :class:`_RoutedEnsemble`). Sentences never interact in fairseq's beam
search, and a packed batch holds exactly the sentences (and padding) of the unpacked one, so
packing changes nothing but floating-point summation order inside matrix products.

With ``sweep.reuse`` (the default) the encoder is not run again for masks that leave it alone:
masks gating only ``enc_dec`` / ``dec_self`` heads read the baseline encoder output, and masks
gating ``enc_self`` heads start the encoder at their first gated layer
(:mod:`headsweep.workers.families.fairseq_translation.reuse`), in beam search and in teacher-forced scoring alike.
``reuse: false`` runs the whole model for every mask (the reference).

Per-sentence statistics are sacrebleu's own BLEU sufficient statistics of the detokenised
hypothesis against the reference; the corpus score is computed from their sum.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fairseq import utils as fairseq_utils
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from sacrebleu.metrics import BLEU as SacreBLEU

from headsweep.errors import HeadsweepError
from headsweep.workers.batch_budget import cache_budget
from headsweep.workers.batch_budget import masks_per_forward as budget_masks_per_forward
from headsweep.workers.families.fairseq_translation.checkpoint import (
    build_model,
    check_dictionaries,
    prepare_state,
    read_checkpoint,
    task_option,
)
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.data import ParallelExamples, TextPipeline, load_examples
from headsweep.workers.families.fairseq_translation.reuse import EncoderReuse
from headsweep.workers.families.fairseq_translation.sites import FairseqHeadGates, gate_fairseq_model
from headsweep.workers.family import DatasetInfo, MaskOutput, RuntimeOptions
from headsweep.workers.heads import Head
from headsweep.workers.metrics import BLEU
from headsweep.workers.replay import ReuseUnsupported

logger = logging.getLogger(__name__)


@dataclass
class Hypothesis:
    """The best beam-search hypothesis of one sentence under one mask."""

    tokens: torch.Tensor
    score: float
    text: str


class _RoutedEnsemble(EnsembleModel):
    """fairseq's ``EnsembleModel`` of one model, whose per-row gates follow beam search's reordering.

    ``tables[site]`` holds one gate row per mask and ``rows[i]`` is the mask of batch row i.
    The encoder runs once on the packed sentences (or ``encode()`` gives its output: encoder
    reuse); every later batch (the beams, then fewer as sentences finish) is formed by
    ``reorder_encoder_out(new_order)``, so applying ``new_order`` to ``rows`` too keeps each
    row's gates with the sentence whose encoder output it reads.
    """

    def __init__(self, model, gates: FairseqHeadGates, tables: dict[tuple[str, int], torch.Tensor],
                 rows: torch.Tensor, encode: Callable[[], dict] | None = None):
        super().__init__([model])
        self._gates, self._tables, self._rows, self._encode = gates, tables, rows, encode

    def _route(self) -> None:
        self._gates.set_values({key: table.index_select(0, self._rows) for key, table in self._tables.items()})

    def forward_encoder(self, net_input):
        if self._encode is not None:
            outs = [self._encode()]
            self._route()
            return outs
        self._route()
        return super().forward_encoder(net_input)

    def reorder_encoder_out(self, encoder_outs, new_order):
        self._rows = self._rows.index_select(0, new_order)
        self._route()
        return super().reorder_encoder_out(encoder_outs, new_order)


@dataclass
class _Loaded:
    model: torch.nn.Module
    src_dict: Dictionary
    tgt_dict: Dictionary
    source_lang: str
    target_lang: str
    left_pad_source: bool
    num_updates: int


class TranslationTask:
    """A gated fairseq translation model with its evaluation set."""

    metric = BLEU

    def __init__(self, model_cfg: TranslationModel, data_cfg: TranslationData, runtime: RuntimeOptions):
        if model_cfg.beam < 1:
            raise HeadsweepError(f"model.beam must be at least 1, got {model_cfg.beam}")
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        self.cfg, self.runtime = model_cfg, runtime
        self.device = torch.device(runtime.device)
        loaded = _load_model(model_cfg)
        self.model = loaded.model.to(self.device).eval()
        self.src_dict, self.tgt_dict = loaded.src_dict, loaded.tgt_dict
        self.source_lang, self.target_lang = loaded.source_lang, loaded.target_lang
        self.left_pad_source, self.num_updates = loaded.left_pad_source, loaded.num_updates
        self.gates = gate_fairseq_model(self.model)
        self.pipeline = TextPipeline(model_cfg, data_cfg, self.src_dict, self.tgt_dict,
                                     self.source_lang, self.target_lang)
        self.examples: ParallelExamples = load_examples(data_cfg, self.pipeline)
        self.batches = self._batches(runtime.batch_size)
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
    def _batches(self, batch_size: int) -> list[dict]:
        """fairseq samples (``LanguagePairDataset.collater``) of similar-length sentences."""
        ex = self.examples
        ds = LanguagePairDataset(
            ex.source, np.array([len(s) for s in ex.source]), self.src_dict,
            ex.target, np.array([len(t) for t in ex.target]), self.tgt_dict,
            left_pad_source=self.left_pad_source, left_pad_target=False,
        )
        order = sorted(range(len(ex.source)), key=lambda i: (len(ex.source[i]), i))
        batches = []
        for start in range(0, len(order), batch_size):
            sample = ds.collater([ds[i] for i in order[start : start + batch_size]])
            batches.append(_to_device(sample, self.device))
        return batches

    # -- TaskAdapter ---------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        ex = self.examples
        return DatasetInfo(
            model=self.model_name,
            dataset=ex.name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=list(ex.ids),
            references=list(ex.references),
            inventory=self.gates.inventory,
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
                "loss": "teacher-forced cross-entropy of the reference, nats per target token (EOS included)",
                "reuse": self.reuse_note,
            },
        )

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        start = time.perf_counter()
        hyps = self.translate(masks)
        losses = self.reference_loss(masks)
        seconds_each = (time.perf_counter() - start) / max(1, len(masks))
        results = []
        for mask_hyps, loss in zip(hyps, losses, strict=True):
            outputs = [h.text for h in mask_hyps]
            stats = self.sentence_stats(outputs)
            results.append(MaskOutput(stats=stats, loss=loss, outputs=outputs, score=self.metric.score(stats),
                                      seconds=seconds_each))
        return results

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

    def masks_per_search(self, sample: dict | None = None) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of the batch ``sample``
        (default: the longest) as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, self.runtime.batch_size,
                                        self.bytes_per_sentence(sample), self.device)

    def sentence_stats(self, hypotheses: list[str]) -> np.ndarray:
        """sacrebleu's per-sentence BLEU statistics (n, 10) of detokenised hypotheses."""
        # _extract_corpus_statistics is what sacrebleu's own significance tests use to get
        # per-sentence statistics against its cached references.
        return np.asarray(self._bleu._extract_corpus_statistics(hypotheses, None), dtype=np.float64)

    @torch.inference_mode()
    def translate(self, masks: Sequence[Sequence[Head]]) -> list[list[Hypothesis]]:
        """Beam-search every sentence under each mask: [mask][example] best hypotheses."""
        n = len(self.examples.ids)
        out: list[list[Hypothesis | None]] = [[None] * n for _ in masks]
        for key, sample in enumerate(self.batches):
            per = self.masks_per_search(sample)
            for first in range(0, len(masks), per):
                chunk = list(masks[first : first + per])
                for m, ids, hypos in self._search(key, sample, chunk):
                    for i, hypo in zip(ids, hypos, strict=True):
                        best = hypo[0]
                        out[first + m][i] = Hypothesis(best["tokens"].cpu(), float(best["score"]),
                                                       self.pipeline.decode(best["tokens"]))
        return out  # type: ignore[return-value]

    def _generator(self, models):
        c = self.cfg
        # Built per search: its constructor sets the beam size of models that have one (teacher forcing resets it).
        return SequenceGenerator(
            models, self.tgt_dict, beam_size=c.beam, max_len_a=c.max_len_a, max_len_b=c.max_len_b,
            min_len=c.min_len, len_penalty=c.lenpen, unk_penalty=c.unkpen, no_repeat_ngram_size=c.no_repeat_ngram_size,
        )

    def _search(self, key: int, sample: dict, chunk: list[Sequence[Head]]):
        ids = sample["id"].tolist()
        rows = len(ids)
        try:
            if self._reuse is not None:
                # Every row's gates are routed, and the encoder output comes from the reuse cache.
                tables = self._gate_tables(chunk)
                row_mask = torch.arange(len(chunk), device=self.device).repeat_interleave(rows)
                ensemble = _RoutedEnsemble(self.model, self.gates, tables, row_mask,
                                           encode=lambda: self._reuse.encode(key, sample["net_input"], chunk))
                hypos = self._generator(ensemble).generate([self.model], _repeat(sample, len(chunk)))
                return [(m, ids, hypos[m * rows : (m + 1) * rows]) for m in range(len(chunk))]
            if len(chunk) == 1:
                self.gates.set_mask(chunk[0])
                hypos = self._generator([self.model]).generate([self.model], sample)
                return [(0, ids, hypos)]
            tables = self._gate_tables(chunk)
            row_mask = torch.arange(len(chunk), device=self.device).repeat_interleave(rows)
            ensemble = _RoutedEnsemble(self.model, self.gates, tables, row_mask)
            hypos = self._generator(ensemble).generate([self.model], _repeat(sample, len(chunk)))
            return [(m, ids, hypos[m * rows : (m + 1) * rows]) for m in range(len(chunk))]
        finally:
            self.gates.clear()

    def _gate_tables(self, chunk: list[Sequence[Head]]) -> dict[tuple[str, int], torch.Tensor]:
        """Per site that any mask touches: one gate row per mask, shape (n_masks, H)."""
        tables: dict[tuple[str, int], torch.Tensor] = {}
        for m, mask in enumerate(chunk):
            for head in mask:
                self.gates.inventory.check(head)
                key = (head.attention, head.layer)
                if key not in tables:
                    shape = self.gates.inventory.layer(*key)
                    tables[key] = torch.ones(len(chunk), shape.num_heads, device=self.device)
                tables[key][m, head.head] = 0.0
        return tables

    @torch.inference_mode()
    def reference_loss(self, masks: Sequence[Sequence[Head]]) -> list[np.ndarray]:
        """Teacher-forced cross-entropy of each reference under each mask (nats per target token)."""
        n = len(self.examples.ids)
        out = [np.zeros(n) for _ in masks]
        # For models with set_beam_size (BART-style), a beam search leaves the "beamable" encoder
        # attention on, which would treat teacher-forced rows as beams of one sentence.
        self.model.decoder.set_beam_size(1)
        for key, sample in enumerate(self.batches):
            ids = sample["id"].cpu().numpy()
            rows = len(ids)
            per = self.masks_per_search(sample)
            for first in range(0, len(masks), per):
                chunk = list(masks[first : first + per])
                try:
                    if self._reuse is not None:
                        nll = self._token_nll_reused(key, sample, chunk)
                    else:
                        if len(chunk) == 1:
                            self.gates.set_mask(chunk[0])
                            stacked = sample
                        else:
                            self.gates.set_masks_per_example(chunk, rows_per_mask=rows)
                            stacked = _repeat(sample, len(chunk))
                        nll = self._token_nll(stacked)
                finally:
                    self.gates.clear()
                for m in range(len(chunk)):
                    out[first + m][ids] = nll[m * rows : (m + 1) * rows]
        return out

    def _token_nll(self, sample: dict) -> np.ndarray:
        return self._nll(self.model(**sample["net_input"]), sample)

    def _token_nll_reused(self, key: int, sample: dict, chunk: list[Sequence[Head]]) -> np.ndarray:
        """Teacher-forced NLL of a packed chunk, the decoder reading the reuse cache's encoder output."""
        net = sample["net_input"]
        encoder_out = self._reuse.encode(key, net, chunk)
        self.gates.set_masks_per_example([[h for h in m if h.attention != "enc_self"] for m in chunk],
                                         rows_per_mask=len(sample["id"]))
        stacked = _repeat(sample, len(chunk))
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


def _repeat(sample: dict, k: int) -> dict:
    """The batch repeated ``k`` times, mask-major (rows m*B .. m*B+B-1 carry mask m)."""
    net = sample["net_input"]
    return {
        "id": sample["id"].repeat(k),
        "nsentences": sample["nsentences"] * k,
        "ntokens": sample["ntokens"] * k,
        "net_input": {key: v.repeat(k, *([1] * (v.dim() - 1))) for key, v in net.items()},
        "target": sample["target"].repeat(k, 1),
    }


def _to_device(sample: dict, device: torch.device) -> dict:
    return fairseq_utils.move_to_cuda(sample, device) if device.type == "cuda" else sample


def _sacrebleu(references: list[str]) -> SacreBLEU:
    # force: hypotheses are detokenised here, as the config says; sacrebleu's "tokenized period"
    # warning would fire on every evaluation of languages written with " ." otherwise.
    return SacreBLEU(force=True, references=[references])


def _load_model(cfg: TranslationModel) -> _Loaded:
    state = read_checkpoint(cfg.checkpoint, cfg.trusted)
    src = cfg.source_lang or task_option(state, "source_lang")
    tgt = cfg.target_lang or task_option(state, "target_lang")
    if not src or not tgt:
        raise HeadsweepError(
            "the checkpoint does not name its languages: set model.source_lang and model.target_lang"
        )
    if not cfg.data_bin:
        raise HeadsweepError("config key 'model.data_bin' is required (the folder with dict.<lang>.txt)")
    folder = Path(cfg.data_bin)
    files = [folder / f"dict.{lang}.txt" for lang in (src, tgt)]
    for file in files:
        if not file.is_file():
            raise HeadsweepError(f"dictionary not found: {file} (model.data_bin must hold dict.{src}.txt and "
                                 f"dict.{tgt}.txt)")
    src_dict, tgt_dict = (Dictionary.load(str(f)) for f in files)
    check_dictionaries(state, src_dict, tgt_dict, *files)
    state = prepare_state(state, {"data": str(folder), "source_lang": src, "target_lang": tgt})
    history = state.get("optimizer_history") or [{}]
    num_updates = int(history[-1].get("num_updates", 0) or 0)
    model, model_cfg, task = build_model(state, cfg.checkpoint)
    left_pad = bool(getattr(model_cfg.task, "left_pad_source", True))
    return _Loaded(model, task.source_dictionary, task.target_dictionary, src, tgt, left_pad, num_updates)


def load_translation(
    model_cfg: TranslationModel, data_cfg: TranslationData, runtime: RuntimeOptions
) -> TranslationTask:
    """Loader named by the ``fairseq_translation`` task kind."""
    return TranslationTask(model_cfg, data_cfg, runtime)
