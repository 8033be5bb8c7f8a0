"""The registry of experiment kinds: registering a kind adds its parts; the order a run runs its kinds in.

``register(kind)`` checks the kind against the contract (``headsweep.sweep.experiments.base``) and adds what it
declares: its config section (``settings``: a field of the config, see ``configuration.sections.config_class``),
its results tables, views and pruning curve (``headsweep.results``' registries), and its report part (the report
asks every registered kind). ``sweep.experiments`` may also name a kind defined outside headsweep and installed as
an entry point in group ``headsweep.kinds`` (an ``Experiment`` instance, importable on the driver; on the workers
too when its worker-side functions live there): it is imported and registered on first use (``headsweep.plugins``).

A run's kinds are those ``sweep.experiments`` lists, those other keys imply, the kinds they need
(transitively) and ``baseline``, always first. They run in phases (:func:`schedule`): every kind
that plans mask evaluations and whose needs are done is streamed through the workers in one pass;
a kind with a ``run`` step runs alone, in dependency order (ties in registration order).

This module imports no kind: the built-in ones are registered by ``headsweep.sweep.experiments``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.plugins import KINDS_GROUP, installed
from headsweep.registry import Registry
from headsweep.results.schema import RENAMED, TABLES, register_table
from headsweep.results.views import PRUNING_CURVES, VIEWS, register_pruning_curve, register_view
from headsweep.sweep.configuration.sections import SECTIONS, Config, add_section, config_class
from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.plan import attention_types

if TYPE_CHECKING:  # the context brings Ray and the worker pool, the store pyarrow's datasets and pandas: reading a
    # config needs none of them
    from headsweep.results.store import ResultStore
    from headsweep.sweep.run.context import Context

def _check_kind(kind: Experiment) -> None:
    """Refuse a kind that breaks the contract (``headsweep.sweep.experiments.base``) or whose parts clash with those
    registered; everything is checked before anything is added, so a refused kind leaves the registries as they
    were."""
    if not isinstance(kind, Experiment) or not kind.name:
        raise HeadsweepError(f"{kind!r} is not a named headsweep.sweep.experiments.Experiment")
    overrides = (type(kind).plan is not Experiment.plan, type(kind).run is not Experiment.run)
    if sum(overrides) != 1:
        raise HeadsweepError(f"experiment kind {kind.name!r} must implement exactly one of plan() and run()")
    if kind.settings is not None and kind.section is None:
        raise HeadsweepError(f"experiment kind {kind.name!r} declares settings but no config section to read them")
    known_sections = {*config_class().__dataclass_fields__, *([kind.section] if kind.settings else [])}
    if kind.section is not None and kind.section not in known_sections:
        raise HeadsweepError(f"experiment kind {kind.name!r} reads config section {kind.section!r}, which is not one "
                             "(a kind that declares a section names its dataclass as settings)")
    declared = {t.name for t in kind.tables}
    if kind.table not in TABLES and kind.table not in declared:
        raise HeadsweepError(f"experiment kind {kind.name!r} writes table {kind.table!r}, which is not a results table "
                             "(a kind that writes a table of its own declares it in tables)")
    _check_parts(kind)
    if kind.reference and any(k.reference and k.name != kind.name for k in KINDS.values()):
        raise HeadsweepError(f"experiment kind {kind.name!r} declares itself the reference, and "
                             f"{reference_kind().name!r} is already")


def _add_parts(kind: Experiment) -> None:
    """What registering ``kind`` adds besides the kind: its config section, results tables, views, pruning curve."""
    if kind.settings is not None and kind.section is not None:
        add_section(kind.section, kind.settings)
    for table in kind.tables:
        register_table(table)
    for view in kind.views:
        register_view(view)
    if kind.pruning_curve is not None:
        register_pruning_curve(kind.pruning_curve)


def _unknown(name: str, known: list[str]) -> str:
    return (f"unknown experiment kind {name!r} in sweep.experiments (known: {', '.join(known)}, or the name of an "
            f"installed {KINDS_GROUP!r} entry point)")


# Every registered kind by name, in registration order (which breaks ties in the run order).
KINDS: Registry[Experiment] = Registry("experiment kind", "experiment kind", KINDS_GROUP, Experiment,
                                       check=_check_kind, added=_add_parts, unknown=_unknown)


def register(kind: Experiment, replace: bool = False) -> Experiment:
    """Add ``kind`` and its parts under ``kind.name`` (refused if the name is taken, unless ``replace``, and while a
    run is going)."""
    return KINDS.register(kind, replace)


def _check_parts(kind: Experiment) -> None:
    """Refuse parts that clash with those registered: a section, table, view or pruning curve another part of
    headsweep declares otherwise."""
    if kind.settings is not None and kind.section in SECTIONS and SECTIONS[kind.section] is not kind.settings:
        raise HeadsweepError(f"experiment kind {kind.name!r} declares config section {kind.section!r}, which another "
                             "kind declares already")
    for table in kind.tables:
        known = TABLES.get(table.name)
        if known is not None and (not known.equals(table.schema) or RENAMED.get(table.name, {}) != dict(table.renamed)):
            raise HeadsweepError(f"experiment kind {kind.name!r} declares results table {table.name!r}, which is "
                                 "another table already")
    for view in kind.views:
        if VIEWS.get(view.name, view.sql) != view.sql:
            raise HeadsweepError(f"experiment kind {kind.name!r} declares view {view.name!r}, which is another view "
                                 "already")
    curve = kind.pruning_curve
    if curve is not None and PRUNING_CURVES.get(curve.experiment, curve) != curve:
        raise HeadsweepError(f"experiment kind {kind.name!r} declares the pruning curve of {curve.experiment!r}, "
                             "which is declared already")


def experiment_kind(name: str) -> Experiment:
    """The kind called ``name``: a registered one, or one installed as a ``headsweep.kinds`` entry point (imported and
    registered now); or a clear error."""
    return KINDS.lookup(name)


def reference_kind() -> Experiment:
    """The kind every run evaluates first: the reference of every delta and significance test."""
    return next(k for k in KINDS.values() if k.reference)


def ordering_kind(cfg: Config) -> Experiment | None:
    """The kind whose scores order every grid's masks under ``cfg``'s ``sweep.order`` (None: planned order)."""
    kind = KINDS.get(cfg.sweep.order)
    return kind if kind is not None and kind.orders_masks else None


def declaring(declaration: str) -> tuple[str, ...]:
    """The names of the registered kinds whose ``declaration`` (an :class:`Experiment` flag) is true."""
    return tuple(k.name for k in KINDS.values() if getattr(k, declaration))


def is_plugin_name(name: object) -> bool:
    """Whether ``name`` is a kind the registry does not hold yet: an entry point's name, or a module path (which
    :func:`experiment_kind` refuses)."""
    return isinstance(name, str) and name not in KINDS and (":" in name or name in installed(KINDS_GROUP))


def plugin_kinds(names: Iterable[str]) -> list[str]:
    """Register the kinds among ``names`` installed as entry points (as a stored run's ``sweep.experiments`` names
    them); returns a line for each that cannot be, saying why."""
    problems = []
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and n not in KINDS):
        if ":" not in name and name not in installed(KINDS_GROUP):
            problems.append(f"experiment kind {name!r} is not installed here (no {KINDS_GROUP!r} entry point of that "
                            "name)")
            continue
        try:
            experiment_kind(name)
        except HeadsweepError as exc:
            problems.append(str(exc))
    return problems


def register_stored_kinds(store: ResultStore) -> None:
    """Register the kinds defined outside headsweep that the store's runs ran (their ``sweep.experiments``), so
    that their tables and views are queried and their report parts drawn; one that cannot be imported here (not
    on this ``PYTHONPATH``) is left out with a ``headsweep: warning:`` line."""
    try:
        runs = store.read("runs", columns=["config"]).to_pylist()
    except HeadsweepError:
        return  # an unreadable store: the reader that follows says why
    names = []
    for row in runs:
        try:
            names += json.loads(row["config"] or "{}").get("sweep", {}).get("experiments") or []
        except (ValueError, AttributeError):
            continue
    for problem in plugin_kinds(names):
        logging.getLogger("headsweep").warning("%s; its tables and report part are left out", problem)


def _dependencies(kind: Experiment, cfg: Config) -> list[Experiment]:
    needed = [experiment_kind(n) for n in kind.needs(cfg)]
    ordering = ordering_kind(cfg)
    if ordering is not None and kind.plans_masks and not kind.reference and kind is not ordering:
        # Masks go out most important heads first, so the scores come before every grid.
        needed.append(ordering)
    return needed if kind.reference else [reference_kind(), *needed]


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
    todo = [reference_kind(), *listed]
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
