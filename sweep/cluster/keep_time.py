"""How long a run keeps its workers warm (``headsweep run --keep-workers``), checked before anything starts."""

from __future__ import annotations

import math
import os

from headsweep.errors import HeadsweepError

# The default of --keep-workers (seconds), for a shell or a test session that keeps workers for every run.
ENV = "HEADSWEEP_KEEP_WORKERS"


def keep_seconds(given: float | str | None, address: str | None) -> float:
    """The keep time of a run: ``given`` (``--keep-workers``), else ``$HEADSWEEP_KEEP_WORKERS``, else 0 (workers
    end with the run). An embedded Ray instance ends with its run: ``--keep-workers`` without an address is
    refused; the variable is then ignored (it is a default for every run of a shell)."""
    value = given if given is not None else os.environ.get(ENV)
    if value is None or str(value).strip() == "":
        return 0.0
    where = "--keep-workers" if given is not None else f"${ENV}"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise HeadsweepError(f"{where} must be a number of seconds, got {value!r}") from None
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise HeadsweepError(f"{where} must be 0 or more seconds (0: workers end with the run), got {value!r}")
    if not address:
        if given is not None and seconds > 0:
            raise HeadsweepError("--keep-workers needs --address: an embedded Ray instance ends with its run, and "
                                 "its workers with it (start a cluster with `ray start --head` and pass its address)")
        return 0.0
    return seconds
