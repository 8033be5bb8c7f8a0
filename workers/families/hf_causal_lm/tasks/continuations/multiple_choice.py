"""Multiple-choice accuracy of a causal LM, in lm-evaluation-harness's convention (``data.task: multiple_choice``).

The convention (lm-eval's ``output_type: multiple_choice`` with a Hugging Face causal LM, zero-shot; what
makes the numbers comparable with its ``acc`` and ``acc_norm``):

1. the questions are read and each choice encoded as a request, a row the model reads, as lm-eval does
   (:mod:`headsweep.workers.families.hf_causal_lm.tasks.continuations.questions`);
2. the choice's log-likelihood is the sum of the log-probabilities of its continuation tokens;
3. ``acc`` is 1 when the argmax of the log-likelihoods is the gold index, ``acc_norm`` when the argmax of
   log-likelihood / ``len(choice)`` (characters of the choice, without the delimiter) is; ties go to the first
   choice (``numpy.argmax``).

Every question stores ``[correct, correct_norm]``; ``data.choice_score`` picks the run's metric (``accuracy``
or ``accuracy_norm``, :mod:`headsweep.workers.core.metrics`). Rows are (question, choice) pairs, scored by
:mod:`.scorer` (convention ``kept_logits``: right-padded batches with an attention mask, the logits computed
only at the positions that predict continuation tokens; packed masks, prefix reuse, the context cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from headsweep.workers.ablation.donors import refuse_per_example
from headsweep.workers.core.family import DatasetInfo, MaskOutput, RuntimeOptions
from headsweep.workers.core.metrics import MC_ACCURACY, MC_ACCURACY_NORM, Metric
from headsweep.workers.data.data_report import Finding, merge, report, unknown_tokens
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.continuations.questions import (
    encode_requests,
    plan_rows,
    read_questions,
    request_tokens,
)
from headsweep.workers.families.hf_causal_lm.tasks.continuations.scorer import ContinuationAdapter, Convention
from headsweep.workers.families.hf_shared.loading import max_positions
from headsweep.workers.families.hf_shared.tokenizer import count_unknown
from headsweep.workers.hub.cache import model_label

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


class MultipleChoiceAdapter(ContinuationAdapter):
    """A gated causal LM with a multiple-choice question set (an ``EvalAdapter``)."""

    convention: Convention = "kept_logits"

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
        rows, truncated = plan_rows(questions, encoded, self.max_length, data_cfg.path, self.delimiter)
        n_choices = max(len(q.choices) for q in questions)
        self.index = np.full((len(questions), n_choices), -1, dtype=np.int64)
        self.lengths = np.ones((len(questions), n_choices), dtype=np.float64)
        for r, row in enumerate(rows):
            self.index[row.question, row.choice] = r
            self.lengths[row.question, row.choice] = float(len(questions[row.question].choices[row.choice]))
        self.gold = np.array([q.gold for q in questions], dtype=np.int64)
        self.gold_rows = self.index[np.arange(len(questions)), self.gold]
        self.model_name = model_label(model_cfg.path)
        self.dataset_name = data_cfg.name or Path(Path(data_cfg.path).name.removesuffix(".gz")).stem
        self.start_scoring(rows, runtime, True, "choices")
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

    # -- the adapter contract ------------------------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        refuse_per_example(self.runtime.ablation, "multiple-choice questions",
                           "each question is one row per choice, of its own length, so no donor lines up with it")
        baseline = self.baseline()
        acc, acc_norm = (float(v) for v in baseline.stats.mean(axis=0))
        # the question and its numbered choices, for the run's inputs table
        inputs = [f"{q.context} | choices: " + " / ".join(f"{i}: {c}" for i, c in enumerate(q.choices))
                  for q in self.questions]
        return self.dataset_info([str(q.gold) for q in self.questions], inputs,
                                 {"baseline_acc": acc, "baseline_acc_norm": acc_norm})

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        pred, pred_norm = predictions(values, self.index, self.lengths)
        stats = np.stack([pred == self.gold, pred_norm == self.gold], axis=1).astype(np.float64)
        # output: the choice the run's metric picks; loss: the gold continuation's NLL
        picked = pred_norm if self.metric is MC_ACCURACY_NORM else pred
        return MaskOutput(stats=stats, loss=-values[self.gold_rows], outputs=[str(p) for p in picked],
                          score=self.metric.score(stats), seconds=seconds)

    def loss_rows(self) -> list[int]:
        """Each question's gold choice's row."""
        return [int(r) for r in self.gold_rows]
