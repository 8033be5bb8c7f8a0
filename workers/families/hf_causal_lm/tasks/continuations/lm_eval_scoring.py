"""Scoring lm-eval documents by the tasks' own ``process_results`` and aggregations, as headsweep statistics.

Each document's requests get their responses as ``HFLM`` gives them (``(loglikelihood, is_greedy)``, or a rolling
request's summed loglikelihood), and the task's ``process_results(doc, responses)`` turns them into its per-document
metric values. Those are stored as the document's statistics in one layout per output type, so that a metric is a
function of summed statistics (bootstrap) and of one document's (t-test, McNemar):

=======================  ==============================  ===========================================================
output type              statistics                      metrics (lm-eval's name -> the run's metric)
=======================  ==============================  ===========================================================
multiple_choice          [acc, acc_norm]                 acc -> accuracy, acc_norm -> accuracy_norm
loglikelihood            [acc (is_greedy), loglikelihood]  acc -> accuracy, perplexity -> loglikelihood_perplexity
loglikelihood_rolling    [loglikelihood, words, bytes]   word_perplexity, byte_perplexity, bits_per_byte
=======================  ==============================  ===========================================================

A value the task's metric list does not compute is NaN. One task: an evaluation's score is the task's own
aggregation of its documents' values (lm-eval's number). Several tasks (of one output type) pool their documents:
the score is the metric over the pool (for accuracies, lm-eval's size-weighted group mean), and each task's own
aggregate lands in the baseline's facts (docs/lm-eval-tasks.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.core.metrics import (
    BITS_PER_BYTE,
    BYTE_PERPLEXITY,
    LOGLIKELIHOOD_PERPLEXITY,
    LOGLIKELIHOOD_STAT_NAMES,
    MC_ACCURACY,
    MC_ACCURACY_NORM,
    WORD_PERPLEXITY,
    Metric,
    accuracy_from_stats,
)
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import TaskDocs

# lm-eval's metric names per output type, and the run's metric each is
METRICS_BY_TYPE: dict[str, dict[str, Metric]] = {
    "multiple_choice": {"acc": MC_ACCURACY, "acc_norm": MC_ACCURACY_NORM},
    "loglikelihood": {"acc": Metric("accuracy", LOGLIKELIHOOD_STAT_NAMES, accuracy_from_stats, binary=True),
                      "perplexity": LOGLIKELIHOOD_PERPLEXITY},
    "loglikelihood_rolling": {"word_perplexity": WORD_PERPLEXITY, "byte_perplexity": BYTE_PERPLEXITY,
                              "bits_per_byte": BITS_PER_BYTE},
}


def task_metrics(task: TaskDocs) -> list[str]:
    """The task's metrics (its YAML's ``metric_list``, or its output type's defaults) that headsweep scores, in
    the task's order."""
    scored = METRICS_BY_TYPE[task.output_type]
    return [m for m in task.task.aggregation() if m in scored]


def choose_metric(tasks: Sequence[TaskDocs], requested: str | None, key: str = "data") -> tuple[str, Metric]:
    """The run's metric: ``data.metric`` or the first task's first scored metric; every task must be of one output
    type and compute it."""
    types = sorted({t.output_type for t in tasks})
    if len(types) > 1:
        raise HeadsweepError(f"{key}.tasks mixes output types ({', '.join(f'{t.name}: {t.output_type}' for t in tasks)}"
                             "): a run pools its tasks' documents under one metric; run each type separately")
    output_type = types[0]
    first = task_metrics(tasks[0])
    name = requested or (first[0] if first else None)
    if name is None:
        raise HeadsweepError(f"lm-eval task {tasks[0].name!r} computes none of the metrics headsweep scores for "
                             f"{output_type} tasks ({', '.join(METRICS_BY_TYPE[output_type])})")
    if name not in METRICS_BY_TYPE[output_type]:
        raise HeadsweepError(f"{key}.metric {name} does not apply to {output_type} tasks (they give "
                             f"{', '.join(METRICS_BY_TYPE[output_type])})")
    for task in tasks:
        if name not in task_metrics(task):
            raise HeadsweepError(f"lm-eval task {task.name!r} does not compute {name} (its metrics: "
                                 f"{', '.join(task.task.aggregation()) or 'none'}); set {key}.metric or add it to "
                                 "the task's metric_list")
    return name, METRICS_BY_TYPE[output_type][name]


def document_stats(output_type: str, values: dict[str, Any]) -> list[float]:
    """One document's statistics in its output type's layout (module docstring) from ``process_results``'s
    values; NaN for a value the task does not compute."""
    nan = math.nan
    if output_type == "multiple_choice":
        return [float(values.get("acc", nan)), float(values.get("acc_norm", nan))]
    if output_type == "loglikelihood":
        return [float(values.get("acc", nan)), float(values.get("perplexity", nan))]
    ll = words = size = nan
    if "word_perplexity" in values:
        ll, words = (float(v) for v in values["word_perplexity"])
    for name in ("byte_perplexity", "bits_per_byte"):
        if name in values:
            ll, size = (float(v) for v in values[name])
    return [ll, words, size]


def aggregate(task: TaskDocs, metric: str, values: list[Any]) -> float:
    """The task's own aggregation of its documents' values of ``metric`` (lm-eval's score for the task)."""
    return float(task.task.aggregation()[metric](values))


class DocumentScorer:
    """Per-document ``process_results`` of every task, and the evaluation's score, for one run's metric."""

    def __init__(self, tasks: Sequence[TaskDocs], metric_name: str, metric: Metric):
        self.tasks = list(tasks)
        self.metric_name = metric_name
        self.metric = metric
        self.output_type = self.tasks[0].output_type

    def score(self, responses: Sequence[Sequence[Sequence[Any]]]) -> tuple[np.ndarray, float, dict[str, float]]:
        """``responses[t][d]``: the responses of task t's document d's requests. Returns every document's
        statistics (n_docs, n_stats), the evaluation's score and each task's own aggregate of the run's metric."""
        rows: list[list[float]] = []
        per_task: dict[str, float] = {}
        for task, task_responses in zip(self.tasks, responses, strict=True):
            values = []
            for (_, doc), doc_responses in zip(task.docs, task_responses, strict=True):
                result = task.task.process_results(doc, list(doc_responses))
                rows.append(document_stats(self.output_type, result))
                values.append(result[self.metric_name])
            per_task[task.name] = aggregate(task, self.metric_name, values)
        stats = np.asarray(rows, dtype=np.float64)
        score = per_task[self.tasks[0].name] if len(self.tasks) == 1 else self.metric.score(stats)
        return stats, score, per_task
