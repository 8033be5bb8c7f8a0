"""``sweep.screen``: sequential screening of single-head masks on a random subset of the examples first.

Each ``single_head`` mask is first evaluated on the same random subset of the evaluation set (``fraction`` of
it, at least ``MIN_EXAMPLES`` examples, drawn once per run from ``seed``), together with the unmasked model on
that subset. A mask is **screened out** (not evaluated further) when one of two rules, ``rule``, calls it
negligible from the subset; every other mask is **completed**: evaluated on the rest of the set, its rows and
statistics the subset's and the rest's together, i.e. the whole set's, as an unscreened run stores them.

``rule: equivalence`` (needs ``equivalence``, a margin in the metric's units: accuracy as a fraction, BLEU
points, perplexity): two one-sided tests (TOST, Schuirmann 1987). Screened out when the subset's
paired-bootstrap confidence interval (``confidence``, default 0.99, sacrebleu's percentile convention) for the
delta lies inside ``[-equivalence, +equivalence]``. A 1 - 2a interval inside the margin rejects both one-sided
nulls |delta| >= equivalence at level a, so a mask whose true effect is at least ``equivalence`` is screened
out with probability at most (1 - confidence) / 2 (0.5% by default). The guarantee is about effect sizes.

``rule: futility`` (takes ``miss``, default 0.05): stochastic curtailment against the run's own significance
test. Given the whole set's data, a simple random subset of fraction f has a z statistic
z_sub ~ N(sqrt(f) z_full, 1 - f) (normal approximation; finite-population variance). A mask is screened out
when |z_sub| < k, with z_sub = subset delta / its paired-bootstrap standard error and

    k = sqrt(f) z* + sqrt(1 - f) Phi^-1(miss),   z* = Phi^-1(1 - alpha / (2 m))

(m the single-head masks of the family, alpha ``significance.alpha``): a head whose whole-set test reaches
the Bonferroni boundary alpha / m is screened out with probability at most ``miss``, and a stronger one with
probability Phi((k - sqrt(f) |z_full|) / sqrt(1 - f)) (plus the negligible far tail), which falls fast
(``miss_chance``). The guarantee is
about what the full run would call significant; heads that the run's correction (Holm, BH) admits only above
alpha / m carry more risk. A mask with no change on any subset example is screened out under either rule.

What is stored. A screened-out mask's ``evaluations`` row holds its subset score, the unmasked model's subset
score as ``baseline_score`` and their difference as ``delta``, ``n_examples`` the subset size, and
``screen = 'screened_out'``; its ``examples`` rows are the subset's. A completed mask's row is the whole set's,
with ``screen = 'completed'``. Both carry ``screen_examples`` and the subset interval (``screen_ci_low``,
``screen_ci_high``). Significance: a screened-out mask gets no test rows, and it stays in its experiment's
multiple-comparison family with p = 1, so the correction is over every head planned (for Holm and Bonferroni
this is conservative: adjusted p-values can only grow).

Completion evaluates only the examples outside the subset and joins the two outputs by position
(:func:`joined`): the same numbers as a whole-set evaluation wherever an example's result does not depend on
which examples share its batch (the classifier and language-model families; in beam search, only near-ties
between hypotheses can fall the other way, as between any two batchings).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.statistics.significance import paired_bootstrap
from headsweep.workers.core.family import MaskOutput
from headsweep.workers.core.metrics import metric_by_name
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:  # the store brings pyarrow's datasets and pandas: a config's checks need neither
    from headsweep.results.store import ResultStore

SCREENED_OUT, COMPLETED = "screened_out", "completed"
MIN_EXAMPLES = 20  # fewer examples than this make a bootstrap interval meaningless
RULES = ("equivalence", "futility")
# fraction None: the rule's own (DEFAULT_FRACTION); futility needs a larger subset to tell null heads from heads
# at the significance boundary (see the table in docs/statistics.md of what each fraction screens out)
DEFAULT_FRACTION = {"equivalence": 0.2, "futility": 0.4}
# rule None: equivalence when a margin is given, futility otherwise (no setting is required)
DEFAULTS = {"fraction": None, "rule": None, "equivalence": None, "miss": 0.05, "confidence": 0.99,
            "n_resamples": 1000}
SUBSET_BASELINE = "screen/baseline"  # the unmasked model on the subset (not stored: recomputed by each session)


def resolved(screen: dict) -> dict:
    """``sweep.screen`` with its defaults: the rule (equivalence when a margin is given) and its fraction."""
    values = {**DEFAULTS, **screen}
    if values["rule"] is None:
        values["rule"] = "futility" if values["equivalence"] is None else "equivalence"
    if values["fraction"] is None and values["rule"] in DEFAULT_FRACTION:
        values["fraction"] = DEFAULT_FRACTION[values["rule"]]
    return values


def check_screen(screen: Any) -> None:
    """The ``sweep.screen`` mapping: known keys, a known rule and its settings, values in range."""
    if screen is None:
        return
    if not isinstance(screen, dict):
        raise HeadsweepError(
            f"sweep.screen takes a mapping such as {{rule: futility}} or {{equivalence: 0.01}}, got {screen!r}")
    unknown = sorted(set(screen) - set(DEFAULTS))
    if unknown:
        raise HeadsweepError(f"unknown key sweep.screen.{unknown[0]} (known: {', '.join(DEFAULTS)})")
    values = resolved(screen)
    if values["rule"] not in RULES:
        raise HeadsweepError(f"unknown sweep.screen.rule {values['rule']!r} (known: {', '.join(RULES)})")
    futility = values["rule"] == "futility"
    if futility and values["equivalence"] is not None:
        raise HeadsweepError("sweep.screen.equivalence is the equivalence rule's margin; rule futility takes miss "
                             "(the largest chance of screening out a head the full run would call significant)")
    if not futility and "miss" in screen:
        raise HeadsweepError("sweep.screen.miss belongs to rule futility; the equivalence rule takes equivalence "
                             "(or set rule: futility)")
    for key in ("fraction", "miss", "confidence") + (() if futility else ("equivalence",)):
        if not _is_number(values[key]):
            if key == "equivalence":
                raise HeadsweepError(
                    "sweep.screen needs equivalence: the largest |delta| you call negligible, in the metric's units "
                    "(e.g. 0.005 for accuracy, 0.3 for BLEU)")
            raise HeadsweepError(f"sweep.screen.{key} must be a number, got {values[key]!r}")
    if not 0 < values["fraction"] < 1:
        raise HeadsweepError(f"sweep.screen.fraction must be between 0 and 1 (exclusive), got {values['fraction']}")
    if not futility and values["equivalence"] <= 0:
        raise HeadsweepError(f"sweep.screen.equivalence must be positive, got {values['equivalence']}")
    if not 0 < values["miss"] < 0.5:
        raise HeadsweepError(f"sweep.screen.miss must be between 0 and 0.5 (exclusive), got {values['miss']}")
    if not 0.5 <= values["confidence"] < 1:
        raise HeadsweepError(f"sweep.screen.confidence must be in [0.5, 1), got {values['confidence']}")
    n = values["n_resamples"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 100:
        raise HeadsweepError(f"sweep.screen.n_resamples must be a whole number of at least 100, got {n!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ScreenSettings:
    """``sweep.screen`` resolved (checked by :func:`check_screen`), with the seed of the subset and resamples."""

    fraction: float
    equivalence: float | None
    confidence: float
    n_resamples: int
    seed: int
    rule: str = "equivalence"
    miss: float = 0.05
    alpha: float = 0.01  # significance.alpha: the futility rule's boundary

    @classmethod
    def from_config(cls, screen: dict | None, seed: int, alpha: float = 0.01) -> ScreenSettings | None:
        if screen is None:
            return None
        values = resolved(screen)
        margin = values["equivalence"]
        return cls(float(values["fraction"]), None if margin is None else float(margin),
                   float(values["confidence"]), int(values["n_resamples"]), int(seed), str(values["rule"]),
                   float(values["miss"]), float(alpha))

    def boundary(self, n_masks: int) -> float:
        """z*: the whole-set |z| of the Bonferroni boundary alpha / m (two-sided) that ``miss`` is stated at."""
        return NormalDist().inv_cdf(1 - self.alpha / (2 * max(1, n_masks)))

    def cut(self, n_masks: int) -> float:
        """The futility rule's k: a mask is screened out when its subset |z| is below it (module docstring)."""
        f = self.fraction
        return math.sqrt(f) * self.boundary(n_masks) + math.sqrt(1 - f) * NormalDist().inv_cdf(self.miss)

    def miss_chance(self, n_masks: int, z_full: float) -> float:
        """The futility rule's chance of screening out a mask whose whole-set statistic is ``z_full``."""
        f, k = self.fraction, self.cut(n_masks)
        if k <= 0:
            return 0.0
        sd = math.sqrt(1 - f)
        centre = math.sqrt(f) * abs(z_full)
        return NormalDist(centre, sd).cdf(k) - NormalDist(centre, sd).cdf(-k)

    def describe(self, n_masks: int) -> str:
        """The rule and its cut in a few words, e.g. ``futility: |z| < 1.14, miss 5% at z 3.81``."""
        if self.rule == "futility":
            return f"futility: |z| < {self.cut(n_masks):.2f}, miss {self.miss:.0%} at z {self.boundary(n_masks):.2f}"
        return f"equivalence: interval inside +-{self.equivalence:g}"

    def check_cut(self, n_masks: int) -> None:
        """Refuse a futility rule that could screen out nothing (its k is not positive)."""
        if self.rule != "futility" or self.cut(n_masks) > 0:
            return
        raise HeadsweepError(
            f"sweep.screen: with fraction {self.fraction:g}, miss {self.miss:g} and {n_masks} single-head masks "
            f"at significance.alpha {self.alpha:g}, the futility rule could screen out no mask: raise the fraction "
            "(0.3-0.4 suits most grids) or miss")

    def subset_size(self, n_examples: int) -> int:
        return math.ceil(self.fraction * n_examples)

    def check_size(self, n_examples: int) -> None:
        """Refuse a subset too small for an interval, or one that is the whole set (screening would save nothing)."""
        k = self.subset_size(n_examples)
        if k < MIN_EXAMPLES:
            raise HeadsweepError(
                f"sweep.screen.fraction {self.fraction:g} of {n_examples} examples is {k} examples, fewer than "
                f"{MIN_EXAMPLES}: raise the fraction, use more data, or run without sweep.screen")
        if k >= n_examples:
            raise HeadsweepError(f"sweep.screen.fraction {self.fraction:g} of {n_examples} examples is every "
                                 "example: lower the fraction or run without sweep.screen")

    def positions(self, n_examples: int) -> tuple[int, ...]:
        """The subset: ``ceil(fraction x n)`` positions drawn without replacement from ``seed``, in order."""
        rng = np.random.default_rng(self.seed)
        chosen = rng.choice(n_examples, size=self.subset_size(n_examples), replace=False)
        return tuple(int(p) for p in np.sort(chosen))


@dataclass(frozen=True)
class Verdict:
    """One mask's screening on the subset: its delta's interval and whether it is negligible."""

    ci_low: float
    ci_high: float
    screened_out: bool

    def columns(self, n_examples: int) -> dict:
        """The ``evaluations`` columns that record it."""
        return {"screen": SCREENED_OUT if self.screened_out else COMPLETED, "screen_examples": n_examples,
                "screen_ci_low": self.ci_low, "screen_ci_high": self.ci_high}


def verdicts(metric: str, baseline: np.ndarray, masks: np.ndarray, settings: ScreenSettings,
             n_masks: int | None = None) -> list[Verdict]:
    """The rule on ``masks`` (S, n, k) against the unmasked ``baseline`` (n, k), both on the subset.

    ``n_masks``: the family's size for the futility rule's boundary (default: the S masks given).
    """
    masks = np.asarray(masks, dtype=np.float64)
    result = paired_bootstrap(baseline, masks, metric_by_name(metric).score_from_stats,
                              n_resamples=settings.n_resamples, seed=settings.seed, confidence=settings.confidence)
    same = (masks == np.asarray(baseline, dtype=np.float64)).all(axis=(1, 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(same, 0.0, result.statistic / result.std_error)
    if settings.rule == "futility":
        k = settings.cut(len(masks) if n_masks is None else n_masks)
        # a constant non-zero shift has no resampling spread: |z| is infinite, never screened out
        out = same | (np.abs(np.nan_to_num(z, nan=np.inf)) < k)
    else:
        eq = settings.equivalence
        out = same | ((-eq <= result.ci_low) & (result.ci_high <= eq))
    return [Verdict(float(lo), float(hi), bool(o))
            for lo, hi, o in zip(result.ci_low, result.ci_high, out, strict=True)]


def complement(positions: Sequence[int], n_examples: int) -> tuple[int, ...]:
    """The positions of the evaluation set outside ``positions``, in order (what completing a mask evaluates)."""
    inside = set(positions)
    return tuple(p for p in range(n_examples) if p not in inside)


def joined(metric: str, first: MaskOutput, first_positions: Sequence[int], rest: MaskOutput,
           rest_positions: Sequence[int]) -> MaskOutput:
    """One mask's outputs on two disjoint parts of the evaluation set as one output on the whole set.

    Per-example statistics, losses and outputs are placed at their positions; the score is the metric's corpus
    score of the whole set's statistics (sacrebleu's shape: summed sufficient statistics), as an adapter scores a
    whole-set evaluation.
    """
    n = len(first_positions) + len(rest_positions)
    where = np.asarray([*first_positions, *rest_positions])
    if len(first.outputs) != len(first_positions) or len(rest.outputs) != len(rest_positions) or \
            sorted(where.tolist()) != list(range(n)):
        raise ValueError("the two parts must cover the evaluation set once, one output per position")
    stats = np.empty((n, first.stats.shape[1]), dtype=np.result_type(first.stats, rest.stats))
    stats[where] = np.concatenate([first.stats, rest.stats])
    loss = None
    if first.loss is not None and rest.loss is not None:
        loss = np.empty(n, dtype=np.result_type(first.loss, rest.loss))
        loss[where] = np.concatenate([first.loss, rest.loss])
    outputs = [""] * n
    for p, text in zip(where.tolist(), [*first.outputs, *rest.outputs], strict=True):
        outputs[p] = text
    return MaskOutput(stats=stats, loss=loss, outputs=outputs, score=metric_by_name(metric).score(stats),
                      seconds=first.seconds + rest.seconds)


@dataclass
class Judged:
    """What a screening pass decided: the screened-out masks' subset rows to store (unit, output, worker, the
    unmasked model's subset score, the subset's positions, the screening columns), the units still to evaluate
    (completed masks on the rest of the set), and the status line that says so."""

    screened_out: list[tuple[WorkUnit, MaskOutput, str, float, tuple[int, ...], dict]]
    remaining: list[WorkUnit]
    line: str


class Screening:
    """``sweep.screen`` as a run consults it: the one place that knows which masks are screened, how, and what is
    stored of them. One per model of a run (a completed mask's subset output waits here for its rest).

    The context asks it for the subset pass (:meth:`subset_units`), hands it the outputs (:meth:`judge`), joins
    the rest of a completed mask with its subset (:meth:`join`) and adds its columns (:meth:`columns`); the
    significance family counts a screened-out mask with p = 1 (:meth:`is_screened`).
    """

    def __init__(self, settings: ScreenSettings, kinds: frozenset[str], screened: set[str] | None = None):
        self.settings = settings
        self.kinds = kinds  # the experiment kinds whose masks are screened (a kind's ``screened`` declaration)
        self.screened: set[str] = set(screened or ())  # eval ids screened out (this session's and a resumed run's)
        self.notes: dict[str, dict] = {}  # completed masks' screening columns, for their whole-set rows
        # completed masks' subset outputs, with the subset's and the rest's positions, until the rest lands
        self.parts: dict[str, tuple[MaskOutput, tuple[int, ...], tuple[int, ...]]] = {}

    @classmethod
    def of(cls, cfg: Config, kinds: frozenset[str], screened: set[str] | None = None) -> Screening | None:
        """The policy of ``cfg`` (None when it does not screen) over the masks of ``kinds``, with a resumed run's
        screened-out eval ids."""
        settings = ScreenSettings.from_config(cfg.sweep.screen, cfg.significance.seed, cfg.significance.alpha)
        return None if settings is None else cls(settings, kinds, screened)

    @staticmethod
    def check_config(cfg: Config, kinds: Sequence[str], whole_set: Sequence[str]) -> None:
        """The ``sweep.screen`` mapping (:func:`check_screen`), and what it asks of the rest of the config: a kind it
        screens (one of ``kinds``), and none that needs every mask on the whole set (``whole_set``)."""
        check_screen(cfg.sweep.screen)
        if cfg.sweep.screen is None:
            return
        if not any(k in cfg.sweep.experiments for k in kinds):
            named = " or ".join(kinds)
            raise HeadsweepError(f"sweep.screen screens {named} masks, and this run has no {named} "
                                 "experiment: add it to sweep.experiments or remove sweep.screen")
        for kind in (k for k in whole_set if k in cfg.sweep.experiments):
            raise HeadsweepError(f"sweep.screen cannot be combined with {kind}: interactions need every head's "
                                 f"single-head evaluation on the whole set; run the {kind} in a run of their own")

    def check_model(self, n_examples: int, n_masks: int) -> None:
        """Refuse a subset the evaluation set cannot give, or a rule that could screen out nothing (before anything
        is written); ``n_masks``: the single-head masks of the run."""
        self.settings.check_size(n_examples)
        self.settings.check_cut(n_masks)

    @staticmethod
    def stored(store: ResultStore, run_id: str) -> set[str]:
        """Eval ids the run stored as screened out: their rows and statistics are a subset's."""
        rows = store.read("evaluations", run_id, columns=["eval_id", "screen"]).to_pylist()
        return {r["eval_id"] for r in rows if r["screen"] == SCREENED_OUT}

    def subset_units(self, units: Sequence[WorkUnit], n_examples: int) -> list[WorkUnit]:
        """The screening pass of ``units``: the unmasked model and each screened kind's mask on the subset (empty
        when no unit is screened)."""
        candidates = [u for u in units if u.experiment in self.kinds]
        if not candidates:
            return []
        positions = self.settings.positions(n_examples)
        return [WorkUnit(SUBSET_BASELINE, "screen", (), examples=positions),
                *(dataclasses.replace(u, examples=positions) for u in candidates)]

    def family_size(self, units: Sequence[WorkUnit]) -> int:
        """The screened masks of a significance family (stored ones included): the futility rule's m."""
        return sum(u.experiment in self.kinds for u in units)

    def judge(self, metric: str, units: Sequence[WorkUnit], outputs: dict[str, tuple[MaskOutput, str]],
              n_examples: int, family: int) -> Judged:
        """The rule on the subset ``outputs`` (eval id -> output, worker; the unmasked model's under
        ``SUBSET_BASELINE``) of ``units``' screened masks: which are screened out (recorded here, and returned
        to be stored), and ``units`` as they go on (completed masks on the rest of the set)."""
        candidates = [u for u in units if u.experiment in self.kinds]
        positions = self.settings.positions(n_examples)
        rest = complement(positions, n_examples)
        base = outputs[SUBSET_BASELINE][0]
        ids = [u.eval_id for u in candidates]
        stacked = np.stack([outputs[i][0].stats for i in ids]).astype(np.float64)
        out: list[tuple[WorkUnit, MaskOutput, str, float, tuple[int, ...], dict]] = []
        for unit, verdict in zip(candidates, verdicts(metric, base.stats, stacked, self.settings, family),
                                 strict=True):
            columns = verdict.columns(len(positions))
            output, worker = outputs[unit.eval_id]
            if verdict.screened_out:
                self.screened.add(unit.eval_id)
                out.append((unit, output, worker, base.score, positions, columns))
            else:
                self.notes[unit.eval_id] = columns
                self.parts[unit.eval_id] = (output, positions, rest)
        line = (f"screening ({self.settings.describe(family)}): {len(out)} of {len(candidates)} masks screened out "
                f"on {len(positions)} of {n_examples} examples; {len(candidates) - len(out)} go on to the rest")
        remaining = [dataclasses.replace(u, examples=rest) if u.eval_id in self.parts else u
                     for u in units if u.eval_id not in self.screened]
        return Judged(out, remaining, line)

    def join(self, metric: str, unit: WorkUnit, out: MaskOutput) -> MaskOutput:
        """``out`` as the whole set's: the rest of a completed mask joined with its subset (others as they are)."""
        if unit.eval_id not in self.parts:
            return out
        part, positions, rest = self.parts.pop(unit.eval_id)
        return joined(metric, part, positions, out, rest)

    def columns(self, eval_id: str) -> dict | None:
        """The screening columns of a completed mask's whole-set row (None for a mask that was not screened)."""
        return self.notes.get(eval_id)

    def is_screened(self, eval_id: str) -> bool:
        """Whether the mask ``eval_id`` was screened out (stored on the subset only)."""
        return eval_id in self.screened
