"""Finished evaluations, buffered and written to the store in chunks.

A chunk is one ``examples`` file and one ``evaluations`` file with the same name, written in that
order: the ``evaluations`` file commits the chunk (a resumed run trusts the evaluations it finds and
removes ``examples`` files that have none, see ``ResultStore.remove_orphans``).

Ctrl-C and SIGTERM raise ``KeyboardInterrupt`` between any two bytecodes of the driver, and the driver then
flushes what is buffered (``Sweep._stopped``). So every change of the buffer is one atomic step: an evaluation
joins it with all its example rows in one ``list.append``; a chunk keeps its name until the flush that wrote it
has cleared the buffer (one attribute store), so a flush cut short is redone under the same name, replacing the
files it wrote instead of storing them twice.
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
class Buffered:
    """The evaluations buffered since the last chunk, the name their chunk is written under, and how many
    evaluations the chunks before it stored (the writer's ``written``)."""

    stored_before: int = 0
    entries: list[tuple[dict, list[dict]]] = field(default_factory=list)  # (evaluation row, its example rows)
    name: str = field(default_factory=lambda: f"chunk-{uuid.uuid4().hex}")


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
    buffered: Buffered = field(default_factory=Buffered)
    _last_flush: float = field(default_factory=time.monotonic)

    @property
    def written(self) -> int:
        """Evaluations stored in the run so far (a resumed run's earlier ones included)."""
        return self.buffered.stored_before

    @written.setter
    def written(self, n: int) -> None:
        self.buffered.stored_before = n

    def add(self, unit: WorkUnit, out: MaskOutput, baseline_score: float, worker: str,
            positions: Sequence[int] | None = None, extra: dict | None = None) -> None:
        """Buffer one evaluation's row and its per-example rows.

        ``positions``: the evaluation set's examples ``out`` holds, in order (a screening subset); None: all of
        them. ``extra``: more columns of the ``evaluations`` row (``screen``...).
        """
        row = {
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
        rows = range(len(self.info.example_ids)) if positions is None else positions
        examples = [
            {
                "eval_id": unit.eval_id,
                "example_id": self.info.example_ids[p],
                "stats": out.stats[i].tolist(),
                "loss": None if out.loss is None else float(out.loss[i]),
                "output": out.outputs[i],
                "reference": self.info.references[p],
            }
            for i, p in enumerate(rows)
        ]
        # One step: an interrupt before it buffers nothing of this evaluation, never its row with part of its examples.
        self.buffered.entries.append((row, examples))

    def maybe_flush(self) -> None:
        """Write the buffer once it holds ``flush_every`` evaluations or is ``flush_seconds`` old."""
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        n = len(self.buffered.entries)
        if n >= self.flush_every or (n and due):
            self.flush()

    def flush(self) -> None:
        """Write what is buffered as one chunk (nothing when the buffer is empty).

        Interrupted anywhere, it can be called again: the chunk's files are written again under the same name
        (a rename replaces them), then the buffer is cleared in one step.
        """
        buffered = self.buffered
        entries = list(buffered.entries)
        if not entries:
            return
        self.store.write_rows("examples", self.run_id, [e for _, rows in entries for e in rows], buffered.name)
        self.store.write_rows("evaluations", self.run_id, [row for row, _ in entries], buffered.name)
        # The chunk is stored; from here on its name is never written again.
        self.buffered = Buffered(stored_before=buffered.stored_before + len(entries),
                                 entries=buffered.entries[len(entries):])
        self._last_flush = time.monotonic()
