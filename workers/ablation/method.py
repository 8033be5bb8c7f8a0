"""The contract of an ablation method: what a gated-off head leaves behind, and what the pipeline asks of it.

A method is an :class:`AblationMethod` registered under its ``name`` (:mod:`headsweep.workers.ablation.registry`);
``sweep.ablation`` names the run's. The gate is always ``z'_h = xi_h z_h + (1 - xi_h) c_h``
(:func:`headsweep.workers.core.head_fill.apply_gates`); a method says what ``c_h`` is through its declarations:

* ``settings``: the keys of the ``ablation`` section it reads (any other key set away from its default is refused);
  ``check_settings(section)``: its own checks of their values;
* ``fill``: what the fill holds: ``none`` (no values: zero, or a fill that is a function of the head itself),
  ``constant`` (one vector per head, or per head and position: known before any batch runs), ``per_example``
  (another input's activations, set per batch by the adapters' :class:`~headsweep.workers.ablation.donors.Donors`);
* ``reference``: whether it reads ``ablation.reference`` (``none``; ``optional``: the evaluation data when unset;
  ``training``: required, and kept apart from the evaluation set); ``needs_pairs`` (clean / corrupted inputs);
  ``needs_whole_set`` (donors drawn over the whole evaluation set, which screening subsets do not hold);
* on a worker: ``worker_fill(spec)`` (the fill every adapter gets when it loads), ``compute(worker, spec)``
  (values each worker computes once, on its first load, and again after Ray restarts it), ``draw_donors(...)``
  (per-example methods: whose inputs fill each example); ``trained``: constants trained by the driver through the
  worker pool and installed on every worker (again on one Ray restarts), :mod:`headsweep.sweep.ablation.training`;
* ``fold``: what ``headsweep export`` does with it: ``nothing`` (zero), ``constants`` (stored constants folded into
  the output projections' biases), ``refused`` (``fold_refusal`` says why);
* ``facts(spec, means)``: what ``runs.facts["ablation"]`` records.

A method defined outside headsweep is an :class:`AblationMethod` instance installed as an entry point in group
``headsweep.ablations`` (``headsweep.plugins``), importable on the driver and on every worker.
"""

from __future__ import annotations

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
# The keys of the ``ablation`` section a method may read besides ``keep_first`` (which every method honours).
SETTINGS = ("reference", "positions", "seed", "resamples", "allow_eval_data", "direction", "steps", "lr")


class AblationMethod:
    """One ablation method. Subclass it, set the class attributes, override the hooks its fill needs."""

    name: str = ""
    fill: Fill = "none"
    settings: ClassVar[tuple[str, ...]] = ()
    reference: Reference = "none"
    needs_pairs: bool = False
    needs_whole_set: bool = False
    trained: bool = False
    fold: Fold = "refused"
    fold_refusal: str = "its fill is not one constant per head"

    def check_settings(self, section: Any) -> None:
        """Refuse values of the ``ablation`` section (``section``) this method cannot work with; nothing by
        default (the section checks its own values and the keys this method does not read)."""

    def fill_kind(self, spec: AblationSpec) -> str:
        """The fill's kind under ``spec``: ``none``, ``constant``, ``per_position`` or ``per_example``."""
        if self.fill == "constant" and spec.per_position:
            return "per_position"
        return self.fill

    def draws(self, section: Any) -> int:
        """How many fills each example's statistics are averaged over (resample's ``ablation.resamples``); 1."""
        return 1

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
    unknown = [s for s in method.settings if s not in SETTINGS]
    if unknown:
        raise HeadsweepError(f"ablation method {method.name!r} reads ablation.{unknown[0]}, which is not a key of the "
                             f"ablation section (known: {', '.join(SETTINGS)})")
    if method.fold == "constants" and method.fill != "constant":
        raise HeadsweepError(f"ablation method {method.name!r} folds constants but its fill is {method.fill}")
