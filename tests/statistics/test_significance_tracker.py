"""The significance tracker's two routes write the same rows: a batch tested in the driver (small batches) and the
same batch tested in a Ray task (large ones), on a real local Ray instance and a real store read back."""

from __future__ import annotations

import numpy as np

from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.sections import SignificanceSection
from headsweep.sweep.statistics import significance_runner
from headsweep.sweep.statistics.significance_runner import SignificanceTracker
from headsweep.workers.core.work import WorkUnit


def tracked_rows(tmp_path, inline_work: int, monkeypatch) -> list[dict]:
    """Significance rows of 40 single-head evaluations and 5 pairs (two families, the first in two batches of at
    most 32) of a 300-sentence accuracy run, tested with ``INLINE_WORK`` = ``inline_work``."""
    monkeypatch.setattr(significance_runner, "INLINE_WORK", inline_work)
    rng = np.random.default_rng(3)
    baseline = rng.integers(0, 2, (300, 1)).astype(np.float64)
    store = ResultStore(str(tmp_path / "store"))
    section = SignificanceSection(tests=["paired_bootstrap", "paired_ttest", "mcnemar_exact"], n_resamples=500, seed=9,
                                  alpha=0.05)
    tracker = SignificanceTracker(section, store, "run-1", "accuracy", baseline)
    units = [WorkUnit(f"e{i}", "single_head", ()) for i in range(40)] + [WorkUnit(f"p{i}", "pairs", ())
                                                                         for i in range(5)]
    tracker.expect(units)
    for i, unit in enumerate(units):
        lost = rng.random((300, 1)) < 0.02 * (i % 7)  # correct answers lost: by some heads none, by some many
        tracker.add(unit, np.where(lost, 0.0, baseline))
    tracker.finish()
    table = store.read("significance", "run-1").to_pylist()
    return sorted(table, key=lambda r: (r["eval_id"], r["test"]))


def test_driver_and_ray_task_routes_write_the_same_rows(tmp_path, ray_address, monkeypatch) -> None:
    in_driver = tracked_rows(tmp_path / "driver", 10**12, monkeypatch)
    in_tasks = tracked_rows(tmp_path / "tasks", 0, monkeypatch)
    assert len(in_driver) == 45 * 3
    assert {r["test"] for r in in_driver} == {"paired_bootstrap", "paired_ttest", "mcnemar_exact"}
    assert any(r["significant"] for r in in_driver) and not all(r["significant"] for r in in_driver)
    assert comparable(in_driver) == comparable(in_tasks)


def comparable(rows: list[dict]) -> list[dict]:
    """The rows with NaN (a CI McNemar's test has not) as a string, since NaN equals nothing."""
    return [{k: "nan" if isinstance(v, float) and np.isnan(v) else v for k, v in r.items()} for r in rows]

