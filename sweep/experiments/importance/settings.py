"""The ``importance`` config section (Michel et al. sec. 4.1): how head importance is estimated, and on which data."""

from __future__ import annotations

from dataclasses import dataclass, field

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import DATA

IMPORTANCE_METHODS = ("gradient", "ablation", "lrp")


@dataclass
class ImportanceSection:
    """Head importance (Michel et al. sec. 4.1): how it is estimated, and on which data.

    ``data`` has the same keys as the top-level ``data`` section of the model kind and must
    not be the evaluation set: importance estimated on the data it is judged on flatters it.
    """

    method: str = "gradient"
    data: dict | None = field(default=None, metadata={DATA: True})
    per_token: bool = True
    normalize: bool = True
    allow_eval_data: bool = False
    from_run: str | None = None

    def check(self) -> None:
        if self.method not in IMPORTANCE_METHODS:
            raise HeadsweepError(
                f"unknown importance.method {self.method!r} (known: {', '.join(IMPORTANCE_METHODS)})"
            )
