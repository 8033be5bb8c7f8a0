"""lm-evaluation-harness tasks as ``data.task: lm_eval`` reads them: found, loaded and turned into requests by
lm-eval itself.

What is lm-eval's here: the task index (``TaskManager``, with ``data.include_path`` for the user's YAML files), the
task objects and their documents, few-shot sampling (``set_fewshot_seed`` with ``data.fewshot_seed``, as
``simple_evaluate`` seeds it), and the requests (``build_all_requests``: ``doc_to_text`` / ``doc_to_choice`` /
``doc_to_target`` and the few-shot context). What is headsweep's: reading datasets offline (local files as they
are, Hub datasets only from the local ``datasets`` cache) and refusing, in one line each, what cannot be run: an
unknown task (with its near matches), a YAML file that does not parse, a ``generate_until`` task, more few-shot
examples than the task has, a dataset that is not cached.

Nothing here needs the model: the driver runs :func:`load_tasks` before Ray starts (``check_data``), the workers
again to build their requests.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.data.text_files import describe_kind
from headsweep.workers.families.hf_causal_lm.config import CausalLMData
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_code import (
    refuse_task_code,
    sandbox_templates,
    template_refusal,
)

# The output types whose requests are log-likelihoods: what a grid of masks can score.
SUPPORTED = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
# lm-eval's full task index by include_path, built once per process (tens of seconds: thousands of YAML files)
_MANAGERS: dict[str | None, Any] = {}
DATASETS_COMMAND = "python -c \"import datasets; datasets.load_dataset({args})\""


@dataclass
class TaskDocs:
    """One lm-eval task's documents (in lm-eval's order, after ``data.limit``) and each one's requests (its
    ``Instance`` objects, sorted by ``idx`` as lm-eval sorts them before ``process_results``)."""

    name: str
    task: Any  # lm_eval.api.task.Task
    output_type: str
    docs: list[tuple[int, Any]]
    requests: list[list[Any]]
    available: int
    num_fewshot: int

    def doc_ids(self) -> list[str]:
        """Example ids: ``task/doc_id``."""
        return [f"{self.name}/{doc_id}" for doc_id, _ in self.docs]


def offline() -> None:
    """Datasets and the Hub offline in this process: Hub datasets come from the local cache or not at all."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def quiet() -> None:
    """lm-eval and datasets log every default they fill in; a sweep's terminal shows headsweep's lines."""
    for name in ("lm-eval", "lm_eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - datasets comes with lm-eval
        pass


def load_tasks(cfg: CausalLMData, key: str = "data") -> list[TaskDocs]:
    """The tasks ``cfg.tasks`` (groups expand to their tasks) with their documents and requests, or one clear
    line on what stops them."""
    offline()
    quiet()
    sandbox_templates(not cfg.trust_task_code)
    names = list(cfg.tasks or [])
    with _index_path(cfg, key) as include:
        manager = task_manager(cfg, key, include)
        if include is not None and not cfg.trust_task_code:
            refuse_task_code(manager, names, key)  # before lm-eval builds a task: building it runs its code
        loaded = _load(manager, names, key)
    out = []
    for name, task in loaded.items():
        out.append(_requests(name, task, cfg, key))
    if not out:
        raise HeadsweepError(f"{key}.tasks {cfg.tasks} hold no task")
    return out


def task_manager(cfg: CausalLMData, key: str = "data", include: str | None = None) -> Any:
    """lm-eval's task index: the YAML files under ``include`` (the folder :func:`_index_path` gives for
    ``include_path``) alone when they hold every task named (indexing lm-eval's own thousands of tasks takes tens of
    seconds), else those and lm-eval's."""
    from lm_eval.tasks import TaskManager

    names = list(cfg.tasks or [])
    if include is not None:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
        # the missing task may be in a file that does not parse: say so before indexing lm-eval's own
        broken = _unparsed_yaml(str(Path(cfg.include_path or "").expanduser()))
        if broken:
            missing = next(n for n in names if n not in local.all_tasks)
            raise HeadsweepError(f"unknown lm-eval task {missing!r} in {key}.include_path: {broken}")
    if include in _MANAGERS:
        manager = _MANAGERS[include]
    else:
        manager = TaskManager(include_path=include)
        if include is None or not Path(cfg.include_path or "").expanduser().is_file():  # not a passing folder
            _MANAGERS[include] = manager
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise HeadsweepError(_unknown(unknown[0], manager.all_tasks, cfg.include_path, key))
    return manager


@contextlib.contextmanager
def _index_path(cfg: CausalLMData, key: str) -> Iterator[str | None]:
    """The folder lm-eval indexes for ``include_path``: the folder itself, or for one task file a temporary folder
    holding only a link to it (lm-eval indexes folders alone: it finds no task in a file's path), removed once the
    tasks are built. lm-eval resolves the link before reading the file, so the file's ``include:`` and ``!function``
    entries are found beside the real file."""
    if cfg.include_path is None:
        yield None
        return
    path = Path(cfg.include_path).expanduser()
    if not path.exists():
        raise HeadsweepError(f"{key}.include_path not found: {cfg.include_path} (a folder of lm-eval task YAML files, "
                             "or one such file)")
    if path.is_file():
        with tempfile.TemporaryDirectory(prefix="headsweep-lm-eval-task-") as folder:
            (Path(folder) / f"{path.stem}.yaml").symlink_to(path.resolve())  # lm-eval indexes no other suffix
            yield folder
        return
    if not path.is_dir():
        raise HeadsweepError(f"{key}.include_path {cfg.include_path} is {describe_kind(path)}, not a regular file or "
                             "folder: name a folder of lm-eval task YAML files, or one such file")
    for file in path.rglob("*.yaml"):  # lm-eval's index opens each one: a FIFO among them would block it forever
        if file.exists() and not file.is_file() and not file.is_dir():
            raise HeadsweepError(f"{key}.include_path holds {file}, which is {describe_kind(file)}, not a regular "
                                 "file: remove it from the task folder")
    yield str(path)


def _unknown(name: str, known: list[str], include: str | None, key: str) -> str:
    near = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f" (near matches: {', '.join(near)})" if near else ""
    where = (f" nor in {key}.include_path {include}" if include else
             f"; a task in your own YAML file needs {key}.include_path")
    return f"unknown lm-eval task {name!r}{hint}: not one of lm-eval's tasks{where}"


def _unparsed_yaml(include: str) -> str | None:
    """The first YAML file under ``include`` that does not parse (lm-eval's index skips such files silently), as
    ``file: line N: problem``."""
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML with lm-eval's tags (``!function``) read as plain values: only the syntax is checked here."""

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    root = Path(include)
    files = [root] if root.is_file() else sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")])
    for path in files:
        try:
            yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f": line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            return f"task file {path} does not parse as YAML{line}: {problem}"
    return None


def _load(manager: Any, names: list[str], key: str) -> dict[str, Any]:
    """``TaskManager.load``: the leaf tasks by name, their datasets read (offline)."""
    try:
        loaded = manager.load(names)
    except (ConnectionError, OSError) as exc:
        raise HeadsweepError(_dataset_message(exc, names, key)) from None
    except Exception as exc:  # lm-eval raises what its YAML and datasets raise: say which task and what
        refused = template_refusal(exc, ", ".join(names), key)
        if refused is not None:
            raise refused from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HeadsweepError(f"lm-eval cannot load {key}.tasks {names}: {type(exc).__name__}: {first}") from None
    return dict(loaded["tasks"])


def _dataset_message(exc: BaseException, names: list[str], key: str) -> str:
    text = str(exc)
    if "Hub" in text or "offline" in text.lower() or "OfflineModeIsEnabled" in text:
        # "Couldn't reach 'org/name' on the Hub (OfflineModeIsEnabled)"
        found = re.search(r"reach '([^']+)'", text)
        dataset = found.group(1) if found else "the task's dataset"
        return (f"{key}.tasks {names}: dataset {dataset} is not in the local datasets cache (headsweep reads Hub "
                f"datasets offline, HF_DATASETS_OFFLINE=1): fetch it once on a machine with network, e.g. "
                f"{DATASETS_COMMAND.format(args=repr(dataset))} (with the task's dataset_name as a second "
                "argument), with the same HF_HOME")
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    return f"{key}.tasks {names}: cannot read the task's data: {first}"


def _requests(name: str, task: Any, cfg: CausalLMData, key: str) -> TaskDocs:
    """The task's documents and requests, as ``simple_evaluate`` and ``evaluate`` build them on one process."""
    output_type = task.get_config("output_type")
    if output_type not in SUPPORTED:
        raise HeadsweepError(f"lm-eval task {name!r} is a {output_type} task: headsweep scores log-likelihood tasks "
                             f"({', '.join(SUPPORTED)}); generation under a grid of masks is not supported")
    # simple_evaluate's rule: a task whose YAML sets num_fewshot: 0 keeps it; otherwise the override, or the
    # task's own default (0 if it has none)
    if cfg.num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=cfg.num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    shots = int(task.get_config("num_fewshot") or 0)
    task.set_fewshot_seed(seed=cfg.fewshot_seed)
    available = len(task.eval_docs)
    if shots:
        pool = task.fewshot_docs()
        size = 0 if pool is None else len(pool)
        if shots > size:
            raise HeadsweepError(f"{key}.num_fewshot {shots} is more than the {size} documents task {name!r} has "
                                 "for few-shot examples: lower data.num_fewshot")
    from lm_eval.evaluator_utils import get_sample_size

    limit = get_sample_size(task, cfg.limit)
    try:
        task.build_all_requests(limit=limit, rank=0, world_size=1)
    except Exception as exc:
        refused = template_refusal(exc, name, key)
        if refused is not None:
            raise refused from None
        if not isinstance(exc, ValueError):
            raise
        if "larger than population" in str(exc):
            raise HeadsweepError(f"{key}.num_fewshot {shots}: task {name!r} has too few documents for "
                                 f"{shots} few-shot examples besides the one evaluated: lower data.num_fewshot"
                                 ) from None
        raise
    by_doc: dict[int, list[Any]] = defaultdict(list)
    for instance in task.instances:
        by_doc[instance.doc_id].append(instance)
    docs = list(task.doc_iterator(rank=0, limit=limit, world_size=1))
    if not docs:
        raise HeadsweepError(f"lm-eval task {name!r} has no documents to evaluate")
    requests = [sorted(by_doc[doc_id], key=lambda x: x.idx) for doc_id, _ in docs]
    for (doc_id, _), reqs in zip(docs, requests, strict=True):
        if output_type == "multiple_choice" and not reqs:
            raise HeadsweepError(f"lm-eval task {name!r}: document {doc_id} has no choices (doc_to_choice gave an "
                                 "empty list)")
    return TaskDocs(name, task, output_type, docs, requests, available, shots)
