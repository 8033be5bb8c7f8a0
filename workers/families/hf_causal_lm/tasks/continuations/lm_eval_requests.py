"""lm-eval's requests as token rows: encoded by lm-eval's own ``HFLM`` around the worker's model.

A :class:`RequestRecorder` is lm-eval's ``HFLM`` wrapping the loaded model whose ``_loglikelihood_tokens`` records
the ``(context tokens, continuation tokens)`` pairs lm-eval would score instead of scoring them: so the encoding
(``_encode_pair``: trailing context whitespace moved to the continuation, the continuation sliced off the whole
encoding; an empty context replaced by the prefix token), ``max_length`` and the rolling windows
(``get_rolling_token_windows`` + ``make_disjoint_window`` with ``context_len=1``) are lm-eval's.

Each pair becomes a :class:`TokenRow` as ``HFLM._loglikelihood_tokens`` feeds it to the model: the input
``(context + continuation)[-(max_length + 1):][:-1]`` (longer requests lose context from the left, counted), the
last ``len(continuation)`` positions predicting the continuation. Identical rows are kept once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import TaskDocs


@dataclass(frozen=True)
class TokenRow:
    """One forward row: ``inputs`` (at most max_length tokens) of which the last ``len(targets)`` positions
    predict ``targets``."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]


@dataclass
class EncodedTasks:
    """Every request of every task as indices into ``rows``: ``requests[t][d][r]`` lists the rows of task t's
    document d's request r (one row; a rolling request one per window, their log-likelihoods summed in order)."""

    rows: list[TokenRow]
    requests: list[list[list[list[int]]]]
    max_length: int
    truncated: list[str]  # example ids with a request cut from the left


def recorder_class() -> type:
    """:class:`RequestRecorder`, defined on first use (importing lm-eval's HFLM imports transformers and torch)."""
    from lm_eval.models.huggingface import HFLM

    class RequestRecorder(HFLM):
        """lm-eval's HFLM that records the token pairs it would score instead of scoring them."""

        def __init__(self, model: Any, tokenizer: Any):
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1)
            self.recorded: list[tuple[list[int], list[int]]] = []

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            self.recorded.extend((list(ctx), list(cont)) for _, ctx, cont in requests)
            return [(0.0, False)] * len(requests)

    return RequestRecorder


def encode_tasks(model: Any, tokenizer: Any, tasks: list[TaskDocs]) -> EncodedTasks:
    """The rows of every request of ``tasks``, encoded by lm-eval's HFLM around ``model`` and ``tokenizer``."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    recorder = recorder_class()(model, tokenizer)
    max_length = int(recorder.max_length)
    index: dict[TokenRow, int] = {}
    rows: list[TokenRow] = []
    truncated: list[str] = []

    def row_of(ctx: list[int], cont: list[int], where: str) -> int:
        if not cont:
            raise HeadsweepError(f"{where}: a continuation tokenizes to nothing (an empty choice or target): "
                                 "lm-eval needs at least one token to score; fix the task's doc_to_choice / "
                                 "doc_to_target")
        if not ctx:
            raise HeadsweepError(f"{where}: a context tokenizes to nothing once its trailing whitespace moves to the "
                                 "continuation; lm-eval needs at least one context token")
        if len(cont) > max_length:
            raise HeadsweepError(f"{where}: a continuation of {len(cont)} tokens is longer than the model's "
                                 f"{max_length} positions")
        seq = (ctx + cont)[-(max_length + 1):]
        row = TokenRow(tuple(seq[:-1]), tuple(cont))
        if row not in index:
            index[row] = len(rows)
            rows.append(row)
        return index[row]

    out = []
    for task in tasks:
        per_doc = []
        for (doc_id, _), instances, example in zip(task.docs, task.requests, task.doc_ids(), strict=True):
            where = f"lm-eval task {task.name!r} document {doc_id}"
            doc_rows = []
            for instance in instances:
                if instance.request_type == "loglikelihood_rolling":
                    (text,) = instance.args
                    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                        token_list=recorder.tok_encode(text), prefix_token=recorder.prefix_token_id,
                        max_seq_len=max_length, context_len=1)]
                    doc_rows.append([row_of(list(c), list(t), where) for c, t in windows])
                else:
                    recorder.recorded.clear()
                    recorder.loglikelihood([instance], disable_tqdm=True)
                    ((ctx, cont),) = recorder.recorded
                    if len(ctx) + len(cont) > max_length + 1 and example not in truncated:
                        truncated.append(example)
                    doc_rows.append([row_of(ctx, cont, where)])
            per_doc.append(doc_rows)
        out.append(per_doc)
    return EncodedTasks(rows, out, max_length, truncated)
