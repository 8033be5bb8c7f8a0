"""lm-evaluation-harness tasks under head masks (``data.task: lm_eval``): an ``EvalAdapter`` over lm-eval's requests.

1. lm-eval finds the tasks and builds each document's requests (:mod:`.lm_eval_tasks`), before the model loads;
2. lm-eval's ``HFLM`` around the loaded model encodes them into token rows (:mod:`.lm_eval_requests`);
3. per mask, every row's log-likelihood and greedy match are computed as ``HFLM._loglikelihood_tokens`` computes
   them (:mod:`.scorer`, convention ``hflm``): log-softmax of the model's float logits at the positions
   predicting the continuation, the continuation tokens' log-probabilities summed in the logits' dtype (one row at
   a time, the order lm-eval sums in), and ``is_greedy`` when the argmax is the continuation at every position; a
   rolling request sums its windows;
4. each document is scored by the task's ``process_results`` and the evaluation by its aggregation
   (:mod:`.lm_eval_scoring`).

Batching, packed masks, prefix reuse and the context cache are :mod:`.scorer`'.

The per-document loss (``examples.loss``, importance) is the negative log-likelihood of
the gold continuation: the gold choice (multiple choice), the continuation (loglikelihood), the whole text
(rolling).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from headsweep.workers.ablation.donors import refuse_per_example
from headsweep.workers.core.family import DatasetInfo, MaskOutput, RuntimeOptions
from headsweep.workers.data.data_report import Finding, report
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_documents import (
    document_inputs,
    document_references,
    gold_choice,
)
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_requests import EncodedTasks, encode_tasks
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_scoring import DocumentScorer, choose_metric
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import TaskDocs, load_tasks
from headsweep.workers.families.hf_causal_lm.tasks.continuations.scorer import ContinuationAdapter, Convention
from headsweep.workers.hub.cache import model_label

CONVENTION = (
    "lm-evaluation-harness: requests built by the tasks (TaskManager, build_all_requests, few-shot seed "
    "data.fewshot_seed), encoded by lm-eval's HFLM around the model; loglikelihood = float sum of log_softmax of "
    "the model's logits at the continuation tokens (inputs longer than max_length cut from the left); documents "
    "scored by the task's process_results, tasks by their aggregation"
)


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


class LmEvalAdapter(ContinuationAdapter):
    """A gated causal LM with lm-evaluation-harness tasks (an ``EvalAdapter``)."""

    convention: Convention = "hflm"

    def __init__(self, model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions):
        data_cfg.check()
        # lm-eval builds (and refuses) the tasks before the model loads: a bad task costs no model load
        all_tasks = load_tasks(data_cfg)
        self.metric_name, self.metric = choose_metric(all_tasks, data_cfg.metric)
        self.tasks = _subset(all_tasks, runtime.examples)
        self.load_gated(model_cfg, runtime)
        self.model_name = model_label(model_cfg.path)
        self.encoded: EncodedTasks = encode_tasks(self.model, self.tokenizer, self.tasks)
        self.scorer = DocumentScorer(self.tasks, self.metric_name, self.metric)
        self.output_type = self.tasks[0].output_type
        self.example_ids = [i for task in self.tasks for i in task.doc_ids()]
        self.gold_rows = [self._gold_rows(task, d, reqs) for t, task in enumerate(self.tasks)
                          for d, reqs in enumerate(self.encoded.requests[t])]
        self.dataset_name = data_cfg.name or "+".join(t.name for t in self.tasks)
        self.start_scoring(self.encoded.rows, runtime, self.output_type == "multiple_choice", "requests")
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

    # -- the adapter contract ------------------------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        refuse_per_example(self.runtime.ablation, "lm-eval documents",
                           "each document is one row per request, of its own length, so no donor lines up with it")
        baseline = self.baseline()
        # each document's context and choices, for the run's inputs table
        return self.dataset_info(document_references(self.tasks), document_inputs(self.tasks),
                                 {"baseline_score": baseline.score, "baseline_by_task": self._per_task})

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
        loss = np.array([-sum(ll[r] for r in rows) for rows in self.gold_rows], dtype=np.float64)
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

    def loss_rows(self) -> list[int]:
        """Every document's gold rows (:meth:`_gold_rows`), each once, in row order."""
        return sorted({r for rows in self.gold_rows for r in rows})


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
