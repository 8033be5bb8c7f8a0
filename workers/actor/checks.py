"""Worker-side checks a run makes before it writes anything (called through ``EvalWorker.run``)."""

from __future__ import annotations

from typing import Any

from headsweep.workers.core.family import ModelFamily
from headsweep.workers.core.heads import HeadInventory
from headsweep.workers.families.registry import model_family


def model_heads_on_worker(worker: Any, model_cfg: Any) -> HeadInventory | None:
    """The heads of the model ``model_cfg`` names, loaded (without data) in a worker and let go again.

    None for a model family that cannot load a bare model (a plugin without ``load_model``): the
    model is then first opened when its turn comes.
    """
    from headsweep.workers.core.gates import site_inventory  # torch: on the worker only, not in the driver's import

    family = model_family(model_cfg.kind)
    if type(family).load_model is ModelFamily.load_model:  # a family that cannot: nothing to check here
        return None
    loaded = family.load_model(model_cfg)
    try:
        return site_inventory(family.find_sites(loaded.model))
    finally:
        del loaded

