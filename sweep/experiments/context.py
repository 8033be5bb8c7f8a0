"""What an experiment kind sees of the run: one :class:`Context` per model swept.

A run sweeps one model, or one per training checkpoint (``checkpoints``); each gets its own
context, with its workers, its eval-id prefix (``ckpt<i>/``) and its own shared results. The
context streams work units through the worker pool, writes each result as it lands and feeds
it to the significance tests; it knows which evaluations a resumed run already stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headsweep.results.store import ResultStore
from headsweep.sweep.chunks import ChunkWriter
from headsweep.sweep.dispatch import WorkerPool, units_per_call
from headsweep.sweep.plan import unique, with_prefix
from headsweep.sweep.progress import Progress
from headsweep.sweep.runs import RunRecord
from headsweep.sweep.sections import Config
from headsweep.sweep.significance_runner import SignificanceTracker
from headsweep.workers.family import DatasetInfo
from headsweep.workers.heads import HeadInventory
from headsweep.workers.work import WorkUnit


@dataclass
class Context:
    """One model of a run, as the experiment kinds see it.

    ``done``: eval id -> (score, per-example statistics) of what a resumed run already stored
    (those units are not computed again). ``shared``: results one kind leaves for the kinds that
    need it (``importance`` leaves its scores under ``"importance"``). ``writer`` and ``record``
    are None while kinds validate (nothing may be written then).
    """

    cfg: Config
    info: DatasetInfo
    pool: WorkerPool
    store: ResultStore
    run_id: str
    prefix: str = ""
    checkpoint: str | None = None
    done: Mapping[str, tuple[float, np.ndarray]] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    writer: ChunkWriter | None = None
    record: RunRecord | None = None
    show_progress: bool = True
    baseline: tuple[float, np.ndarray] | None = None  # score and statistics of the unmasked model
    tracker: SignificanceTracker | None = None

    @property
    def inventory(self) -> HeadInventory:
        return self.info.inventory

    @property
    def baseline_score(self) -> float | None:
        return None if self.baseline is None else self.baseline[0]

    def evaluate_reference(self, unit: WorkUnit) -> None:
        """Evaluate the reference every other evaluation is compared with (the unmasked model), alone.

        Its score becomes every later row's ``baseline_score``, its statistics the significance
        tests' baseline.
        """
        [unit] = with_prefix([unit], self.prefix)
        self._recording().n_planned += 1
        if unit.eval_id in self.done:
            score, stats = self.done[unit.eval_id]
        else:
            [(_, out, worker)] = self.pool.stream([unit], per_call=1)
            self.writer.add(unit, out, out.score, worker)
            self.writer.flush()
            score, stats = out.score, out.stats
        self.baseline = (score, stats)
        if self.cfg.significance.enabled:
            self.tracker = SignificanceTracker(
                self.cfg.significance, self.store, self.run_id, self.info.metric, stats, family_prefix=self.prefix
            )

    def evaluate(self, units: Sequence[WorkUnit]) -> None:
        """Stream ``units`` through the workers, writing and testing each result as it lands.

        Eval ids are given as the kinds plan them; this context's prefix is added. Units a resumed
        run already stored are not computed again; their stored statistics join the significance
        family.
        """
        record = self._recording()
        if self.baseline is None:
            raise RuntimeError("the reference (baseline) is evaluated before any other unit")
        units = unique(with_prefix(units, self.prefix))
        record.n_planned += len(units)
        tracker = self.tracker
        if tracker is not None:
            tracker.expect(units)
            for unit in units:
                if unit.eval_id in self.done:
                    tracker.add(unit, self.done[unit.eval_id][1])
        todo = [u for u in units if u.eval_id not in self.done]
        progress = Progress(len(todo), enabled=self.show_progress, detail=self.pool.status_line)
        for unit, out, worker in self.pool.stream(todo, units_per_call(self.cfg.sweep.masks_per_batch)):
            self.writer.add(unit, out, self.baseline[0], worker)
            self.writer.maybe_flush()
            if tracker is not None:
                tracker.add(unit, out.stats)
            progress.update(1, f"[{unit.eval_id}]")
            record.heartbeat()

    def write(self, table: str, rows: list[dict], name: str) -> None:
        """Write ``rows`` to ``table`` as one file of this run, named ``name`` (with this context's prefix)."""
        self._recording()
        self.store.write_rows(table, self.run_id, rows, name=(self.prefix + name).replace("/", "-"))

    def flush(self) -> None:
        """Store the evaluations written so far (before reading this run's evaluations back)."""
        if self.writer is not None:
            self.writer.flush()

    def finish(self) -> None:
        """Wait for the remaining significance tests and write their families."""
        if self.tracker is not None:
            self.tracker.finish()

    def _recording(self) -> RunRecord:
        if self.writer is None or self.record is None:
            raise RuntimeError("nothing is written while experiment kinds validate")
        return self.record
