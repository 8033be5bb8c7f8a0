"""The contract of an experiment kind.

A kind is an :class:`Experiment` registered under its ``name`` (``headsweep.sweep.experiments.register``);
``sweep.experiments`` names the kinds a run runs. It implements exactly one of

* ``plan(ctx)``: the masks to evaluate, as work units. The driver streams them through the
  worker pool, writes each result to ``evaluations``/``examples`` and tests it against the
  baseline (one significance family per experiment). Kinds whose needs are met at the same
  time are streamed together in one pass, so the workers stay busy.
* ``run(ctx)``: a step that is not a list of mask evaluations (gradient importance, timing
  pruned models). Worker-side work goes through ``ctx.pool.call(fn, *args)``, which runs
  ``fn(worker, *args)`` in one actor (``EvalWorker.run``); results go to the kind's ``table``
  with ``ctx.write``.

Everything else has a default: ``needs(cfg)`` (kinds whose results it reads: they run first and
join the run when it does not list them), ``implied(cfg)`` (other config keys ask for it),
``check_config(cfg)`` (config checks at load time), ``validate(ctx)`` (checks against the loaded
model, before anything is written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.configuration.sections import Config
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


class Experiment:
    """One experiment kind. Subclass it, set the class attributes, implement ``plan`` or ``run``.

    ``name`` is what ``sweep.experiments`` lists and what its work units carry as ``experiment``;
    ``section`` is the top-level config section it reads (a :class:`Config` attribute), or None;
    ``table`` is the results table it writes.
    """

    name: str = ""
    section: str | None = None
    table: str = "evaluations"

    def needs(self, cfg: Config) -> tuple[str, ...]:
        """Kinds whose results this one reads (they run before it; one the run does not list joins it)."""
        return ()

    def implied(self, cfg: Config) -> bool:
        """True when other config keys ask for this kind although ``sweep.experiments`` does not name it."""
        return False

    def check_config(self, cfg: Config) -> None:
        """Refuse a config this kind cannot run (at load time, for every kind of the run)."""

    def validate(self, ctx: Context) -> None:
        """Refuse what does not fit the loaded model (``ctx.cfg``, ``ctx.info``), before anything is written."""

    def plan(self, ctx: Context) -> list[WorkUnit]:
        """The evaluations of this kind on ``ctx``'s model; eval ids without the checkpoint prefix."""
        raise NotImplementedError

    def run(self, ctx: Context) -> None:
        """A step that is not a list of mask evaluations (e.g. importance, timing); writes its own table."""
        raise NotImplementedError

    @property
    def plans_masks(self) -> bool:
        """Whether this kind plans mask evaluations (``plan``) rather than running a step (``run``)."""
        return type(self).plan is not Experiment.plan

    def __repr__(self) -> str:
        return f"<experiment kind {self.name}>"
