"""The Ray actor of a sweep: loads one model and its data once, then evaluates mask batches."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import ray

from workers.tasks import DatasetInfo, MaskOutput, RuntimeOptions, task_kind


@ray.remote
class EvalWorker:
    """Holds a task adapter; ``evaluate`` takes a batch of work units and returns their outputs."""

    def __init__(self, name: str, kind: str, model_cfg: Any, data_cfg: Any, runtime: RuntimeOptions):
        # fairseq logs every dictionary and data file it loads at INFO; a sweep's log is for progress.
        logging.getLogger("fairseq").setLevel(logging.WARNING)
        self.name = name
        self._args = (kind, model_cfg, data_cfg, runtime)
        self.task = None
        self._importance_task = None
        self._importance_data = None

    def load(self) -> DatasetInfo:
        """Load model and data (errors surface here, not in the constructor, with their cause)."""
        kind, model_cfg, data_cfg, runtime = self._args
        start = time.perf_counter()
        self.task = task_kind(kind).load(model_cfg, data_cfg, runtime)
        info = self.task.describe()
        info.facts = {**info.facts, "load_seconds": round(time.perf_counter() - start, 3)}
        return info

    def importance(self, data_cfg: Any, per_token: bool, normalize: bool, mask: tuple = ()):
        """Gradient importance of every head on ``data_cfg`` (loaded once, beside the evaluation data)."""
        from workers.importance import gradient_importance

        kind, model_cfg, _, runtime = self._args
        if self._importance_task is None or self._importance_data != data_cfg:
            self._importance_task = task_kind(kind).load(model_cfg, data_cfg, runtime)
            self._importance_data = data_cfg
        return gradient_importance(self._importance_task, per_token=per_token, normalize=normalize, mask=mask)

    def efficiency(self, mask: tuple, settings: Any) -> list[dict]:
        """Parameters, peak memory and throughput of the full and the pruned model (``workers.efficiency``).

        ``settings`` is the config's ``efficiency`` section (batch sizes, warmup, repeats).
        """
        from workers.efficiency import measure_task

        if self.task is None:
            self.load()
        max_length = getattr(self._args[2], "max_length", 128)
        return measure_task(self.task, mask, settings.batch_sizes, settings.warmup, settings.repeats, max_length)

    def where(self) -> str:
        return f"{self.name}@{socket.gethostname()}:{os.getpid()}"

    def evaluate(self, units: list) -> list[tuple[str, MaskOutput]]:
        """Evaluate work units (``sweep.plan.WorkUnit``); returns ``(eval_id, output)`` pairs."""
        if self.task is None:  # Ray restarted this actor after its process died: load again
            self.load()
        outputs = self.task.evaluate([u.masked for u in units])
        return [(u.eval_id, out) for u, out in zip(units, outputs, strict=True)]
