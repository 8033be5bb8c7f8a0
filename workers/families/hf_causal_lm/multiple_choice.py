"""Multiple-choice accuracy of a causal LM, in lm-evaluation-harness's convention (``data.task: multiple_choice``).

The convention (lm-eval's ``output_type: multiple_choice`` with a Hugging Face causal LM, zero-shot; what
makes the numbers comparable with its ``acc`` and ``acc_norm``):

1. the questions are read and each choice encoded as a request, a row the model reads, as lm-eval does
   (:mod:`headsweep.workers.families.hf_causal_lm.questions`);
2. the choice's log-likelihood is the sum of the log-probabilities of its continuation tokens;
3. ``acc`` is 1 when the argmax of the log-likelihoods is the gold index, ``acc_norm`` when the argmax of
   log-likelihood / ``len(choice)`` (characters of the choice, without the delimiter) is; ties go to the first
   choice (``numpy.argmax``).

Every question stores ``[correct, correct_norm]``; ``data.choice_score`` picks the run's metric (``accuracy``
or ``accuracy_norm``, :mod:`headsweep.workers.core.metrics`). Rows are (question, choice) pairs, right-padded in
batches with an attention mask, and the logits are computed only at the positions that predict continuation
tokens. Several masks share one forward pass, and with ``sweep.reuse`` a mask starts at its first gated layer from the
batch's cached baseline states, as for perplexity (:mod:`headsweep.workers.families.hf_causal_lm.reuse`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from headsweep.workers.ablation.donors import refuse_per_example
from headsweep.workers.core.baseline_once import BaselineOnce
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, grid_batches, mask_grid
from headsweep.workers.core.metrics import MC_ACCURACY, MC_ACCURACY_NORM, Metric
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.data_report import Finding, merge, report, unknown_tokens
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.context_cache import ContextBatch, ContextCacheSwitch, context_width
from headsweep.workers.families.hf_causal_lm.model import (
    GatedCausalLM,
    activation_bytes_per_row,
    length_batches,
    model_facts,
    right_padded,
    target_nll,
)
from headsweep.workers.families.hf_causal_lm.questions import (
    Row,
    encode_requests,
    plan_rows,
    read_questions,
    request_tokens,
)
from headsweep.workers.families.hf_causal_lm.reuse import PrefixReuse, decoder_layout
from headsweep.workers.families.hf_shared.loading import max_positions
from headsweep.workers.families.hf_shared.reuse import repeat_rows
from headsweep.workers.families.hf_shared.tokenizer import count_unknown
from headsweep.workers.hub.cache import model_label
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

logger = logging.getLogger(__name__)

LOSS_NAME = "token cross-entropy of the gold continuations"
# lm-eval's HFLM.max_length when neither the model nor the tokenizer says (and the tokenizers' "no limit").
DEFAULT_MAX_LENGTH = 2048
TOKENIZER_INFINITY = 1000000000000000019884624838656
# data.choice_score -> the run's metric (config.CHOICE_SCORES names them)
METRICS_BY_SCORE = {"acc": MC_ACCURACY, "acc_norm": MC_ACCURACY_NORM}

CONVENTION = (
    "lm-evaluation-harness multiple_choice, zero-shot: choice c scored by the summed log-likelihood of "
    "target_delimiter + c after the context (trailing context whitespace moved to the continuation; "
    "continuation tokens = encode(context + continuation)[len(encode(context)):], no special tokens; empty "
    "context: BOS alone); inputs longer than max_length cut from the left; acc: argmax log-likelihood == gold; "
    "acc_norm: argmax log-likelihood / len(choice in characters) == gold"
)


def predictions(lls: np.ndarray, index: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The choice lm-eval picks for each question by ``acc`` and by ``acc_norm``, from the rows' log-likelihoods
    ``lls`` (n_rows,): ``argmax(lls)`` and ``argmax(lls / len(choice))``, the first maximum on ties.

    ``index`` (n_questions, max_choices) holds each question's rows (-1: no such choice, never picked),
    ``lengths`` the choices' lengths in characters in the same layout (1 where there is no choice).
    """
    present = index >= 0
    per_question = np.where(present, lls[np.maximum(index, 0)], -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice: lm-eval divides by zero too
        normalised = np.where(present, per_question / lengths, -np.inf)
    return per_question.argmax(axis=-1), normalised.argmax(axis=-1)


@dataclass
class RowBatch:
    """Rows right-padded to one width, on the device: ``positions[b, k]`` are the input positions whose logits
    are kept (the last ``K`` of each row, K the batch's longest continuation), ``targets[b, k]`` the tokens they
    predict, ``scored[b, k]`` whether it is a continuation token of the row (shorter continuations leave the
    first ``K - len`` unscored)."""

    rows: torch.Tensor  # indices into the adapter's rows (CPU)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor

    def repeat(self, n: int) -> RowBatch:
        """The batch stacked ``n`` times (one copy per mask)."""
        if n == 1:
            return self
        return RowBatch(self.rows, *(t.repeat(n, 1) for t in (self.input_ids, self.attention_mask, self.positions,
                                                               self.targets, self.scored)))

    @property
    def packed(self) -> torch.Tensor:
        """Everything but the input ids, one row per row: ``[attention mask (W) | positions (K) | targets (K) |
        scored (K)]`` (:func:`unpack` reads it)."""
        return torch.cat([self.attention_mask, self.positions, self.targets, self.scored.long()], dim=1)


def unpack(input_ids: torch.Tensor, packed: torch.Tensor) -> RowBatch:
    """A batch from its input ids and :attr:`RowBatch.packed` (``rows`` left empty: the rows are not needed)."""
    width = input_ids.shape[1]
    keep = (packed.shape[1] - width) // 3
    parts = [packed[:, width + i * keep : width + (i + 1) * keep] for i in range(3)]
    return RowBatch(torch.empty(0, dtype=torch.long), input_ids, packed[:, :width], parts[0], parts[1],
                    parts[2].bool())


def row_batch(rows: Sequence[Row], which: Sequence[int], device: torch.device) -> RowBatch:
    """The rows ``which`` as one right-padded batch (:func:`~.model.right_padded`)."""
    input_ids, attention, positions, targets, scored = right_padded([(rows[i].inputs, rows[i].targets)
                                                                     for i in which])
    return RowBatch(torch.tensor(list(which)), input_ids.to(device), attention.to(device), positions.to(device),
                    targets.to(device), scored.to(device))


class MultipleChoiceAdapter(GatedCausalLM, ContextCacheSwitch, BaselineOnce):
    """A gated causal LM with a multiple-choice question set (an ``EvalAdapter``)."""

    def __init__(self, model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions):
        data_cfg.check()
        # Read (and refuse) the file before loading the model: a bad line costs no model load.
        questions = read_questions(data_cfg)
        self.metric: Metric = METRICS_BY_SCORE[data_cfg.choice_score]
        self.load_gated(model_cfg, runtime)
        self.max_length, source = self._max_length()
        available = len(questions)
        if data_cfg.max_questions is not None:
            questions = questions[: data_cfg.max_questions]
        questions = at_positions(questions, runtime.examples)
        self.questions = questions
        self.delimiter = data_cfg.target_delimiter
        encoded = encode_requests(self.tokenizer, questions, self.delimiter)
        self.rows, truncated = plan_rows(questions, encoded, self.max_length, data_cfg.path, self.delimiter)
        n_choices = max(len(q.choices) for q in questions)
        self.index = np.full((len(questions), n_choices), -1, dtype=np.int64)
        self.lengths = np.ones((len(questions), n_choices), dtype=np.float64)
        for r, row in enumerate(self.rows):
            self.index[row.question, row.choice] = r
            self.lengths[row.question, row.choice] = float(len(questions[row.question].choices[row.choice]))
        self.gold = np.array([q.gold for q in questions], dtype=np.int64)
        self.gold_rows = self.index[np.arange(len(questions)), self.gold]
        self.batches = self._batches(range(len(self.rows)), runtime.batch_size)
        self._keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.model_name = model_label(model_cfg.path)
        self.dataset_name = data_cfg.name or Path(Path(data_cfg.path).name.removesuffix(".gz")).stem
        self.start_context_or_prefix(
            self.rows, runtime, True,
            lambda: PrefixReuse(self.model, self.gates, decoder_layout(self.model, self.gates.sites), self.packed_nll,
                                cache_budget(self.device)),
            "prefix: masks start at their first gated layer from cached baseline states (layer outputs and per-head "
            "contexts per batch of choices)")
        ids = [f"q{i}" for i in range(len(questions))]
        counts: dict[str, int] = {}
        for q in questions:
            counts[str(len(q.choices))] = counts.get(str(len(q.choices)), 0) + 1
        self.data_facts = {
            "task": "multiple_choice", "questions": len(questions), "questions_available": available,
            "choices_per_question": counts, "rows": len(self.rows), "target_delimiter": self.delimiter,
            "choice_score": data_cfg.choice_score, "max_length": self.max_length, "max_length_from": source,
            "convention": CONVENTION, "encoding": data_cfg.encoding,
            **merge(report(f"data file {data_cfg.path}", [Finding(
                "truncated_questions", f"questions longer than the model's {self.max_length} positions, context "
                "cut from the left", [ids[i] for i in truncated])]),
                unknown_tokens(f"data file {data_cfg.path}",
                               *count_unknown(self.tokenizer, request_tokens(encoded)), self.tokenizer.unk_token)),
        }
        self.example_ids = ids
        self._baseline: MaskOutput | None = None

    def _max_length(self) -> tuple[int, str]:
        """lm-eval's ``HFLM.max_length``: the model's positions, else the tokenizer's ``model_max_length``, else
        2048; and where it came from."""
        n = max_positions(self.model.config)
        if n:
            return n, "model config (max_position_embeddings)"
        n = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(n, int) and 0 < n < TOKENIZER_INFINITY:
            return n, "tokenizer (model_max_length)"
        return DEFAULT_MAX_LENGTH, "lm-evaluation-harness's default"

    def _batches(self, which: Sequence[int], batch_size: int) -> list[RowBatch]:
        """Rows sorted by length (little padding), ``batch_size`` rows a batch."""
        lengths = [len(row.inputs) for row in self.rows]
        return [row_batch(self.rows, rows, self.device) for rows in length_batches(which, lengths, batch_size)]

    # -- the adapter contract ------------------------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        refuse_per_example(self.runtime.ablation, "multiple-choice questions",
                           "each question is one row per choice, of its own length, so no donor lines up with it")
        baseline = self.baseline()
        acc, acc_norm = (float(v) for v in baseline.stats.mean(axis=0))
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=self.example_ids,
            references=[str(q.gold) for q in self.questions],
            inventory=self.gates.inventory,
            # the question and its numbered choices, for the run's inputs table
            inputs=[f"{q.context} | choices: " + " / ".join(f"{i}: {c}" for i, c in enumerate(q.choices))
                    for q in self.questions],
            facts={**model_facts(self.model, self.gates.sites), "reuse": self.reuse_note, **self.data_facts,
                   "baseline_acc": acc, "baseline_acc_norm": acc_norm},
        )

    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        return self.loglikelihoods(masks)

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        pred, pred_norm = predictions(values, self.index, self.lengths)
        stats = np.stack([pred == self.gold, pred_norm == self.gold], axis=1).astype(np.float64)
        # output: the choice the run's metric picks; loss: the gold continuation's NLL
        picked = pred_norm if self.metric is MC_ACCURACY_NORM else pred
        return MaskOutput(stats=stats, loss=-values[self.gold_rows], outputs=[str(p) for p in picked],
                          score=self.metric.score(stats), seconds=seconds)

    @torch.inference_mode()
    def loglikelihoods(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Each row's log-likelihood (nats, summed over its continuation tokens) under each mask: shape
        (n_masks, n_rows), float64; ``masks_per_forward`` masks share a pass
        (:func:`~headsweep.workers.core.mask_grid.mask_grid`). With prefix reuse (``sweep.reuse``) masks start at
        their first gated layer from the batch's baseline states; else every mask runs the whole model."""
        out = np.empty((len(masks), len(self.rows)), dtype=np.float64)

        def grid(start, groups: list[list[int]] | None = None) -> np.ndarray:
            return mask_grid(masks, grid_batches(self.batches, lambda b: b.rows), start, out, groups=groups,
                             masks_per_forward=lambda b: self.masks_per_forward(b.inputs))

        return self.reused_grid(masks, out, self._context_pass,
                                lambda: grid(self._reused_pass, self._reuse.groups(masks)),
                                lambda: grid(self._plain_pass))

    def _context_pass(self, batch: GridBatch[ContextBatch]):
        """The context-cache path's pass (:meth:`.context_cache.ContextCache.start`): per row, its continuation's
        log-likelihood summed as lm-eval sums it; checked once against :meth:`_plain_pass` on the first batch."""
        def plain(mask: Sequence[Head]) -> np.ndarray:
            rows = row_batch(self.rows, batch.inputs.rows.tolist(), self.device)
            return self._plain_pass(GridBatch(batch.key, rows, rows.rows))([mask]).cpu().numpy()

        forward = self._reuse.start(batch.inputs, plain, self.model.dtype, len(self.gates.sites) + 1,
                                    context_width(self.model.config, batch.inputs))
        return lambda chunk: forward(chunk)[:, 0]

    def _plain_pass(self, batch: GridBatch[RowBatch]):
        """The batch's packed forward pass: per row of the stacked batch, its continuation's log-likelihood."""
        def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
            stacked = batch.inputs.repeat(len(chunk))
            with self.gates.packed(chunk, batch.rows):
                nll = self.continuation_nll(stacked)
            return -(nll.double() * stacked.scored).sum(dim=1)

        return forward

    def _reused_pass(self, batch: GridBatch[RowBatch]):
        """The reuse path's pass (:meth:`~.reuse.PrefixReuse.start`): the batch's baseline recorded once, masks of one
        first gated layer started there; the same sums as :meth:`_plain_pass`."""
        packed = batch.inputs.packed
        forward = self._reuse.start(batch.key, batch.inputs.input_ids, packed)

        def sums(chunk: list[Sequence[Head]]) -> torch.Tensor:
            scored = unpack(batch.inputs.input_ids, repeat_rows(packed, len(chunk))).scored
            return -(forward(chunk).double() * scored).sum(dim=1)

        return sums

    def packed_nll(self, input_ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """:meth:`continuation_nll` of the batch ``input_ids`` with the rest of it in :attr:`RowBatch.packed` (what
        prefix reuse repeats once per mask)."""
        return self.continuation_nll(unpack(input_ids, packed))

    def continuation_nll(self, batch: RowBatch, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-position NLL of ``batch.targets`` at ``batch.positions`` (shape (B, K); unscored places hold
        whatever the padding gives), from one forward pass with the gates as they are set; the loss is taken in
        ``dtype`` when given (at least float32 otherwise).

        Where the model takes ``logits_to_keep`` as positions per row, only those logits are computed; otherwise
        (or if the model gives another shape) the full logits are computed and the positions taken from them.
        """
        logits = None
        if self._keep_logits:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                                logits_to_keep=batch.positions).logits
            if logits.shape[:2] != batch.positions.shape:
                self._keep_logits = False
                logger.warning("%s: logits_to_keep per row is not supported; computing every position's logits",
                               self.model_name)
                logits = None
        if logits is None:
            full = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logits = torch.take_along_dim(full, batch.positions.unsqueeze(-1), dim=1)
        if dtype is not None:
            logits = logits.to(dtype)
        return target_nll(logits, batch.targets)

    def bytes_per_row(self, batch: RowBatch) -> int:
        """Activation bytes of one row of ``batch`` (see :func:`~.model.activation_bytes_per_row`)."""
        width, keep = batch.input_ids.shape[1], batch.positions.shape[1]
        return activation_bytes_per_row(self.model.config, self.model.dtype, width,
                                        keep if self._keep_logits else width)

    def masks_per_forward(self, batch: RowBatch) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of ``batch`` as the activation budget holds."""
        rows = batch.rows.numel()
        return budget_masks_per_forward(self.runtime.masks_per_batch, max(1, rows), self.bytes_per_row(batch),
                                        self.device)

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The questions as the summed NLL of their gold continuations (``label_smoothing`` does not apply: a
        causal LM's training loss is plain token cross-entropy); the real tokens are the unpadded ones."""
        batches = self._batches([int(r) for r in self.gold_rows], self.runtime.batch_size)
        return LossBatches([self._loss_batch(b, dtype) for b in batches], LOSS_NAME)

    def _loss_batch(self, batch: RowBatch, dtype: torch.dtype) -> LossBatch:
        real = batch.attention_mask.bool()

        def loss() -> torch.Tensor:
            return (self.continuation_nll(batch, dtype) * batch.scored).sum()

        return LossBatch({site.key: real for site in self.gates.sites}, int(batch.rows.numel()), loss)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` rows around the median length (cycled if there are fewer), cut to ``max_length`` tokens
        when given."""
        batch = median_batch(self.batches, lambda b: int(b.rows.numel()))
        n = int(batch.rows.numel())
        input_ids = take_rows(batch.input_ids, n, batch_size)
        attention = take_rows(batch.attention_mask, n, batch_size)
        if max_length:
            input_ids, attention = input_ids[:, :max_length], attention[:, :max_length]
        return Workload(batch_size, int(attention.sum()),
                        lambda model: model(input_ids=input_ids, attention_mask=attention, use_cache=False))
