"""The Ray actor of a sweep: loads one model and its data once, then evaluates mask batches."""

from __future__ import annotations

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
        self.name = name
        self._args = (kind, model_cfg, data_cfg, runtime)
        self.task = None

    def load(self) -> DatasetInfo:
        """Load model and data (errors surface here, not in the constructor, with their cause)."""
        kind, model_cfg, data_cfg, runtime = self._args
        start = time.perf_counter()
        self.task = task_kind(kind).load(model_cfg, data_cfg, runtime)
        info = self.task.describe()
        info.facts = {**info.facts, "load_seconds": round(time.perf_counter() - start, 3)}
        return info

    def where(self) -> str:
        return f"{self.name}@{socket.gethostname()}:{os.getpid()}"

    def evaluate(self, units: list) -> list[tuple[str, MaskOutput]]:
        """Evaluate work units (``sweep.plan.WorkUnit``); returns ``(eval_id, output)`` pairs."""
        outputs = self.task.evaluate([u.masked for u in units])
        return [(u.eval_id, out) for u, out in zip(units, outputs, strict=True)]
