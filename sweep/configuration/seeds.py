"""Seeds: every seed a config sets (``seed``, ``significance.seed``, ``ablation.seed``, ``l0.seed``, and any a
section adds) is checked here, on the driver, before Ray or a model starts.

The range is what every consumer of a seed takes: numpy's generators (significance resamples, screening subsets,
resample ablation's donors) refuse negative seeds, and the stored ``seed`` columns are signed 64-bit integers. A seed
outside it failed on a worker, after the model loaded, in numpy's words and without the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.core.setting_ranges import SEED, SEED_MAX


def seed_keys(cfg: Any) -> list[tuple[str, int]]:
    """``(config key, value)`` of every seed of ``cfg``: its top-level ``seed`` and each section's fields named
    ``seed`` or ending in ``_seed``."""
    found = [("seed", cfg.seed)]
    for section in dataclasses.fields(cfg):
        settings = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(settings):
            continue
        found += [(f"{section.name}.{f.name}", getattr(settings, f.name)) for f in dataclasses.fields(settings)
                  if f.name == "seed" or f.name.endswith("_seed")]
    return found


def check_seeds(cfg: Any) -> None:
    """One line naming the first seed of ``cfg`` outside 0 .. 2**63 - 1, and the range."""
    for key, value in seed_keys(cfg):
        if value is not None and not 0 <= value <= SEED_MAX:
            raise HeadsweepError(SEED.refusal(key, value))
