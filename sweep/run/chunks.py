"""Finished evaluations, buffered and written to the store in chunks.

A chunk is one ``examples`` file and one ``evaluations`` file with the same name, written in that
order: the ``evaluations`` file commits the chunk (a resumed run trusts the evaluations it finds and
removes ``examples`` files that have none, see ``ResultStore.remove_orphans``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from headsweep.results.store import ResultStore
from headsweep.workers.core.family import DatasetInfo, MaskOutput
from headsweep.workers.core.work import WorkUnit


@dataclass
class ChunkWriter:
    """Buffers finished evaluations and writes them as chunks (examples, then evaluations)."""

    store: ResultStore
    run_id: str
    info: DatasetInfo
    flush_every: int
    flush_seconds: float
    checkpoint: str | None = None
    ablation: str = "zero"  # sweep.ablation, recorded on every row
    eval_rows: list[dict] = field(default_factory=list)
    example_rows: list[dict] = field(default_factory=list)
    written: int = 0
    _last_flush: float = field(default_factory=time.monotonic)

    def add(self, unit: WorkUnit, out: MaskOutput, baseline_score: float, worker: str,
            positions: Sequence[int] | None = None, extra: dict | None = None) -> None:
        """Buffer one evaluation's row and its per-example rows.

        ``positions``: the evaluation set's examples ``out`` holds, in order (a screening subset); None: all of
        them. ``extra``: more columns of the ``evaluations`` row (``screen``...).
        """
        self.eval_rows.append(
            {
                "eval_id": unit.eval_id,
                "experiment": unit.experiment,
                "attention": unit.attention,
                "layer": unit.layer,
                "head": unit.head,
                "heads_masked": [str(h) for h in unit.masked],
                "n_masked": len(unit.masked),
                "level": unit.level,
                "checkpoint": self.checkpoint,
                "metric": self.info.metric,
                "score": out.score,
                "baseline_score": baseline_score,
                "delta": out.score - baseline_score,
                "n_examples": len(out.outputs),
                "seconds": out.seconds,
                "worker": worker,
                "finished_at": datetime.now(UTC),
                "ablation": self.ablation,
                **(extra or {}),
            }
        )
        rows = range(len(self.info.example_ids)) if positions is None else positions
        for i, p in enumerate(rows):
            self.example_rows.append(
                {
                    "eval_id": unit.eval_id,
                    "example_id": self.info.example_ids[p],
                    "stats": out.stats[i].tolist(),
                    "loss": None if out.loss is None else float(out.loss[i]),
                    "output": out.outputs[i],
                    "reference": self.info.references[p],
                }
            )

    def maybe_flush(self) -> None:
        """Write the buffer once it holds ``flush_every`` evaluations or is ``flush_seconds`` old."""
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if len(self.eval_rows) >= self.flush_every or (self.eval_rows and due):
            self.flush()

    def flush(self) -> None:
        """Write what is buffered as one chunk (nothing when the buffer is empty)."""
        if not self.eval_rows:
            return
        name = f"chunk-{uuid.uuid4().hex}"
        self.store.write_rows("examples", self.run_id, self.example_rows, name)
        self.store.write_rows("evaluations", self.run_id, self.eval_rows, name)
        self.written += len(self.eval_rows)
        self.eval_rows, self.example_rows = [], []
        self._last_flush = time.monotonic()
