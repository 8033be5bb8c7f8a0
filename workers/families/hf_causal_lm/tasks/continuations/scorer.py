"""Continuations scored under head masks: the one scoring adapter both task sources of ``hf_causal_lm`` feed.

A source gives token rows (``inputs``, of which the last ``len(targets)`` positions predict the continuation
``targets``): lm-evaluation-harness's requests (:mod:`.lm_eval_adapter`) or headsweep's own multiple-choice files
(:mod:`.multiple_choice`). Per mask, :meth:`ContinuationAdapter.loglikelihoods` gives each row's
log-likelihood (its continuation tokens' log-probabilities, summed). Rows are sorted by length and right-padded in
batches of ``sweep.batch_size``, and several masks share one forward pass (the batch repeated once per mask). With
``sweep.reuse`` (the default) a mask starts at its first gated layer from the batch's cached baseline states
(:mod:`...reuse.prefix`: one mask per pass is the plain path bit for bit); with ``sweep.context_cache`` a
question's choices continue from its context's key/value cache (:mod:`...reuse.context_cache`).

Each source keeps its own convention (:data:`Convention`), so that its numbers are what they always were:

- ``"hflm"`` (lm-eval): as ``HFLM._loglikelihood_tokens`` scores a row: every position's logits (the vocabulary
  projection of fewer positions multiplies matrices of another shape, which rounds differently), log-softmax in
  the logits' dtype, the continuation's log-probabilities summed in that dtype one row at a time (the order lm-eval
  sums in; :func:`~...model.scoring.row_sums`), and the greedy match beside it (the argmax is the continuation at every
  position); an attention mask only where a batch is padded, as HFLM passes it. Scores: (log-likelihood, greedy).
- ``"kept_logits"`` (multiple choice): only the continuation positions' logits (``logits_to_keep`` per row where the
  model takes it), the NLL in at least float32 (:func:`~...model.scoring.target_nll`) summed in float64; an
  attention mask on every batch. Scores: the log-likelihood.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from headsweep.workers.core.baseline_once import BaselineOnce
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Pass, grid_batches, mask_grid
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.families.hf_causal_lm.model.loading import GatedCausalLM, model_facts
from headsweep.workers.families.hf_causal_lm.model.scoring import (
    TokenRow,
    activation_bytes_per_row,
    length_batches,
    right_padded,
    row_sums,
    target_logprobs,
    target_nll,
)
from headsweep.workers.families.hf_causal_lm.reuse.context_cache import ContextBatch, ContextCacheSwitch, context_width
from headsweep.workers.families.hf_causal_lm.reuse.prefix import PrefixReuse, decoder_layout
from headsweep.workers.families.hf_shared.reuse import repeat_rows
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

logger = logging.getLogger(__name__)

#: How a source scores its rows (module docstring).
Convention = Literal["hflm", "kept_logits"]

LOSS_NAME = "token cross-entropy of the gold continuations"


@dataclass
class RowBatch:
    """Token rows right-padded to one width, on the device: ``positions[b, k]`` are the input positions whose
    logits are kept (the last ``K`` of each row, K the batch's longest continuation), ``targets[b, k]`` the tokens
    they predict, ``lengths[b]`` the row's continuation length (its last ``lengths[b]`` kept positions count);
    ``attention_mask`` None where the convention passes none (``hflm``, no row padded)."""

    rows: torch.Tensor  # indices into the adapter's rows (CPU)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    positions: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor  # (B,) long

    @property
    def scored(self) -> torch.Tensor:
        """(B, K) bool: whether kept position k of row b predicts one of its continuation tokens."""
        return scored_places(self.lengths, self.positions.shape[1])

    @property
    def packed(self) -> torch.Tensor:
        """Everything but the input ids in one tensor with a row per row (what prefix reuse repeats per mask):
        ``[attention mask (W) | positions (K) | targets (K) | continuation length (1)]``; :func:`unpack` reads it."""
        mask = self.attention_mask if self.attention_mask is not None else torch.ones_like(self.input_ids)
        return torch.cat([mask, self.positions, self.targets, self.lengths.unsqueeze(1)], dim=1)


def scored_places(lengths: torch.Tensor, keep: int) -> torch.Tensor:
    """(B, K) bool: the last ``lengths[b]`` of the ``keep`` places of row b (continuations are right-aligned)."""
    return torch.arange(keep, device=lengths.device).unsqueeze(0) >= keep - lengths.unsqueeze(1)


def unpack(input_ids: torch.Tensor, packed: torch.Tensor, convention: Convention) -> RowBatch:
    """A batch from its input ids and :attr:`RowBatch.packed` (``rows`` left empty: the rows are not needed); the
    attention mask dropped where ``convention`` passes none (``hflm``, no row padded)."""
    width = input_ids.shape[1]
    keep = (packed.shape[1] - width - 1) // 2
    mask = packed[:, :width]
    if convention == "hflm" and bool(mask.all()):
        mask = None
    return RowBatch(torch.empty(0, dtype=torch.long), input_ids, mask, packed[:, width : width + keep],
                    packed[:, width + keep : width + 2 * keep], packed[:, -1])


def row_batch(rows: Sequence[TokenRow], which: Sequence[int], device: torch.device,
              convention: Convention) -> RowBatch:
    """The rows ``which`` as one right-padded batch (:func:`~...model.scoring.right_padded`)."""
    input_ids, attention, positions, targets, _ = right_padded([(rows[i].inputs, rows[i].targets) for i in which])
    masked = convention != "hflm" or bool((attention == 0).any())
    lengths = torch.tensor([len(rows[i].targets) for i in which], dtype=torch.long)
    return RowBatch(torch.tensor(list(which)), input_ids.to(device), attention.to(device) if masked else None,
                    positions.to(device), targets.to(device), lengths.to(device))


class ContinuationAdapter(GatedCausalLM, ContextCacheSwitch, BaselineOnce):
    """The scoring half of an ``EvalAdapter`` over continuation rows; a source sets :attr:`convention`, loads the
    model, calls :meth:`start_scoring` with its rows and supplies ``describe``, ``output`` (its statistics from one
    mask's :meth:`loglikelihoods`) and :meth:`loss_rows`."""

    convention: Convention
    rows: Sequence[TokenRow]
    model_name: str

    def start_scoring(self, rows: Sequence[TokenRow], runtime: RuntimeOptions, shares_contexts: bool,
                      what: str) -> None:
        """Batches ``rows`` and starts reuse: the context cache where the run asks for it and rows share contexts
        (``shares_contexts``), else prefix reuse; ``what``: what a batch holds, for the reuse note."""
        self.rows = rows
        # lm-eval's HFLM computes every position's logits; multiple choice keeps the scored ones where it can
        self._keep_logits = (self.convention == "kept_logits"
                             and "logits_to_keep" in inspect.signature(self.model.forward).parameters)
        self.batches = self._batches(range(len(rows)), runtime.batch_size)
        self.grid = grid_batches(self.batches, lambda b: b.rows)
        self.start_context_or_prefix(
            rows, runtime, shares_contexts,
            lambda: PrefixReuse(self.model, self.gates, decoder_layout(self.model, self.gates.sites),
                                self.packed_pass, cache_budget(self.device)),
            "prefix: masks start at their first gated layer from cached baseline states (layer outputs and per-head "
            f"contexts per batch of {what})")

    def loss_rows(self) -> list[int]:
        """The rows whose summed NLL is the importance loss (the gold continuations), in batching order."""
        raise NotImplementedError

    def _batches(self, which: Sequence[int], batch_size: int) -> list[RowBatch]:
        """Rows sorted by length (little padding), ``batch_size`` rows a batch."""
        lengths = [len(row.inputs) for row in self.rows]
        return [self._row_batch(rows) for rows in length_batches(which, lengths, batch_size)]

    def _row_batch(self, which: Sequence[int]) -> RowBatch:
        return row_batch(self.rows, which, self.device, self.convention)

    def dataset_info(self, references: list[str], inputs: list[str], baseline_facts: dict) -> DatasetInfo:
        """What ``describe`` returns for either source: its ``references`` and ``inputs`` (one per example, for the
        run's inputs table) and the baseline's figures it records among the facts."""
        return DatasetInfo(
            model=self.model_name, dataset=self.dataset_name, metric=self.metric.name,
            stat_names=list(self.metric.stat_names), example_ids=self.example_ids, references=references,
            inputs=inputs, inventory=self.gates.inventory,
            facts={**model_facts(self.model, self.gates.sites), "reuse": self.reuse_note, **self.data_facts,
                   **baseline_facts},
        )

    # -- scores under masks -------------------------------------------------------------------------------------
    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Per row, its scores under each mask (:meth:`loglikelihoods`)."""
        return self.loglikelihoods(masks)

    @torch.inference_mode()
    def loglikelihoods(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Each row's score under each mask (module docstring): shape (n_masks, n_rows, 2) (log-likelihood,
        greedy) for ``hflm``, (n_masks, n_rows) (log-likelihood) for ``kept_logits``; float64. Through the
        mask-grid loop: the context cache or prefix reuse while it runs (masks grouped by first gated layer), else
        every mask through the whole model."""
        per_row = (2,) if self.convention == "hflm" else ()
        out = np.empty((len(masks), len(self.rows), *per_row), dtype=np.float64)

        def grid(start: Callable[[GridBatch[RowBatch]], Pass], groups: list[list[int]] | None = None) -> np.ndarray:
            return mask_grid(masks, self.grid, start, out, groups=groups,
                             masks_per_forward=lambda batch: self.masks_per_forward(batch.inputs))

        return self.reused_grid(masks, out, self._start_context,
                                lambda: grid(self._start_reused, self._reuse.groups(masks)), lambda: grid(self._start))

    def _start(self, batch: GridBatch[RowBatch]) -> Pass:
        """The plain path's packed forward pass: every mask runs the whole model; per row of the batch repeated once
        per mask, its scores."""
        input_ids, packed = batch.inputs.input_ids, batch.inputs.packed

        def forward(chunk: list[Sequence[Head]]) -> np.ndarray:
            ids, extra = repeat_rows(input_ids, len(chunk)), repeat_rows(packed, len(chunk))
            with self.gates.packed(chunk, batch.rows):
                return self._row_scores(self.packed_pass(ids, extra), extra)

        return forward

    def _start_reused(self, batch: GridBatch[RowBatch]) -> Pass:
        """The reuse path's pass (:meth:`~...reuse.prefix.PrefixReuse.start`): the batch's baseline recorded once,
        masks of one first gated layer started there; the same scores as :meth:`_start`."""
        input_ids, packed = batch.inputs.input_ids, batch.inputs.packed
        forward = self._reuse.start(batch.key, input_ids, packed)
        return lambda chunk: self._row_scores(forward(chunk), repeat_rows(packed, len(chunk)))

    def _start_context(self, batch: GridBatch[ContextBatch]) -> Pass:
        """The context-cache path's pass (:meth:`...reuse.context_cache.ContextCache.start`: log-likelihoods summed as
        HFLM sums them, whatever the convention), checked once against the plain path on the first batch."""
        def plain(mask: Sequence[Head]) -> np.ndarray:
            rows = self._row_batch(batch.inputs.rows.tolist())
            scores = self._start(GridBatch(batch.key, rows, rows.rows))([mask])
            return scores[:, 0] if scores.ndim == 2 else scores

        forward = self._reuse.start(batch.inputs, plain, self.model.dtype, len(self.gates.sites) + 1,
                                    context_width(self.model.config, batch.inputs))
        if self.convention == "hflm":
            return forward
        return lambda chunk: forward(chunk)[:, 0]

    def _row_scores(self, values: torch.Tensor, packed: torch.Tensor) -> np.ndarray:
        """Per row, its scores from :meth:`packed_pass`'s output ``values`` (module docstring)."""
        if self.convention == "hflm":
            keep = values.shape[1] // 2
            lengths = [int(c) for c in packed[:, -1].tolist()]
            return np.stack(row_sums(values[:, :keep], values[:, keep:].bool(), lengths), axis=1)
        scored = scored_places(packed[:, -1], values.shape[1])
        return (-(values.double() * scored).sum(dim=1)).cpu().numpy()

    def packed_pass(self, input_ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """One forward pass with the gates as they are set over the batch ``input_ids`` with the rest of it in
        :attr:`RowBatch.packed` (what prefix reuse repeats once per mask): per row, ``hflm``: the log-probabilities
        of its targets (K, in the logits' dtype) and whether each is the argmax (K, as 0/1), side by side (B, 2K);
        ``kept_logits``: the targets' NLL (B, K; unscored places hold whatever the padding gives)."""
        batch = unpack(input_ids, packed, self.convention)
        if self.convention == "hflm":
            extra = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask}
            logits = self.model(input_ids=input_ids, use_cache=False, **extra).logits
            return target_logprobs(logits, batch.positions, batch.targets)
        return target_nll(self.continuation_logits(batch), batch.targets)

    def continuation_logits(self, batch: RowBatch) -> torch.Tensor:
        """The logits at ``batch.positions`` (B, K, V) from one forward pass with the gates as they are set.

        With ``logits_to_keep`` (``kept_logits``, where the model takes it as positions per row) only those logits
        are computed; otherwise (or if the model gives another shape) every position's, the kept ones taken after.
        """
        extra = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask}
        if self._keep_logits:
            logits = self.model(input_ids=batch.input_ids, use_cache=False, logits_to_keep=batch.positions,
                                **extra).logits
            if logits.shape[:2] == batch.positions.shape:
                return logits
            self._keep_logits = False
            logger.warning("%s: logits_to_keep per row is not supported; computing every position's logits",
                           self.model_name)
        full = self.model(input_ids=batch.input_ids, use_cache=False, **extra).logits
        return torch.take_along_dim(full, batch.positions.unsqueeze(-1), dim=1)

    # -- memory, importance and efficiency -----------------------------------------------------------------------
    def bytes_per_row(self, batch: RowBatch) -> int:
        """Activation bytes of one row of ``batch`` (see :func:`~...model.scoring.activation_bytes_per_row`): the kept
        positions' logits, or every position's."""
        width, keep = batch.input_ids.shape[1], batch.positions.shape[1]
        return activation_bytes_per_row(self.model.config, self.model.dtype, width,
                                        keep if self._keep_logits else width)

    def masks_per_forward(self, batch: RowBatch) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of ``batch`` as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, max(1, batch.rows.numel()),
                                        self.bytes_per_row(batch), self.device,
                                        tokens_per_row=batch.input_ids.shape[1])

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The examples as the summed NLL of their gold continuations (:meth:`loss_rows`; ``label_smoothing``
        does not apply: a causal LM's training loss is plain token cross-entropy); the real tokens are the unpadded
        ones."""
        batches = self._batches(self.loss_rows(), self.runtime.batch_size)
        return LossBatches([self._loss_batch(b, dtype) for b in batches], LOSS_NAME)

    def _loss_batch(self, batch: RowBatch, dtype: torch.dtype) -> LossBatch:
        real = (batch.attention_mask.bool() if batch.attention_mask is not None else
                torch.ones_like(batch.input_ids, dtype=torch.bool))
        scored = batch.scored

        def loss() -> torch.Tensor:
            return (target_nll(self.continuation_logits(batch).to(dtype), batch.targets) * scored).sum()

        return LossBatch({site.key: real for site in self.gates.sites}, int(batch.rows.numel()), loss)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` rows around the median length (cycled if there are fewer), cut to ``max_length`` tokens
        when given; ``hflm`` rows run on their input ids alone (tokens counted with their padding), as they always
        have (the efficiency table's numbers stay comparable)."""
        batch = median_batch(self.batches, lambda b: int(b.rows.numel()))
        n = int(batch.rows.numel())
        input_ids = take_rows(batch.input_ids, n, batch_size)
        if self.convention == "hflm" or batch.attention_mask is None:
            if max_length:
                input_ids = input_ids[:, :max_length]
            return Workload(batch_size, int(input_ids.numel()),
                            lambda model: model(input_ids=input_ids, use_cache=False))
        attention = take_rows(batch.attention_mask, n, batch_size)
        if max_length:
            input_ids, attention = input_ids[:, :max_length], attention[:, :max_length]
        return Workload(batch_size, int(attention.sum()),
                        lambda model: model(input_ids=input_ids, attention_mask=attention, use_cache=False))
