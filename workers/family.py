"""The contract between the driver and a model family: a task adapter.

A task adapter holds one model, its gates, its evaluation data and its metric. It is built
once per Ray actor and then evaluates a stream of masks. Adding a model family means adding
one ``TaskKind`` below: config dataclasses for its ``model`` and ``data`` sections and the
dotted path of a loader (imported lazily, so the driver never imports fairseq or torch
models it does not use).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.heads import Head, HeadInventory
from headsweep.workers.metrics import Metric


@dataclass
class RuntimeOptions:
    """How an adapter runs: the driver's ``sweep`` section, resolved for one worker."""

    device: str = "cpu"
    batch_size: int = 32
    masks_per_batch: int = 0
    reuse: bool = True  # share work between masks (prefix/encoder reuse); False: plain reference path
    threads: int = 0
    seed: int = 0


@dataclass
class DatasetInfo:
    """What the driver needs to know about an adapter's evaluation set and model."""

    model: str
    dataset: str
    metric: str
    stat_names: list[str]
    example_ids: list[str]
    references: list[str]
    inventory: HeadInventory
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def n_examples(self) -> int:
        return len(self.example_ids)


@dataclass
class MaskOutput:
    """One evaluation of one mask: per-example statistics, loss and output, in example order."""

    stats: np.ndarray
    loss: np.ndarray
    outputs: list[str]
    score: float
    seconds: float


class TaskAdapter(Protocol):
    """What a worker actor holds: a gated model with its data and metric."""

    metric: Metric

    def describe(self) -> DatasetInfo: ...

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Evaluate each mask (the heads to gate off) on the whole evaluation set."""
        ...


@dataclass(frozen=True)
class TaskKind:
    name: str
    model_config: type
    data_config: type
    loader: str
    checkpoint_key: str = "path"  # the model key that a run over training checkpoints replaces

    def load(self, model_cfg: Any, data_cfg: Any, runtime: RuntimeOptions) -> TaskAdapter:
        module, func = self.loader.split(":")
        return getattr(importlib.import_module(module), func)(model_cfg, data_cfg, runtime)


def _registry() -> dict[str, TaskKind]:
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    kinds = [TaskKind("hf_classifier", ClassifierModel, ClassifierData,
                      "headsweep.workers.families.hf_classifier.adapter:load_classifier")]
    try:
        from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
    except ImportError:
        pass
    else:
        kinds.append(
            TaskKind(
                "fairseq_translation", TranslationModel, TranslationData,
                "headsweep.workers.families.fairseq_translation.adapter:load_translation",
                checkpoint_key="checkpoint",
            )
        )
    return {k.name: k for k in kinds}


def task_kind(name: str) -> TaskKind:
    """The task kind called ``name``, or a clear error listing the known ones.

    ``package.module:ATTRIBUTE`` names a ``TaskKind`` defined outside headsweep (a plugin); the
    module must be importable on the driver and on every worker.
    """
    if ":" in name:
        return _plugin_kind(name)
    kinds = _registry()
    if name not in kinds:
        raise HeadsweepError(
            f"unknown model.kind {name!r} (known: {', '.join(sorted(kinds))}, or module:ATTRIBUTE of a TaskKind)"
        )
    return kinds[name]


def _plugin_kind(name: str) -> TaskKind:
    module, attribute = name.split(":", 1)
    try:
        kind = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise HeadsweepError(f"model.kind {name!r}: cannot import it ({exc})") from None
    if not isinstance(kind, TaskKind):
        raise HeadsweepError(f"model.kind {name!r} is a {type(kind).__name__}, not a headsweep.workers.family.TaskKind")
    return kind
