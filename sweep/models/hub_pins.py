"""Pinning the hub ids a run loads: each becomes the ``id@<commit>`` it resolves to in the local cache now, so
the config hash (the run's identity) follows the commit and every worker loads that very commit. Only families
whose models may be named by hub id (``ModelFamily.hub_ids``: the transformers families; fairseq checkpoints are
single files, not hub snapshots) are pinned. Resolving is :mod:`headsweep.workers.hub.cache`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from headsweep.workers.families.registry import model_family
from headsweep.workers.hub.cache import is_hub_id, resolve_snapshot


def pin_hub_models(cfg: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``cfg`` with each hub id it loads (``model.path``, ``model.tokenizer``, ``checkpoints`` entries) written
    as the ``id@<commit>`` it resolves to in the local cache now, and ``{key: Snapshot.facts()}`` of those.

    The driver calls this before anything starts, so a model that is not cached stops the run with one line,
    the config hash names the commit, and the workers load the commit the driver saw.
    """
    if not model_family(cfg.model.kind).hub_ids:
        return cfg, {}
    facts: dict[str, dict[str, Any]] = {}

    def pin(key: str, value: Any, require: str | None) -> Any:
        if not isinstance(value, str) or not is_hub_id(value):
            return value
        snapshot = resolve_snapshot(value, require)
        facts[key] = snapshot.facts()
        return snapshot.pinned

    model = {key: pin(f"model.{key}", getattr(cfg.model, key), require)
             for key, require in (("path", "config.json"), ("tokenizer", None)) if hasattr(cfg.model, key)}
    checkpoints = cfg.checkpoints and [pin(f"checkpoints[{i}]", c, "config.json")
                                       for i, c in enumerate(cfg.checkpoints)]
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model), checkpoints=checkpoints), facts
