"""What an experiment kind sees of the run: one :class:`Context` per model swept.

A run sweeps one model, or one per training checkpoint (``checkpoints``); each gets its own
context, with its workers, its eval-id prefix (``ckpt<i>/``) and its own shared results. The
context streams work units through the worker pool, writes each result as it lands and feeds
it to the significance tests; it knows which evaluations a resumed run already stored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headsweep.results.store import ResultStore
from headsweep.sweep.cluster.dispatch import WorkerPool, units_per_call
from headsweep.sweep.configuration.ablation import averaged_outcomes
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.plan import by_importance, unique, with_prefix
from headsweep.sweep.output.progress import Progress
from headsweep.sweep.run.budget import BudgetReached, SessionBudget
from headsweep.sweep.run.chunks import ChunkWriter
from headsweep.sweep.run.runs import RunRecord
from headsweep.sweep.run.screening import Screening
from headsweep.sweep.statistics.significance_runner import SignificanceTracker
from headsweep.workers.core.family import DatasetInfo
from headsweep.workers.core.heads import HeadInventory
from headsweep.workers.core.work import WorkUnit


@dataclass(frozen=True)
class KindRoles:
    """What the context asks of the run's kinds, by their declarations (``headsweep.sweep.experiments.base``; the
    driver reads them from the registry): the reference kind (its unit is the baseline of every test, not tested
    itself), the kind whose scores, left under its name in ``shared``, order the masks (None: planned order), and
    the kinds whose significant evaluations ``headsweep status`` counts while the run goes."""

    reference: str | None = None
    ordering: str | None = None
    counted: tuple[str, ...] = ()


@dataclass
class Context:
    """One model of a run, as the experiment kinds see it.

    ``done``: eval id -> (score, per-example statistics) of what a resumed run already stored
    (those units are not computed again). ``shared``: results one kind leaves for the kinds that
    need it (a kind leaves them under its name: ``importance`` its scores). ``writer`` and ``record``
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
    budget: SessionBudget | None = None  # sweep.budget, shared by the contexts of one session
    screening: Screening | None = None  # sweep.screen: the policy this model's passes consult (None: no screening)
    kinds: KindRoles = field(default_factory=lambda: KindRoles())  # what the run's kinds declare (the driver's)
    _reference: WorkUnit | None = field(default=None, repr=False)  # planned, not yet evaluated

    @property
    def inventory(self) -> HeadInventory:
        return self.info.inventory

    @property
    def baseline_score(self) -> float | None:
        return None if self.baseline is None else self.baseline[0]

    def evaluate_reference(self, unit: WorkUnit) -> None:
        """Plan the reference every other evaluation is compared with (the unmasked model).

        Its score becomes every later row's ``baseline_score``, its statistics the significance
        tests' baseline. It is not evaluated alone: it goes out first in the next :meth:`evaluate`
        pass, so every worker is busy from the start (rows that land before it wait for it). When
        no pass follows, :meth:`ensure_reference` evaluates it on its own.
        """
        [unit] = with_prefix([unit], self.prefix)
        self._recording().n_planned += 1
        if unit.eval_id in self.done:
            self._set_reference(*self.done[unit.eval_id])
        else:
            self._reference = unit

    def ensure_reference(self) -> None:
        """Evaluate a planned reference now, if no pass has taken it yet (a step kind needs the baseline)."""
        if self._reference is not None:
            self.evaluate([])

    def evaluate(self, units: Sequence[WorkUnit]) -> None:
        """Stream ``units`` through the workers, writing and testing each result as it lands.

        Eval ids are given as the kinds plan them; this context's prefix is added. Units a resumed
        run already stored are not computed again; their stored statistics join the significance
        family. A planned reference goes first in the same stream.
        """
        record = self._recording()
        reference, self._reference = self._reference, None
        if self.baseline is None and reference is None:
            raise RuntimeError("the reference (baseline) is planned before any other unit")
        units = unique(with_prefix(units, self.prefix))
        record.plan(len(units))
        todo = [u for u in units if u.eval_id not in self.done]
        if self.kinds.ordering is not None and self.kinds.ordering in self.shared:
            todo = by_importance(todo, self.shared[self.kinds.ordering])
        if self.screening is not None and todo:
            todo = self._screen(todo, self.screening.family_size(units))
        if self.budget is not None and self.budget.reached() and (todo or reference is not None):
            raise BudgetReached(self.budget.describe())
        held: list[tuple[WorkUnit, Any, str]] = []  # results that landed before the reference
        started, landed, left = time.monotonic(), 0, len(todo) + (reference is not None)

        def land(unit: WorkUnit, out: Any, worker: str) -> None:
            extra = None
            if self.screening is not None:  # the rest of a completed mask: with its subset, the whole set
                out, extra = self.screening.join(self.info.metric, unit, out), self.screening.columns(unit.eval_id)
            self.writer.add(unit, out, self.baseline[0], worker, extra=extra)
            self.writer.maybe_flush()
            if self.tracker is not None:
                self.tracker.add(unit, out.stats)

        if reference is None:
            self._expect(units)
        progress = Progress(len(todo) + (reference is not None), enabled=self.show_progress,
                            detail=self.pool.status_line)
        stream = [reference, *todo] if reference is not None else todo
        for unit, out, worker in self.pool.stream(stream, self.units_per_call()):
            if unit is reference:
                self.writer.add(unit, out, out.score, worker)
                self.writer.flush()
                self._set_reference(out.score, out.stats)
                self._expect(units)
                for args in held:
                    land(*args)
                held.clear()
            elif self.baseline is None:
                held.append((unit, out, worker))
            else:
                land(unit, out, worker)
            more = self.pool.landing_left > 0  # the rest of this call's results land at the same moment
            progress.update(1, f"[{unit.eval_id}]", more=more)
            landed, left = landed + 1, left - 1
            # progress is only read from the row, so only computed when it is written, and a call counted whole
            if not more and record.beat_due():
                self._note_progress(record, landed, left, time.monotonic() - started)
                record.heartbeat()
            if self.budget is not None:
                self.budget.count()
                # Not before the reference has landed: results held for it would be lost, and nothing stored.
                if left and self.budget.reached() and self.baseline is not None:
                    raise BudgetReached(self.budget.describe())

    def units_per_call(self) -> int:
        """Work units in one worker call (``sweep.masks_per_batch``)."""
        return units_per_call(self.cfg.sweep.masks_per_batch)

    def count_for_budget(self) -> None:
        """One more evaluation computed in this session (``sweep.budget``), checked before the next pass."""
        if self.budget is not None:
            self.budget.count()

    def _screen(self, units: list[WorkUnit], family: int) -> list[WorkUnit]:
        """The screening pass (``sweep.screen``): the screened masks of ``units`` on the subset first; screened-out
        ones are stored on the subset, the others come back to be evaluated on the rest of the set. ``family``: the
        screened masks of the significance family, stored ones included. What is screened, and how, is the
        policy's (``self.screening``)."""
        from headsweep.sweep.output.console import say

        subset = self.screening.subset_units(units, self.info.n_examples)
        if not subset:
            return units
        outputs: dict[str, tuple[Any, str]] = {}
        progress = Progress(len(subset), enabled=self.show_progress, label="screening", detail=self.pool.status_line)
        for unit, out, worker in self.pool.stream(subset, self.units_per_call()):
            outputs[unit.eval_id] = (out, worker)
            progress.update(1, f"[{unit.eval_id}]", more=self.pool.landing_left > 0)
            self._recording().heartbeat()
        judged = self.screening.judge(self.info.metric, units, outputs, self.info.n_examples, family)
        for unit, out, worker, base_score, positions, columns in judged.screened_out:
            self.writer.add(unit, out, base_score, worker, positions=positions, extra=columns)
            self.writer.maybe_flush()
            self.count_for_budget()
        say(judged.line)
        return judged.remaining

    def _note_progress(self, record: RunRecord, landed: int, left: int, elapsed: float) -> None:
        """What ``headsweep status`` shows while the run goes: stored, significant so far, ETA of this pass."""
        rate = landed / elapsed if elapsed > 0 else None
        record.progress = {
            "stored": self.writer.written, "pass_left": left, "eta_s": round(left / rate, 1) if rate else None,
            "significant_so_far": self.tracker.significant_so_far() if self.tracker is not None else None,
        }

    def _set_reference(self, score: float, stats: np.ndarray) -> None:
        self.baseline = (score, stats)
        if self.cfg.significance.enabled:
            self.tracker = SignificanceTracker(
                self.cfg.significance, self.store, self.run_id, self.info.metric, stats, family_prefix=self.prefix,
                averaged=averaged_outcomes(self.cfg), reference=self.kinds.reference, counted=self.kinds.counted,
                before_write=self.flush,
            )

    def _expect(self, units: Sequence[WorkUnit]) -> None:
        """Announce ``units`` to the significance tests; those a resumed run stored join with their statistics."""
        if self.tracker is None:
            return
        self.tracker.expect(units)
        for unit in units:
            if self.screening is not None and self.screening.is_screened(unit.eval_id):  # p = 1, no test of its own
                self.tracker.add_screened(unit)
            elif unit.eval_id in self.done:
                self.tracker.add(unit, self.done[unit.eval_id][1])

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
