"""A run's evaluated inputs, stored once per run (the ``inputs`` table, results schema version 10).

The ``examples`` table keeps per mask what each example scored and output; the texts themselves are the same for
every mask, so they are written once, when the run's first row is, from what the family's ``describe`` read
(``DatasetInfo.inputs``). A resumed run that has them writes nothing; a family that keeps none writes nothing.
"""

from __future__ import annotations

from headsweep.results.store import ResultStore
from headsweep.workers.core.family import DatasetInfo


def write_inputs(store: ResultStore, run_id: str, info: DatasetInfo) -> None:
    """Write ``info``'s inputs for ``run_id`` unless the run has them already (or the family gives none)."""
    if not info.inputs or store.read("inputs", run_id, columns=["example_id"]).num_rows:
        return
    rows = [{"example_id": e, "position": i, "input": text}
            for i, (e, text) in enumerate(zip(info.example_ids, info.inputs, strict=True))]
    store.write_rows("inputs", run_id, rows, "inputs")
