"""A chunk writer interrupted anywhere (Ctrl-C or SIGTERM raise ``KeyboardInterrupt`` between any two lines of the
driver) and then flushed, as ``Sweep._stopped`` does, stores every evaluation with exactly its example rows, once.

The interrupt is injected at every line the writer and the store run in turn, by a trace function that raises it
(a trace function that raises is removed, as one signal is handled once)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from headsweep.results.store import ResultStore
from headsweep.sweep.run import chunks
from headsweep.sweep.run.chunks import ChunkWriter
from headsweep.workers.core.family import DatasetInfo, MaskOutput
from headsweep.workers.core.heads import Head, HeadInventory
from headsweep.workers.core.work import WorkUnit

N_EXAMPLES = 5
TRACED = {chunks.__file__, sys.modules[ResultStore.__module__].__file__}


def units(n: int) -> list[WorkUnit]:
    return [WorkUnit(f"single_head/self:0:{h}", "single_head", (Head("self", 0, h),), "self", 0, h) for h in range(n)]


def output(h: int) -> MaskOutput:
    stats = np.arange(N_EXAMPLES * 2, dtype=float).reshape(N_EXAMPLES, 2) + h
    return MaskOutput(stats, None, [f"out{h}-{i}" for i in range(N_EXAMPLES)], float(h), 0.1)


def interrupt_at(n: int):
    """A trace function raising KeyboardInterrupt at the ``n``-th line run in the writer or the store."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in TRACED else None

    return tracer


def sweep_then_stop(store: ResultStore, n: int) -> tuple[ChunkWriter, bool]:
    """Three evaluations through a writer flushing every two, interrupted at line ``n``; then the driver's own
    flush. Returns the writer and whether the interrupt came."""
    inventory = HeadInventory.from_json([{"attention": "self", "layer": 0, "num_heads": 3}])
    info = DatasetInfo("m", "d", "accuracy", ["a", "b"], [f"x{i}" for i in range(N_EXAMPLES)],
                       [""] * N_EXAMPLES, inventory)
    writer = ChunkWriter(store, "r1", info, flush_every=2, flush_seconds=1e9)
    interrupted = False
    sys.settrace(interrupt_at(n))
    try:
        for h, unit in enumerate(units(3)):
            writer.add(unit, output(h), 0.0, "w")
            writer.maybe_flush()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
    writer.flush()  # Sweep._stopped
    return writer, interrupted


def test_an_interrupt_anywhere_stores_whole_evaluations_once(tmp_path: Path):
    n, cases = 0, 0
    while True:
        n += 1
        store = ResultStore(str(tmp_path / f"s{n}"))
        writer, interrupted = sweep_then_stop(store, n)
        evals = store.read("evaluations").column("eval_id").to_pylist() if (tmp_path / f"s{n}").exists() else []
        assert len(evals) == len(set(evals)), (n, evals)  # nothing stored twice
        assert writer.written == len(evals), n  # n_done counts what is stored
        store.remove_orphans("r1")  # an examples file whose evaluations file never landed (what a resume removes)
        if evals:
            examples = store.read("examples").to_pylist()
            assert sorted((e["eval_id"], e["example_id"]) for e in examples) == sorted(
                (i, f"x{k}") for i in evals for k in range(N_EXAMPLES)), n  # exactly its examples, no others
            for e in examples:
                h = int(e["eval_id"][-1])
                assert e["stats"] == list(output(h).stats[int(e["example_id"][1:])]), n
        if not interrupted:
            break
        cases += 1
    # every line of the sequence was a case; the files of a table are read in no set order
    assert sorted(evals) == sorted(u.eval_id for u in units(3)) and cases > 50
