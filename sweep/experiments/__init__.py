"""Experiment kinds: one module or folder each, registered by name; the order a run runs them in.

The contract is :class:`~headsweep.sweep.experiments.base.Experiment`; what a kind sees of the
run is a :class:`~headsweep.sweep.run.context.Context`; the registry (``register``, the run order) is
``headsweep.sweep.experiments.registry``. Importing this package registers the built-in kinds, with their config
sections, results tables, views and report parts, in the order they run when nothing else decides it.
"""

from __future__ import annotations

from headsweep.sweep.experiments.all_but_one import ALL_BUT_ONE
from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.baseline import BASELINE
from headsweep.sweep.experiments.custom import CUSTOM
from headsweep.sweep.experiments.efficiency import EFFICIENCY
from headsweep.sweep.experiments.importance import IMPORTANCE
from headsweep.sweep.experiments.kv_group import KV_GROUP
from headsweep.sweep.experiments.l0 import L0
from headsweep.sweep.experiments.pairs import PAIRS
from headsweep.sweep.experiments.prune_level import PRUNE_LEVEL
from headsweep.sweep.experiments.registry import (
    KINDS,
    Phase,
    declaring,
    experiment_kind,
    experiments_of,
    is_plugin_name,
    ordering_kind,
    plugin_kinds,
    reference_kind,
    register,
    register_stored_kinds,
    schedule,
    validate,
)
from headsweep.sweep.experiments.roles import ROLES
from headsweep.sweep.experiments.single_head import SINGLE_HEAD

__all__ = ["BUILTIN_KINDS", "KINDS", "Experiment", "Phase", "declaring", "experiment_kind", "experiments_of",
           "is_plugin_name", "ordering_kind", "plugin_kinds", "reference_kind", "register", "register_stored_kinds",
           "schedule", "validate"]

for _kind in (BASELINE, SINGLE_HEAD, ALL_BUT_ONE, CUSTOM, IMPORTANCE, PRUNE_LEVEL, EFFICIENCY, KV_GROUP, ROLES, PAIRS,
              L0):
    register(_kind)
# The built-in kinds: their config sections are in every config; another kind's only in a config that names it.
BUILTIN_KINDS = tuple(KINDS)
