"""What an lm-eval document is, as the run's ``inputs`` table and a drill-down show it: its text and its gold choice.

The text is what the model read, from the document's own requests (lm-eval's ``Instance.args``): the context (with
its few-shot examples) and the numbered choices (multiple choice), the context and its continuation
(loglikelihood), or the whole text (rolling). The gold choice is the task's ``doc_to_target``, as
``process_results`` reads it for ``acc``.
"""

from __future__ import annotations

from typing import Any

from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import TaskDocs


def gold_choice(task: TaskDocs, d: int, n_choices: int) -> int:
    """The gold choice's index of document ``d`` of a multiple-choice ``task`` with ``n_choices`` choices: the
    target as an index, a list's first, or a choice's text; 0 where it names none of them."""
    doc = task.docs[d][1]
    gold: Any = task.task.doc_to_target(doc)
    if isinstance(gold, list):
        gold = gold[0] if gold else 0
    if isinstance(gold, str):
        choices = task.task.doc_to_choice(doc)
        gold = choices.index(gold) if gold in choices else 0
    return int(gold) if 0 <= int(gold) < n_choices else 0


def document_text(task: TaskDocs, d: int) -> str:
    """Document ``d``'s text as the model read it: ``context | choices: 0: a / 1: b`` (multiple choice),
    ``context | continuation: c`` (loglikelihood), the text (rolling)."""
    instances = task.requests[d]
    if task.output_type == "loglikelihood_rolling":
        return "".join(str(i.args[0]) for i in instances)
    context = str(instances[0].args[0])
    if task.output_type == "multiple_choice":
        return f"{context} | choices: " + " / ".join(f"{c}: {i.args[1]}" for c, i in enumerate(instances))
    return f"{context} | continuation: " + " / ".join(str(i.args[1]) for i in instances)


def document_inputs(tasks: list[TaskDocs]) -> list[str]:
    """Every document's text (:func:`document_text`), in the run's example order (tasks, then documents)."""
    return [document_text(task, d) for task in tasks for d in range(len(task.docs))]


def document_references(tasks: list[TaskDocs]) -> list[str]:
    """Every document's reference: the gold choice's index (multiple choice), else nothing."""
    return [str(gold_choice(task, d, len(task.requests[d]))) if task.output_type == "multiple_choice" else ""
            for task in tasks for d in range(len(task.docs))]
