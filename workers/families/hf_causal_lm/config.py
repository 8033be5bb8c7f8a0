"""Config sections of the ``hf_causal_lm`` model family (kept free of torch imports)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.setting_ranges import SEED, check_ranges, ranged
from headsweep.workers.data.text_files import check_encoding

# data.window when unset: this many tokens, or the model's maximum positions if it has fewer.
DEFAULT_WINDOW = 512

TASKS = ("perplexity", "multiple_choice", "paired", "lm_eval")
# lm-evaluation-harness's few-shot seed (simple_evaluate's fewshot_random_seed default)
LM_EVAL_FEWSHOT_SEED = 1234
# data.metric of data.task lm_eval: lm-eval's metric names this family scores
# (tasks/continuations/lm_eval_scoring.py maps them)
LM_EVAL_METRICS = ("acc", "acc_norm", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
CHOICE_SCORES = {"acc": "accuracy", "acc_norm": "accuracy_norm"}  # data.choice_score -> the run's metric


@dataclass
class CausalLMRuntime(RuntimeOptions):
    """How the causal-LM adapters run: :class:`RuntimeOptions` and the family's own setting, from the ``sweep`` key
    of the same name."""

    # Multiple-choice requests (data.task lm_eval): each question's context once per mask, its choices continued
    # from the context's key/value cache (reuse/context_cache.py); equal to the plain path within float32 rounding, not
    # bit for bit, so off by default.
    context_cache: bool = False


@dataclass
class CausalLMModel:
    """A transformers causal language model saved on disk (``save_pretrained`` directory).

    ``tokenizer`` is a folder with the tokenizer files when they are not in ``path``.
    """

    kind: str = "hf_causal_lm"
    path: str = ""
    tokenizer: str | None = None
    attn_implementation: str | None = None  # eager | sdpa; None lets transformers choose
    dtype: str = "float32"


def tokenizer_folder(folder: str, given: bool) -> tuple[Path, str]:
    """The folder of the model's tokenizer (``folder``: ``model.tokenizer`` when ``given``, else the model's folder;
    a hub id's cached snapshot) and what an error about it ends with (what to do)."""
    from headsweep.workers.hub.cache import is_hub_id, resolve_snapshot

    path = Path(folder).expanduser()
    if given and is_hub_id(folder):  # a hub id: its snapshot in the local Hugging Face cache
        path = resolve_snapshot(folder, require=None).folder
    if not path.is_dir():
        raise HeadsweepError(f"tokenizer directory not found: {folder} (model.tokenizer)")
    hint = (" (model.tokenizer)" if given else
            "; save the tokenizer there or set model.tokenizer to the folder it was saved to")
    return path, hint


@dataclass
class CausalLMData:
    """A text corpus scored by perplexity (``task: perplexity``, the default): plain text (``.txt``, or
    anything else; ``.gz`` is gunzipped), or JSONL / Parquet with the text in ``text_column`` (``format``
    overrides the suffix).

    The convention (it is what makes numbers comparable with published ones): the file's text as it
    is (JSONL and Parquet rows joined by newlines) is tokenised once, without special tokens; windows
    of ``window`` tokens (what the model sees, a BOS token included) are cut from it, ``stride``
    tokens apart (default: no overlap), the last partial window dropped; each window scores its
    tokens after the first, and with ``stride`` below the window only the tokens no earlier window
    scored. ``add_bos`` puts the tokenizer's BOS token at the start of every window (unscored; the
    window then takes ``window - 1`` text tokens, all scored). ``max_windows`` keeps the first windows.

    ``task: multiple_choice`` reads a JSONL file of questions instead, in lm-evaluation-harness's
    convention (:mod:`headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice`): each line holds a
    context (``context_field``), a list of choices (``choices_field``) and the index of the right one
    (``gold_field``); choice c is scored by the summed log-likelihood of ``target_delimiter + c`` after
    the context. ``choice_score`` names the run's metric: ``acc`` (accuracy: the likeliest choice) or
    ``acc_norm`` (accuracy_norm: the likeliest per character of the choice); both are stored per
    question. ``max_questions`` keeps the first questions.

    ``task: paired`` reads a JSONL file of prompt pairs for activation patching
    (:mod:`.tasks.paired`): each line holds ``clean`` and ``corrupted`` prompts that
    tokenise to the same length, the ``answer`` and ``wrong_answer`` (one token each, as the tokenizer encodes them
    alone: usually with their leading space) and optionally a ``template`` id; the metric is ``logit_diff`` (the
    answer's logit minus the wrong answer's at the last position). ``add_bos`` puts BOS before both prompts;
    ``max_pairs`` keeps the first pairs.

    ``task: lm_eval`` builds the documents and requests of lm-evaluation-harness tasks with lm-eval itself
    (:mod:`.tasks.continuations.lm_eval_tasks`): ``tasks`` names them (built-in tasks, or tasks
    in YAML files under ``include_path``), ``num_fewshot`` overrides their few-shot count as lm-eval's
    ``--num_fewshot`` does (None: the task's own), ``fewshot_seed`` is lm-eval's few-shot seed, ``limit`` keeps
    the first documents of each task, and ``metric`` names the run's metric among lm-eval's (None: the first
    task's first one this family scores). Several tasks pool their documents (docs/lm-eval-tasks.md). Task files
    outside lm-eval's package that import Python (``!function``, ``class:``) are refused unless
    ``trust_task_code`` (:mod:`~headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_code`).
    """

    path: str = ""
    format: str | None = None  # text | jsonl | parquet; None: from the suffix
    text_column: str = "text"
    name: str | None = None
    window: int | None = ranged(None, at_least=2, why=" tokens (one to condition on, one to score)")
    stride: int | None = ranged(None, at_least=1)
    add_bos: bool = False
    max_windows: int | None = ranged(None, at_least=1)
    encoding: str = "utf-8"
    task: str = "perplexity"  # perplexity | multiple_choice
    context_field: str = "context"
    choices_field: str = "choices"
    gold_field: str = "gold"
    target_delimiter: str = " "
    choice_score: str = "acc"  # acc | acc_norm: which one is the run's metric
    max_questions: int | None = ranged(None, at_least=1)
    max_pairs: int | None = ranged(None, at_least=1)
    tasks: list[str] | None = None
    include_path: str | None = None
    num_fewshot: int | None = ranged(None, at_least=0)
    fewshot_seed: int = ranged(LM_EVAL_FEWSHOT_SEED, within=SEED)
    limit: int | None = ranged(None, at_least=1, why=" document per task")
    metric: str | None = None
    # Task files outside lm-eval's package may import Python (``!function``, ``class:``): run only when trusted.
    trust_task_code: bool = False

    @property
    def paired(self) -> bool:
        """Whether the data are clean / corrupted prompt pairs (what ``sweep.ablation: patch`` needs)."""
        return self.task == "paired"

    def check(self) -> None:
        """What can be checked without the model or the file (the worker checks the rest)."""
        check_encoding(self.encoding)
        check_ranges(self, "data")
        if self.task not in TASKS:
            raise HeadsweepError(f"data.task must be perplexity, multiple_choice, paired or lm_eval, got {self.task!r}")
        if self.task == "lm_eval":
            self._check_lm_eval()
            return
        self._refuse_keys_of("lm_eval", self._lm_eval_keys())
        if self.task != "paired" and self.max_pairs is not None:
            raise HeadsweepError(f"data.max_pairs applies to data.task paired, not {self.task}: remove it, or set "
                                 "data.task: paired")
        if self.task == "multiple_choice":
            self._check_multiple_choice()
        elif self.task == "paired":
            self._check_paired()
        else:
            self._refuse_keys_of("multiple_choice", self._multiple_choice_keys())
        if not self.path:
            raise HeadsweepError("config key 'data.path' is required (a text, JSONL or Parquet file)")
        if self.format not in (None, "text", "jsonl", "parquet"):
            raise HeadsweepError(f"data.format must be text, jsonl or parquet, got {self.format!r}")

    def _perplexity_keys(self) -> list[str]:
        defaults = CausalLMData()
        keys = ["text_column", "window", "stride", "add_bos", "max_windows"]
        return [k for k in keys if getattr(self, k) != getattr(defaults, k)]

    def _multiple_choice_keys(self) -> list[str]:
        defaults = CausalLMData()
        keys = ["context_field", "choices_field", "gold_field", "target_delimiter", "choice_score", "max_questions"]
        return [k for k in keys if getattr(self, k) != getattr(defaults, k)]

    def _lm_eval_keys(self) -> list[str]:
        defaults = CausalLMData()
        keys = ["tasks", "include_path", "num_fewshot", "fewshot_seed", "limit", "metric", "trust_task_code"]
        return [k for k in keys if getattr(self, k) != getattr(defaults, k)]

    def _check_lm_eval(self) -> None:
        self._refuse_keys_of("multiple_choice", self._multiple_choice_keys())
        self._refuse_keys_of("perplexity", self._perplexity_keys())
        others = [k for k in ("path", "format", "max_pairs") if getattr(self, k) != getattr(CausalLMData(), k)]
        if others:
            raise HeadsweepError(f"data.{others[0]} does not apply to data.task lm_eval (its documents come from the "
                                 "tasks' own datasets): remove it")
        if not self.tasks or not all(isinstance(t, str) and t for t in self.tasks):
            raise HeadsweepError("data.task lm_eval needs data.tasks: a list of lm-evaluation-harness task names, "
                                 "e.g. data.tasks: [arc_easy] (tasks in your own YAML files: data.include_path)")
        if len(set(self.tasks)) < len(self.tasks):
            raise HeadsweepError(f"data.tasks names a task twice: {self.tasks}")
        if self.metric is not None and self.metric not in LM_EVAL_METRICS:
            raise HeadsweepError(f"data.metric must be one of lm-eval's {', '.join(LM_EVAL_METRICS)}, got "
                                 f"{self.metric!r}")

    def _refuse_keys_of(self, task: str, keys: list[str]) -> None:
        if keys:
            raise HeadsweepError(f"data.{keys[0]} applies to data.task {task}, not {self.task}: remove it, or "
                                 f"set data.task: {task}")

    def _check_paired(self) -> None:
        self._refuse_keys_of("multiple_choice", self._multiple_choice_keys())
        self._refuse_keys_of("perplexity", [k for k in self._perplexity_keys() if k != "add_bos"])
        if self.format not in (None, "jsonl"):
            raise HeadsweepError(f"data.task paired reads JSONL (one pair per line), so data.format must be jsonl or "
                                 f"unset, got {self.format!r}")
        if not self.path:
            raise HeadsweepError("config key 'data.path' is required (a JSONL file of prompt pairs for data.task "
                                 "paired)")

    def _check_multiple_choice(self) -> None:
        self._refuse_keys_of("perplexity", self._perplexity_keys())
        if self.format not in (None, "jsonl"):
            raise HeadsweepError(f"data.task multiple_choice reads JSONL (one question per line), so data.format "
                                 f"must be jsonl or unset, got {self.format!r}")
        if not self.path:
            raise HeadsweepError("config key 'data.path' is required (a JSONL file of questions for data.task "
                                 "multiple_choice)")
        if self.choice_score not in CHOICE_SCORES:
            raise HeadsweepError(f"data.choice_score must be acc or acc_norm, got {self.choice_score!r}")
        fields = {"context_field": self.context_field, "choices_field": self.choices_field,
                  "gold_field": self.gold_field}
        for key, value in fields.items():
            if not value:
                raise HeadsweepError(f"data.{key} must name a JSONL field, got an empty name")
        if len(set(fields.values())) < len(fields):
            raise HeadsweepError(f"data.context_field, data.choices_field and data.gold_field must name three "
                                 f"different JSONL fields, got {', '.join(repr(v) for v in fields.values())}")
