"""Worker-side code of the ``importance`` kind (run in an ``EvalWorker`` through ``ctx.pool.call``; imports only
``headsweep.workers``). The estimates themselves are ``headsweep.workers.analyses.importance`` (gradient) and
``headsweep.workers.analyses.lrp`` (LRP relevance)."""

from __future__ import annotations

from typing import Any


def load_data_on_worker(worker: Any, data_cfg: Any) -> None:
    """Worker-side (``EvalWorker.run``): the worker's model on ``data_cfg``, loaded and kept, so that every check
    the family makes of data against its model runs."""
    worker.adapter(data_cfg)
