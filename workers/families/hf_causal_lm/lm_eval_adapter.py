"""lm-evaluation-harness tasks under head masks (``data.task: lm_eval``): an ``EvalAdapter`` over lm-eval's requests.

1. lm-eval finds the tasks and builds each document's requests (:mod:`.lm_eval_tasks`), before the model loads;
2. lm-eval's ``HFLM`` around the loaded model encodes them into token rows (:mod:`.lm_eval_requests`);
3. per mask, every row's log-likelihood and greedy match are computed as ``HFLM._loglikelihood_tokens`` computes
   them: log-softmax of the model's float logits at the positions predicting the continuation, the continuation
   tokens' log-probabilities summed in the logits' dtype (one row at a time, the order lm-eval sums in), and
   ``is_greedy`` when the argmax is the continuation at every position; a rolling request sums its windows;
4. each document is scored by the task's ``process_results`` and the evaluation by its aggregation
   (:mod:`.lm_eval_scoring`).

Rows are sorted by length and right-padded in batches of ``sweep.batch_size`` (a batch with padding passes an
attention mask; one without passes none, as HFLM does), and several masks share one forward pass (the batch
repeated once per mask). With ``sweep.reuse`` (the default) a mask starts at its first gated layer from the batch's
cached baseline states (:mod:`.reuse`: the context and continuations below that layer run once per batch, not once
per mask); with one mask per pass that is the plain path bit for bit.

The per-document loss (``examples.loss``, importance) is the negative log-likelihood of
the gold continuation: the gold choice (multiple choice), the continuation (loglikelihood), the whole text
(rolling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from headsweep.workers.ablation.donors import refuse_per_example
from headsweep.workers.core.baseline_once import BaselineOnce
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Pass, grid_batches, mask_grid
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.data_report import Finding, report
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.context_cache import ContextBatch, ContextCacheSwitch, context_width
from headsweep.workers.families.hf_causal_lm.lm_eval_documents import document_inputs, document_references, gold_choice
from headsweep.workers.families.hf_causal_lm.lm_eval_requests import EncodedTasks, TokenRow, encode_tasks
from headsweep.workers.families.hf_causal_lm.lm_eval_scoring import DocumentScorer, choose_metric
from headsweep.workers.families.hf_causal_lm.lm_eval_tasks import TaskDocs, load_tasks
from headsweep.workers.families.hf_causal_lm.model import (
    GatedCausalLM,
    activation_bytes_per_row,
    length_batches,
    model_facts,
    right_padded,
    row_sums,
    target_logprobs,
    target_nll,
)
from headsweep.workers.families.hf_causal_lm.reuse import PrefixReuse, decoder_layout
from headsweep.workers.families.hf_shared.reuse import repeat_rows
from headsweep.workers.hub.cache import model_label
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

LOSS_NAME = "token cross-entropy of the gold continuations"
CONVENTION = (
    "lm-evaluation-harness: requests built by the tasks (TaskManager, build_all_requests, few-shot seed "
    "data.fewshot_seed), encoded by lm-eval's HFLM around the model; loglikelihood = float sum of log_softmax of "
    "the model's logits at the continuation tokens (inputs longer than max_length cut from the left); documents "
    "scored by the task's process_results, tasks by their aggregation"
)


@dataclass
class RowBatch:
    """Token rows right-padded to one width, on the device: ``positions[b, k]`` are the input positions whose
    logits are kept (the last ``K`` of each row, K the batch's longest continuation), ``targets[b, k]`` the tokens
    they predict, ``lengths[b]`` the row's continuation length (its last ``lengths[b]`` kept positions count);
    ``attention_mask`` None where no row is padded."""

    rows: torch.Tensor  # indices into the adapter's rows (CPU)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    positions: torch.Tensor
    targets: torch.Tensor
    lengths: list[int]

    @property
    def packed(self) -> torch.Tensor:
        """Everything but the input ids in one tensor with a row per row (what prefix reuse repeats per mask):
        ``[attention mask (W) | positions (K) | targets (K) | continuation length (1)]``; :func:`unpack` reads it."""
        mask = (self.attention_mask if self.attention_mask is not None else
                torch.ones_like(self.input_ids))
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.input_ids.device).unsqueeze(1)
        return torch.cat([mask, self.positions, self.targets, lengths], dim=1)


def unpack(input_ids: torch.Tensor, packed: torch.Tensor
           ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:attr:`RowBatch.packed` back into the attention mask (None where no row is padded), positions, targets and
    continuation lengths."""
    width = input_ids.shape[1]
    keep = (packed.shape[1] - width - 1) // 2
    mask = packed[:, :width]
    return (None if bool(mask.all()) else mask, packed[:, width : width + keep],
            packed[:, width + keep : width + 2 * keep], packed[:, -1])


def row_batch(rows: Sequence[TokenRow], which: Sequence[int], device: torch.device) -> RowBatch:
    """The rows ``which`` as one right-padded batch (:func:`~.model.right_padded`)."""
    input_ids, attention, positions, targets, _ = right_padded([(rows[i].inputs, rows[i].targets) for i in which])
    padded = bool((attention == 0).any())
    return RowBatch(torch.tensor(list(which)), input_ids.to(device), attention.to(device) if padded else None,
                    positions.to(device), targets.to(device), [len(rows[i].targets) for i in which])


def _subset(tasks: list[TaskDocs], examples: tuple[int, ...] | None) -> list[TaskDocs]:
    """The tasks cut to the documents at ``examples`` (positions over all tasks' documents in order); tasks left
    with none dropped."""
    if examples is None:
        return tasks
    flat = [(t, d) for t, task in enumerate(tasks) for d in range(len(task.docs))]
    keep = at_positions(flat, examples)
    out = []
    for t, task in enumerate(tasks):
        mine = [d for tt, d in keep if tt == t]
        if mine:
            out.append(replace(task, docs=[task.docs[d] for d in mine], requests=[task.requests[d] for d in mine]))
    return out


class LmEvalAdapter(GatedCausalLM, ContextCacheSwitch, BaselineOnce):
    """A gated causal LM with lm-evaluation-harness tasks (an ``EvalAdapter``)."""

    def __init__(self, model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions):
        data_cfg.check()
        # lm-eval builds (and refuses) the tasks before the model loads: a bad task costs no model load
        all_tasks = load_tasks(data_cfg)
        self.metric_name, self.metric = choose_metric(all_tasks, data_cfg.metric)
        self.tasks = _subset(all_tasks, runtime.examples)
        self.load_gated(model_cfg, runtime)
        self.model_name = model_label(model_cfg.path)
        self.encoded: EncodedTasks = encode_tasks(self.model, self.tokenizer, self.tasks)
        self.rows = self.encoded.rows
        self.scorer = DocumentScorer(self.tasks, self.metric_name, self.metric)
        self.output_type = self.tasks[0].output_type
        self.example_ids = [i for task in self.tasks for i in task.doc_ids()]
        self.loss_rows = [self._gold_rows(task, d, reqs) for t, task in enumerate(self.tasks)
                          for d, reqs in enumerate(self.encoded.requests[t])]
        self.batches = self._batches(range(len(self.rows)), runtime.batch_size)
        self.grid = grid_batches(self.batches, lambda b: b.rows)
        self.dataset_name = data_cfg.name or "+".join(t.name for t in self.tasks)
        self.start_context_or_prefix(
            self.rows, runtime, self.output_type == "multiple_choice",
            lambda: PrefixReuse(self.model, self.gates, decoder_layout(self.model, self.gates.sites),
                                self.packed_pass, cache_budget(self.device)),
            "prefix: masks start at their first gated layer from cached baseline states (layer outputs and per-head "
            "contexts per batch of requests)")
        self.data_facts = {
            "task": "lm_eval", "lm_eval_tasks": [t.name for t in self.tasks],
            "output_type": self.output_type, "lm_eval_metric": self.metric_name,
            "documents": {t.name: len(t.docs) for t in self.tasks},
            "documents_available": {t.name: t.available for t in self.tasks},
            "num_fewshot": {t.name: t.num_fewshot for t in self.tasks}, "fewshot_seed": data_cfg.fewshot_seed,
            "limit": data_cfg.limit, "rows": len(self.rows), "max_length": self.encoded.max_length,
            "convention": CONVENTION, "lm_eval_version": _lm_eval_version(),
            **report("lm-eval tasks", [Finding(
                "truncated_documents", f"documents with a request longer than the model's {self.encoded.max_length} "
                "positions, context cut from the left as lm-eval cuts it", self.encoded.truncated)]),
        }
        self._baseline: MaskOutput | None = None
        self._per_task: dict[str, float] = {}

    def _gold_rows(self, task: TaskDocs, d: int, requests: list[list[int]]) -> list[int]:
        """The rows whose NLL is the document's loss: the gold choice's (multiple choice), else every row."""
        if task.output_type != "multiple_choice":
            return [r for request in requests for r in request]
        return list(requests[gold_choice(task, d, len(requests))])

    def _batches(self, which: Sequence[int], batch_size: int) -> list[RowBatch]:
        """Rows sorted by length (little padding), ``batch_size`` rows a batch."""
        lengths = [len(row.inputs) for row in self.rows]
        return [row_batch(self.rows, rows, self.device) for rows in length_batches(which, lengths, batch_size)]

    # -- the adapter contract ------------------------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        refuse_per_example(self.runtime.ablation, "lm-eval documents",
                           "each document is one row per request, of its own length, so no donor lines up with it")
        baseline = self.baseline()
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=self.example_ids,
            references=document_references(self.tasks),
            inputs=document_inputs(self.tasks),  # each document's context and choices, for the run's inputs table
            inventory=self.gates.inventory,
            facts={**model_facts(self.model, self.gates.sites), "reuse": self.reuse_note, **self.data_facts,
                   "baseline_score": baseline.score, "baseline_by_task": self._per_task},
        )

    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        return self.loglikelihoods(masks)

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        """One mask's rows ``values`` (n_rows, 2: loglikelihood, greedy) scored by the tasks."""
        ll = [float(v) for v in values[:, 0]]
        greedy = [bool(v) for v in values[:, 1]]
        responses = []
        for t, task in enumerate(self.tasks):
            per_doc = []
            for requests in self.encoded.requests[t]:
                if task.output_type == "loglikelihood_rolling":
                    per_doc.append([sum(ll[r] for r in request) for request in requests])
                else:
                    per_doc.append([(ll[request[0]], greedy[request[0]]) for request in requests])
            responses.append(per_doc)
        stats, score, per_task = self.scorer.score(responses)
        if not self._per_task:
            self._per_task = per_task
        loss = np.array([-sum(ll[r] for r in rows) for rows in self.loss_rows], dtype=np.float64)
        outputs = self._outputs(responses)
        return MaskOutput(stats=stats, loss=loss, outputs=outputs, score=score, seconds=seconds)

    def _outputs(self, responses: list[list[list[Any]]]) -> list[str]:
        """What each document's model chose: the likeliest choice (multiple choice), whether the continuation is
        the greedy one (loglikelihood); nothing for rolling text."""
        out = []
        for per_doc in responses:
            for doc in per_doc:
                if self.output_type == "multiple_choice":
                    out.append(str(int(np.argmax([ll for ll, _ in doc]))))
                elif self.output_type == "loglikelihood":
                    out.append(str(bool(doc[0][1])).lower())
                else:
                    out.append("")
        return out

    @torch.inference_mode()
    def loglikelihoods(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Each row's (loglikelihood, greedy) under each mask: shape (n_masks, n_rows, 2), float64 holding the
        float lm-eval would compute; through the mask-grid loop, with prefix reuse while it runs (masks grouped by
        first gated layer, each group starting there from the batch's baseline states)."""
        out = np.empty((len(masks), len(self.rows), 2), dtype=np.float64)

        def grid(start: Callable[[GridBatch[RowBatch]], Pass], groups: list[list[int]] | None = None) -> np.ndarray:
            return mask_grid(masks, self.grid, start, out, groups=groups,
                             masks_per_forward=lambda batch: self.masks_per_forward(batch.inputs))

        return self.reused_grid(masks, out, self._start_context,
                                lambda: grid(self._start_reused, self._reuse.groups(masks)), lambda: grid(self._start))

    def _start(self, batch: GridBatch[RowBatch]) -> Pass:
        """The plain path's packed forward pass: every mask runs the whole model; per row of the batch repeated once
        per mask, (loglikelihood, greedy)."""
        input_ids, packed = batch.inputs.input_ids, batch.inputs.packed

        def forward(chunk: list[Sequence[Head]]) -> np.ndarray:
            ids, extra = repeat_rows(input_ids, len(chunk)), repeat_rows(packed, len(chunk))
            with self.gates.packed(chunk, batch.rows):
                return self._sums(self.packed_pass(ids, extra), extra)

        return forward

    def _start_reused(self, batch: GridBatch[RowBatch]) -> Pass:
        """The reuse path's pass (:meth:`~.reuse.PrefixReuse.start`): the batch's baseline recorded once, masks of
        one first gated layer started there."""
        input_ids, packed = batch.inputs.input_ids, batch.inputs.packed
        forward = self._reuse.start(batch.key, input_ids, packed)
        return lambda chunk: self._sums(forward(chunk), repeat_rows(packed, len(chunk)))

    def _start_context(self, batch: GridBatch[ContextBatch]) -> Pass:
        """The context-cache path's pass (:meth:`.context_cache.ContextCache.start`), checked once against the plain
        path on the first batch."""
        def plain(mask: Sequence[Head]) -> np.ndarray:
            rows = row_batch(self.rows, batch.inputs.rows.tolist(), self.device)
            return self._start(GridBatch(batch.key, rows, rows.rows))([mask])[:, 0]

        return self._reuse.start(batch.inputs, plain, self.model.dtype, len(self.gates.sites) + 1,
                                 context_width(self.model.config, batch.inputs))

    @staticmethod
    def _sums(values: torch.Tensor, packed: torch.Tensor) -> np.ndarray:
        """(loglikelihood, greedy) per row from :meth:`packed_pass`'s output (module docstring: HFLM's sum)."""
        keep = values.shape[1] // 2
        lengths = [int(c) for c in packed[:, -1].tolist()]
        return np.stack(row_sums(values[:, :keep], values[:, keep:].bool(), lengths), axis=1)

    def packed_pass(self, input_ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """One forward pass with the gates as they are set: per row the log-probabilities of its targets (K, in
        the logits' dtype) and whether each is the argmax (K, as 0/1), side by side: shape (B, 2K)."""
        mask, positions, targets, _ = unpack(input_ids, packed)
        extra: dict[str, Any] = {} if mask is None else {"attention_mask": mask}
        # every position's logits, as HFLM computes them: the vocabulary projection of fewer positions (logits_to_keep)
        # multiplies matrices of another shape, which rounds differently
        return target_logprobs(self.model(input_ids=input_ids, use_cache=False, **extra).logits, positions, targets)

    def _logits(self, batch: RowBatch) -> torch.Tensor:
        """The logits at ``batch.positions`` (B, K, V) from one forward pass with the gates as they are set."""
        extra: dict[str, Any] = {}
        if batch.attention_mask is not None:
            extra["attention_mask"] = batch.attention_mask
        full = self.model(input_ids=batch.input_ids, use_cache=False, **extra).logits
        return torch.take_along_dim(full, batch.positions.unsqueeze(-1), dim=1)

    def bytes_per_row(self, batch: RowBatch) -> int:
        """Activation bytes of one row of ``batch`` (see :func:`~.model.activation_bytes_per_row`): every position's
        logits are computed, as HFLM computes them."""
        width = batch.input_ids.shape[1]
        return activation_bytes_per_row(self.model.config, self.model.dtype, width, width)

    def masks_per_forward(self, batch: RowBatch) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of ``batch`` as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, max(1, batch.rows.numel()),
                                        self.bytes_per_row(batch), self.device)

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The documents as the summed NLL of their gold continuations (``label_smoothing`` does not apply: a causal
        LM's training loss is plain token cross-entropy); the real tokens are the unpadded ones."""
        rows = sorted({r for rows in self.loss_rows for r in rows})
        return LossBatches([self._loss_batch(b, dtype) for b in self._batches(rows, self.runtime.batch_size)],
                           LOSS_NAME)

    def _loss_batch(self, batch: RowBatch, dtype: torch.dtype) -> LossBatch:
        width = batch.input_ids.shape[1]
        real = (batch.attention_mask.bool() if batch.attention_mask is not None else
                torch.ones(batch.input_ids.shape[0], width, dtype=torch.bool, device=batch.input_ids.device))
        keep = batch.positions.shape[1]
        scored = (torch.arange(keep, device=batch.input_ids.device).unsqueeze(0)
                  >= keep - torch.tensor(batch.lengths, device=batch.input_ids.device).unsqueeze(1))

        def loss() -> torch.Tensor:
            return (target_nll(self._logits(batch).to(dtype), batch.targets) * scored).sum()

        return LossBatch({site.key: real for site in self.gates.sites}, int(batch.rows.numel()), loss)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` rows around the median length (cycled if there are fewer), cut to ``max_length`` tokens
        when given."""
        batch = median_batch(self.batches, lambda b: int(b.rows.numel()))
        n = int(batch.rows.numel())
        input_ids = take_rows(batch.input_ids, n, batch_size)
        if max_length:
            input_ids = input_ids[:, :max_length]
        return Workload(batch_size, int(input_ids.numel()),
                        lambda model: model(input_ids=input_ids, use_cache=False))


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
