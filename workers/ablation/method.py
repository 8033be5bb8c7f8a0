"""The contract of an ablation method: what a gated-off head leaves behind, and what the pipeline asks of it.

A method is an :class:`AblationMethod` registered under its ``name`` (:mod:`headsweep.workers.ablation.registry`);
``sweep.ablation`` names the run's. The gate is always ``z'_h = xi_h z_h + (1 - xi_h) c_h``
(:func:`headsweep.workers.core.head_fill.apply_gates`); a method says what ``c_h`` is through its declarations:

* ``settings``: its settings, a dataclass whose fields are keys of the ``ablation`` section (numbers with declared
  ranges, :func:`headsweep.workers.core.setting_ranges.ranged`; choices typed ``Literal``, checked by
  :func:`check_choices`); the section is built from the registered methods' settings
  (``headsweep.sweep.configuration.ablation``), the run's spec carries the chosen method's settings object
  (``AblationSpec.settings``, read with :meth:`AblationMethod.settings_in`), and a key another method reads set
  away from its default is refused naming that method. ``check_settings(settings)``: its own checks across them;
  ``per_position(settings)``: the setting that makes a constant fill one per position, if set;
* ``fill``: what the fill holds: ``none`` (no values: zero, or a fill that is a function of the head itself),
  ``constant`` (one vector per head, or per head and position: known before any batch runs), ``per_example``
  (another input's activations, set per batch by the adapters' :class:`~headsweep.workers.ablation.donors.Donors`);
* ``reference``: whether it reads ``ablation.reference`` (``none``; ``optional``: the evaluation data when unset;
  ``training``: required, and kept apart from the evaluation set; its settings then declare ``reference``, and
  ``allow_eval_data`` for ``training``: :data:`REFERENCE_SETTINGS`); ``needs_pairs`` (clean / corrupted inputs);
  ``needs_whole_set`` (donors drawn over the whole evaluation set, which screening subsets do not hold);
* on a worker: ``worker_fill(spec)`` (the fill every adapter gets when it loads), ``compute(worker, spec)``
  (values each worker computes once, on its first load, and again after Ray restarts it), ``draw_donors(...)``
  (per-example methods: whose inputs fill each example); ``trained``: constants trained by the driver through the
  worker pool and installed on every worker (again on one Ray restarts), :mod:`headsweep.sweep.ablation.training`;
* ``fold``: what ``headsweep export`` does with it: ``nothing`` (zero), ``constants`` (stored constants folded into
  the output projections' biases), ``refused`` (``fold_refusal`` says why);
* ``facts(spec, means)``: what ``runs.facts["ablation"]`` records;
* the lines that refuse it where it cannot run: ``unpaired_refusal()`` (a method that ``needs_pairs``, on data
  without pairs), ``family_refusal(family)`` (on a family with no paired data format), ``attention_refusal(...)``
  (a per-example fill on heads of an attention type the family cannot fill), on the driver and on the workers.

A method defined outside headsweep is an :class:`AblationMethod` instance installed as an entry point in group
``headsweep.ablations`` (``headsweep.plugins``), importable on the driver and on every worker.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from headsweep.errors import HeadsweepError

if TYPE_CHECKING:
    import numpy as np

    from headsweep.workers.ablation.means import MeanValues
    from headsweep.workers.ablation.spec import AblationSpec
    from headsweep.workers.core.head_fill import HeadFill

# The declarations' values, as types (static tools check every method's class attributes against them) and as the
# tuples ``check_method`` checks a plugin's against.
Fill = Literal["none", "constant", "per_example"]
Reference = Literal["none", "optional", "training"]
Fold = Literal["nothing", "constants", "refused"]
FILLS: tuple[Fill, ...] = get_args(Fill)
REFERENCES: tuple[Reference, ...] = get_args(Reference)
FOLDS: tuple[Fold, ...] = get_args(Fold)
# The key of the ``ablation`` section every method honours, held by the section itself (no method declares it).
COMMON_SETTINGS = ("keep_first",)
# What a method whose ``reference`` is not ``none`` declares among its settings: the reference data itself, and for
# one that trains on it, the switch that allows the evaluation set (``sweep.configuration.ablation_checks``).
REFERENCE_SETTINGS: dict[Reference, tuple[str, ...]] = {"none": (), "optional": ("reference",),
                                                        "training": ("reference", "allow_eval_data")}


def reference_setting() -> Any:
    """The field of a method's settings that holds ``ablation.reference``: a data section (the keys of ``data``,
    marked so the config types it and resolves its paths), None by default."""
    return dataclasses.field(default=None, metadata={"data": True})


def check_choices(settings: Any, where: str = "ablation") -> None:
    """Refuse, in one line, a field of dataclass ``settings`` typed ``Literal[...]`` whose value is not one of its
    choices (the config reader types scalars, not choices)."""
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        choices = get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
        value = getattr(settings, f.name)
        if choices and value not in choices:
            raise HeadsweepError(f"unknown {where}.{f.name} {value!r} (known: {', '.join(map(str, choices))})")


class AblationMethod:
    """One ablation method. Subclass it, set the class attributes, override the hooks its fill needs."""

    name: str = ""
    fill: Fill = "none"
    settings: ClassVar[type | None] = None
    reference: Reference = "none"
    needs_pairs: bool = False
    needs_whole_set: bool = False
    trained: bool = False
    fold: Fold = "refused"
    fold_refusal: str = "its fill is not one constant per head"

    # -- its settings ------------------------------------------------------------------------------------------
    def settings_from(self, values: Any) -> Any:
        """This method's settings object with the values of its fields in ``values`` (the config's ``ablation``
        section); None for a method without settings."""
        if self.settings is None:
            return None
        return self.settings(**{f.name: getattr(values, f.name) for f in dataclasses.fields(self.settings)})

    def settings_in(self, spec: AblationSpec) -> Any:
        """The settings object ``spec`` carries (its defaults where it carries none)."""
        if spec.settings is not None:
            if self.settings is None or not isinstance(spec.settings, self.settings):
                raise TypeError(f"ablation method {self.name!r} reads {self.settings!r}, the spec carries "
                                f"{type(spec.settings).__name__}")
            return spec.settings
        return None if self.settings is None else self.settings()

    def check_settings(self, settings: Any) -> None:
        """Refuse values of this method's ``settings`` object it cannot work with, beyond their declared ranges and
        choices; nothing by default."""

    def per_position(self, settings: Any) -> str | None:
        """The setting, as a config writes it (``ablation.positions: per_position``), that makes this method's
        constant fill one per absolute position under ``settings``; None: one per head (the default)."""
        return None

    def fill_kind(self, spec: AblationSpec) -> str:
        """The fill's kind under ``spec``: ``none``, ``constant``, ``per_position`` or ``per_example``."""
        if self.fill == "constant" and spec.per_position:
            return "per_position"
        return self.fill

    def draws(self, settings: Any) -> int:
        """How many fills each example's statistics are averaged over under ``settings`` (resample's
        ``ablation.resamples``); 1."""
        return 1

    def training_summary(self, spec: AblationSpec) -> str:
        """Trained methods: how the constants are trained, for the driver's log line (``Adam lr=0.01, at most 100
        steps each``); empty by default."""
        return ""

    # -- where it cannot run -------------------------------------------------------------------------------------
    def unpaired_refusal(self) -> str:
        """The one line that refuses a method that ``needs_pairs`` on data without clean / corrupted pairs."""
        return (f"sweep.ablation {self.name} needs paired data (clean and corrupted inputs): set data.task: paired, "
                "or use another sweep.ablation")

    def family_refusal(self, family: str, resample: bool = True) -> str:
        """The one line that refuses a method that ``needs_pairs`` for model family ``family``, which has no paired
        data format (``resample``: whether the family can fill some attention type from another input, so that the
        line may suggest resample ablation)."""
        return (f"sweep.ablation {self.name} is not available for {family} models: {family} has no paired data "
                "format (data.task: paired); use sweep.ablation mean")

    def attention_refusal(self, family: str, allowed: tuple[str, ...], what: str, fix: str) -> str:
        """The one line that refuses a per-example fill where a run would gate heads of an attention type family
        ``family`` cannot fill from another input (``allowed``: those it can): ``what`` says what would gate them,
        ``fix`` what to change. A family that can fill no attention type from another input (``allowed`` empty)
        gets the line that says so, whatever would gate."""
        if not allowed:
            return (f"sweep.ablation {self.name} is not available for {family} models: no attention type of theirs can "
                    "be filled from another input; use sweep.ablation mean")
        return (f"sweep.ablation {self.name} is available for {family} models on {', '.join(allowed)} heads only, and "
                f"{what}; {fix}, or use sweep.ablation mean")

    # -- on a worker -----------------------------------------------------------------------------------------
    def worker_fill(self, spec: AblationSpec) -> HeadFill | None:
        """The fill every adapter gets when it loads, before (or without) values; None (the default) leaves the gate
        alone (``heads * gates``)."""
        return None

    def compute(self, worker: Any, spec: AblationSpec) -> MeanValues | None:
        """Values a worker computes once, on its first load (again after Ray restarts it: they must be
        deterministic), installed on every adapter it holds; None: none."""
        return None

    def draw_donors(self, spec: AblationSpec, lengths: Sequence[int], paired: bool, what: str, where: str,
                    more: str) -> Callable[[], np.ndarray] | None:
        """Per-example methods: a function giving ``(draws, n)`` donor positions (``donors[k, i]``: whose inputs
        fill example ``i`` in draw ``k``) over examples of token ``lengths``; None for other methods."""
        return None

    def fills_from_pair(self, spec: AblationSpec) -> bool:
        """Whether an example's fill is its pair's other input (so the donor inputs are the other prompts)."""
        return False

    def evaluates_corrupted(self, spec: AblationSpec) -> bool:
        """Whether the run evaluates the corrupted input of each pair (so its baseline is the corrupted run)."""
        return False

    def data_facts(self, spec: AblationSpec) -> dict[str, Any]:
        """What an adapter on paired data records of this method in its data facts; nothing by default."""
        return {}

    def facts(self, spec: AblationSpec, means: MeanValues | None) -> dict[str, Any]:
        """``runs.facts["ablation"]``: the method and its settings (``means``: what :meth:`compute` gave)."""
        return {"method": self.name, "keep_first": spec.keep_first}

    def refuse_per_example(self, what: str, why: str) -> None:
        """Refuse the run on an adapter that cannot fill heads per example (``what``, ``why``): per-example
        methods refuse in one line; others pass."""
        if self.fill == "per_example":
            raise HeadsweepError(f"sweep.ablation {self.name} is not available for {what}: {why}; use "
                                 "sweep.ablation mean")

    def __repr__(self) -> str:
        return f"<ablation method {self.name}>"


def check_method(method: AblationMethod) -> None:
    """Refuse a method whose declarations are not ones the pipeline knows (one line)."""
    if not isinstance(method, AblationMethod) or not method.name:
        raise HeadsweepError(f"{method!r} is not a named headsweep.workers.ablation.method.AblationMethod")
    for attribute, known in (("fill", FILLS), ("reference", REFERENCES), ("fold", FOLDS)):
        if getattr(method, attribute) not in known:
            raise HeadsweepError(f"ablation method {method.name!r}: {attribute} {getattr(method, attribute)!r} is not "
                                 f"one of {', '.join(known)}")
    settings = method.settings
    if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise HeadsweepError(f"ablation method {method.name!r}: settings {settings!r} is not a dataclass (the fields "
                             "it reads from the ablation section, with their defaults)")
    try:  # the section reads each field's type, so it must resolve (a string annotation naming an unknown class)
        typing.get_type_hints(settings) if settings is not None else None
    except Exception as exc:  # any failure to resolve them is the plugin's: said in one line
        raise HeadsweepError(f"ablation method {method.name!r}: the types of its settings cannot be resolved "
                             f"({exc})") from None
    fields = dataclasses.fields(settings) if settings is not None else ()
    names = [f.name for f in fields]
    for f in fields:
        if f.name in COMMON_SETTINGS:
            raise HeadsweepError(f"ablation method {method.name!r} declares ablation.{f.name}, which every method "
                                 "honours and the section holds itself: leave it out of its settings")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise HeadsweepError(f"ablation method {method.name!r}: its setting ablation.{f.name} has no default (a "
                                 "config that names another method leaves it out)")
    missing = [s for s in REFERENCE_SETTINGS.get(method.reference, ()) if s not in names]
    if missing:
        raise HeadsweepError(f"ablation method {method.name!r} reads ablation.reference ({method.reference}) but its "
                             f"settings do not declare ablation.{missing[0]}")
    if method.fold == "constants" and method.fill != "constant":
        raise HeadsweepError(f"ablation method {method.name!r} folds constants but its fill is {method.fill}")
