"""The contract of an experiment kind.

A kind is an :class:`Experiment` registered under its ``name`` (``headsweep.sweep.experiments.register``);
``sweep.experiments`` names the kinds a run runs. It implements exactly one of

* ``plan(ctx)``: the masks to evaluate, as work units. The driver streams them through the
  worker pool, writes each result to ``evaluations``/``examples`` and tests it against the
  baseline (one significance family per experiment). Kinds whose needs are met at the same
  time are streamed together in one pass, so the workers stay busy.
* ``run(ctx)``: a step that is not a list of mask evaluations (gradient importance, timing
  pruned models). Its **worker step** goes through ``ctx.pool.call(fn, *args)``, which runs
  ``fn(worker, *args)`` in one actor (``EvalWorker.run``); results go to the kind's ``table``
  with ``ctx.write``.

A kind declares its parts; registering it adds them to the run's config, the results store and the report:

* ``section`` and ``settings``: the top-level config section it reads, and the dataclass that section is read
  as when the kind declares it (one definition: the config reader builds it, the kind's checks and its worker
  step take it as it is; ``check_settings(cfg)``, by default its ``check()``, runs whenever a config is read).
  A kind may read a section another kind (or the core: ``sweep``) declares, naming it without ``settings``.
  Fields marked ``metadata={"data": True}`` hold data sections (``data_sections(cfg)``), fields marked
  ``metadata={"file": True}`` name files: the config reader resolves their paths relative to the config file.
* ``tables``, ``views``, ``pruning_curve``: the results tables it writes beyond ``evaluations`` (``table`` names
  the one ``ctx.write`` fills), the query views over them, and whether its evaluations are points of a pruning
  curve (the ``pruning`` view). ``headsweep.results`` keeps them in its registries; it never imports a kind.
* ``report(part)``: its part of the HTML report for each model of a run (``headsweep.sweep.reporting``).

A kind with more than one module is a folder (``roles/``, ``importance/``, ``pairs/``, ``l0/``): the kind
(``kind.py``), its settings, its tables and views, its report part, and worker-side code that imports only
``headsweep.workers`` and ``headsweep.results``. docs/development.md, "Adding an experiment kind", shows one.

A kind declares, too, what the run loop and the readers ask of it (code outside ``sweep/experiments/`` reads these
declarations, never a kind's name): ``reference`` (the unmasked model every delta and test is against: ``baseline``),
``screened`` (``sweep.screen`` screens its masks on a subset first: ``single_head``), ``whole_set`` (it needs every
mask evaluated on the whole set, so ``sweep.screen`` cannot join it: ``pairs``), ``orders_masks`` (its scores,
left under its name in ``ctx.shared``, order every grid's masks under ``sweep.order: <name>``: ``importance``),
``pruned_copy`` (a worker holds one more copy of the weights: ``efficiency``) and ``reads_attention`` (its data is
read for attention maps alone, which no ablation fill changes, so a fill that needs paired inputs does not ask it
to be paired: ``roles``). A pruning curve whose points are
pruning levels says so (``PruningCurve.levels``: ``prune_level``'s, the masks ``efficiency.level`` and
``headsweep export --level`` name).

Everything else has a default: ``needs(cfg)`` (kinds whose results it reads: they run first and
join the run when it does not list them), ``implied(cfg)`` (other config keys ask for it),
``check_config(cfg)`` (config checks at load time, for a run of this kind), ``validate(ctx)`` (checks against the
loaded model, before anything is written), ``gated_attention(cfg)`` (the heads it gates beyond ``sweep.attention``'s,
which ablation methods that fill only some attention types check: none by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from headsweep.results.schema import Table
from headsweep.results.views import PruningCurve, View
from headsweep.sweep.configuration.data_sections import DATA, marked_fields, typed_data
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context


@dataclass(frozen=True)
class GatedHeads:
    """Heads a kind gates (or scores against the run's fill) as the config key ``key`` says: the heads of the
    ``attention`` types (None: every type the model has), or the heads ``named`` one by one; or, with ``every_head``
    (``(what it does, what to change)``), every head of the model whatever its settings."""

    key: str
    attention: tuple[str, ...] | None = None
    named: tuple[str, ...] | None = None
    every_head: tuple[str, str] | None = None


class Experiment:
    """One experiment kind. Subclass it, set the class attributes, implement ``plan`` or ``run``.

    ``name`` is what ``sweep.experiments`` lists and what its work units carry as ``experiment``;
    ``section`` is the top-level config section it reads (a :class:`Config` attribute), or None, and
    ``settings`` the dataclass of that section when this kind declares it; ``table`` is the results table
    ``ctx.write`` fills, ``tables`` and ``views`` those it declares, ``pruning_curve`` the pruning curve its
    evaluations are points of.
    """

    name: str = ""
    section: str | None = None
    settings: type | None = None
    table: str = "evaluations"
    tables: ClassVar[tuple[Table, ...]] = ()
    views: ClassVar[tuple[View, ...]] = ()
    pruning_curve: PruningCurve | None = None
    # What the run loop and the readers ask of a kind (the module docstring); at most one registered kind is the
    # reference.
    reference: ClassVar[bool] = False
    screened: ClassVar[bool] = False
    whole_set: ClassVar[bool] = False
    orders_masks: ClassVar[bool] = False
    pruned_copy: ClassVar[bool] = False
    reads_attention: ClassVar[bool] = False

    def needs(self, cfg: Config) -> tuple[str, ...]:
        """Kinds whose results this one reads (they run before it; one the run does not list joins it)."""
        return ()

    def check_settings(self, cfg: Config) -> None:
        """Refuse settings of the section this kind declares that cannot work, whether or not the run has this kind
        (every config read): by default the settings' own ``check()``."""
        if self.settings is not None and self.section is not None:
            check = getattr(getattr(cfg, self.section), "check", None)
            if check is not None:
                check()

    def data_sections(self, cfg: Config) -> list[tuple[str, Any]]:
        """The data sections a run of this kind reads besides ``data``, typed, with their config keys: by default
        each field of its settings marked ``metadata={"data": True}`` that is set. They are checked on the driver
        before Ray starts (``check_data_files``)."""
        if self.settings is None or self.section is None:
            return []
        settings = getattr(cfg, self.section)
        return [(f"{self.section}.{name}", typed_data(cfg, getattr(settings, name), f"{self.section}.{name}"))
                for name in marked_fields(self.settings, DATA) if getattr(settings, name) is not None]

    def implied(self, cfg: Config) -> bool:
        """True when other config keys ask for this kind although ``sweep.experiments`` does not name it."""
        return False

    def check_config(self, cfg: Config) -> None:
        """Refuse a config this kind cannot run (at load time, for every kind of the run)."""

    def validate(self, ctx: Context) -> None:
        """Refuse what does not fit the loaded model (``ctx.cfg``, ``ctx.info``), before anything is written."""

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        """The heads this kind gates beyond ``sweep.attention``'s (which every run's gating kinds read), by the
        config keys that choose them: methods that fill only some attention types refuse a run whose kinds reach
        others, naming the key (``headsweep.sweep.configuration.ablation_checks``). None by default."""
        return []

    def plan(self, ctx: Context) -> list[WorkUnit]:
        """The evaluations of this kind on ``ctx``'s model; eval ids without the checkpoint prefix."""
        raise NotImplementedError

    def run(self, ctx: Context) -> None:
        """A step that is not a list of mask evaluations (e.g. importance, timing); writes its own table."""
        raise NotImplementedError

    def report(self, part: ReportPart) -> None:
        """This kind's part of the report for one model of one run (``part``: the page, the run, its checkpoint
        and the query views); nothing by default. Parts come in registration order (of the built-in kinds:
        single_head, all_but_one, importance, roles, pairs), before the run's pruning curves."""

    @property
    def plans_masks(self) -> bool:
        """Whether this kind plans mask evaluations (``plan``) rather than running a step (``run``)."""
        return type(self).plan is not Experiment.plan

    def __repr__(self) -> str:
        return f"<experiment kind {self.name}>"
