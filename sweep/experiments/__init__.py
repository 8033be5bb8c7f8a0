"""Experiment kinds: one module each, registered by name; the order a run runs them in.

The contract is :class:`~headsweep.sweep.experiments.base.Experiment`; what a kind sees of the
run is a :class:`~headsweep.sweep.run.context.Context`. The built-in kinds are
registered below in the order they run when nothing else decides it; ``register(kind)`` adds
another, and ``sweep.experiments`` may also name a kind defined outside headsweep as
``package.module:ATTRIBUTE`` (an ``Experiment`` instance, importable on the driver; on the workers
too when its worker-side functions live there).

A run's kinds are those ``sweep.experiments`` lists, those other keys imply, the kinds they need
(transitively) and ``baseline``, always first. They run in phases (:func:`schedule`): every kind
that plans mask evaluations and whose needs are done is streamed through the workers in one pass;
a kind with a ``run`` step runs alone, in dependency order (ties in registration order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.plugins import load_plugin
from headsweep.results.schema import TABLES
from headsweep.sweep.configuration.sections import Config
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
from headsweep.sweep.experiments.roles import ROLES
from headsweep.sweep.experiments.single_head import SINGLE_HEAD
from headsweep.sweep.run.plan import attention_types

if TYPE_CHECKING:  # the context brings Ray and the worker pool; reading a config needs neither
    from headsweep.sweep.run.context import Context

__all__ = ["KINDS", "Experiment", "Phase", "experiment_kind", "experiments_of", "register", "schedule", "validate"]

# Every registered kind by name, in registration order (which breaks ties in the run order).
KINDS: dict[str, Experiment] = {}
# The kind every run evaluates first: the reference of every delta and significance test.
REFERENCE = BASELINE.name


def register(kind: Experiment, replace: bool = False) -> Experiment:
    """Add ``kind`` to the registry under ``kind.name`` (refused if the name is taken, unless ``replace``)."""
    if not isinstance(kind, Experiment) or not kind.name:
        raise HeadsweepError(f"{kind!r} is not a named headsweep.sweep.experiments.Experiment")
    if kind.name in KINDS and KINDS[kind.name] is not kind and not replace:
        raise HeadsweepError(f"experiment kind {kind.name!r} is registered already")
    overrides = (type(kind).plan is not Experiment.plan, type(kind).run is not Experiment.run)
    if sum(overrides) != 1:
        raise HeadsweepError(f"experiment kind {kind.name!r} must implement exactly one of plan() and run()")
    if kind.section is not None and kind.section not in Config.__dataclass_fields__:
        raise HeadsweepError(f"experiment kind {kind.name!r} reads config section {kind.section!r}, which is not one")
    if kind.table not in TABLES:
        raise HeadsweepError(f"experiment kind {kind.name!r} writes table {kind.table!r}, which is not a results table")
    KINDS[kind.name] = kind
    return kind


for _kind in (BASELINE, SINGLE_HEAD, ALL_BUT_ONE, CUSTOM, IMPORTANCE, PRUNE_LEVEL, EFFICIENCY, KV_GROUP, ROLES, PAIRS,
              L0):
    register(_kind)


def experiment_kind(name: str) -> Experiment:
    """The kind called ``name`` (``package.module:ATTRIBUTE`` imports and registers one), or a clear error."""
    if ":" in name:
        return _plugin(name)
    if name not in KINDS:
        raise HeadsweepError(
            f"unknown experiment kind {name!r} in sweep.experiments (known: {', '.join(KINDS)}, "
            "or module:ATTRIBUTE of an Experiment)"
        )
    return KINDS[name]


def _plugin(name: str) -> Experiment:
    kind = load_plugin(name, Experiment, "experiment kind")
    return register(kind)


def _dependencies(kind: Experiment, cfg: Config) -> list[Experiment]:
    needed = [experiment_kind(n) for n in kind.needs(cfg)]
    if cfg.sweep.order == "importance" and kind.plans_masks and kind.name not in (REFERENCE, IMPORTANCE.name):
        # Masks go out most important heads first, so the scores come before every grid.
        needed.append(IMPORTANCE)
    return needed if kind.name == REFERENCE else [KINDS[REFERENCE], *needed]


def experiments_of(cfg: Config) -> list[Experiment]:
    """The kinds a run of ``cfg`` runs, in the order they run; checks the names of ``sweep.experiments``.

    A kind implied by other keys (``custom`` by ``sweep.masks``) is appended to ``sweep.experiments``.
    """
    listed = [experiment_kind(name) for name in cfg.sweep.experiments]
    for kind in list(KINDS.values()):
        if kind not in listed and kind.implied(cfg):
            cfg.sweep.experiments.append(kind.name)
            listed.append(kind)
    members: dict[str, Experiment] = {}
    todo = [KINDS[REFERENCE], *listed]
    while todo:
        kind = todo.pop()
        if kind.name not in members:
            members[kind.name] = kind
            todo += _dependencies(kind, cfg)
    order: list[Experiment] = []
    pending = [k for k in KINDS.values() if k.name in members]
    while pending:
        ready = next((k for k in pending if all(d in order for d in _dependencies(k, cfg))), None)
        if ready is None:
            raise HeadsweepError(f"experiment kinds need each other in a circle: {', '.join(k.name for k in pending)}")
        order.append(ready)
        pending.remove(ready)
    return order


@dataclass(frozen=True)
class Phase:
    """Kinds that run together: mask-planning kinds streamed in one pass, or one kind's ``run`` step."""

    kinds: tuple[Experiment, ...]

    @property
    def streams(self) -> bool:
        return self.kinds[0].plans_masks


def schedule(cfg: Config) -> list[Phase]:
    """The phases of a run of ``cfg``: each kind after the kinds it needs, planning kinds grouped.

    A phase of planning kinds holds every one whose needs are done by then, in the order
    ``sweep.experiments`` lists them (their units stream in that order).
    """
    pending = experiments_of(cfg)
    position: dict[str, int] = {}
    for i, name in enumerate(cfg.sweep.experiments):
        position.setdefault(experiment_kind(name).name, i)
    phases: list[Phase] = []
    finished: list[Experiment] = []
    while pending:
        head = pending[0]
        group = [head]
        if head.plans_masks:
            group = [k for k in pending if k.plans_masks and all(d in finished for d in _dependencies(k, cfg))]
            group.sort(key=lambda k: position.get(k.name, len(position)))
        phases.append(Phase(tuple(group)))
        finished += group
        pending = [k for k in pending if k not in group]
    return phases


def validate(ctx: Context) -> None:
    """Checks against the loaded model that must fail before anything is written: ``sweep.attention``
    (whichever kinds read it), then each kind's own."""
    attention_types(ctx.cfg, ctx.inventory)
    for kind in experiments_of(ctx.cfg):
        kind.validate(ctx)
