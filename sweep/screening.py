"""``sweep.screen``: sequential screening of single-head masks on a random subset of the examples first.

Each ``single_head`` mask is first evaluated on the same random subset of the evaluation set (``fraction`` of
it, at least ``MIN_EXAMPLES`` examples, drawn once per run from ``seed``), together with the unmasked model on
that subset. The rule, a two one-sided tests (TOST) equivalence test (Schuirmann 1987) on the subset: a mask is
**screened out** (negligible, not evaluated further) when the subset's paired-bootstrap confidence interval
(``confidence``, default 0.99, sacrebleu's percentile convention) for its delta lies inside
``[-equivalence, +equivalence]`` (metric units: accuracy as a fraction, BLEU points, perplexity); every other
mask is **completed**, i.e. evaluated on the whole set like an unscreened one. A 1 - 2a interval inside the
margin rejects both one-sided nulls |delta| >= equivalence at level a, so a mask whose true effect on the
evaluation set's population is at least ``equivalence`` is screened out with probability at most
(1 - confidence) / 2 (0.5% by default), up to the bootstrap's approximation on a subset of this size.

What is stored. A screened-out mask's ``evaluations`` row holds its subset score, the unmasked model's subset
score as ``baseline_score`` and their difference as ``delta``, ``n_examples`` the subset size, and
``screen = 'screened_out'``; its ``examples`` rows are the subset's. A completed mask's row is the full
evaluation, with ``screen = 'completed'``. Both carry ``screen_examples`` and the subset interval
(``screen_ci_low``, ``screen_ci_high``). Significance: a screened-out mask gets no test rows, and it stays in
its experiment's multiple-comparison family with p = 1, so the correction is over every head planned (for Holm
and Bonferroni this is conservative: adjusted p-values can only grow).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.sweep.progress import Progress
from headsweep.sweep.significance import paired_bootstrap
from headsweep.workers.metrics import metric_by_name
from headsweep.workers.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.experiments.context import Context

SCREENED_EXPERIMENTS = ("single_head",)
SCREENED_OUT, COMPLETED = "screened_out", "completed"
MIN_EXAMPLES = 20  # fewer examples than this make a bootstrap interval meaningless
DEFAULTS = {"fraction": 0.2, "equivalence": None, "confidence": 0.99, "n_resamples": 1000}
SUBSET_BASELINE = "screen/baseline"  # the unmasked model on the subset (not stored: recomputed by each session)


def check_screen(screen: Any) -> None:
    """The ``sweep.screen`` mapping: known keys, an ``equivalence`` margin, values in range."""
    if screen is None:
        return
    if not isinstance(screen, dict):
        raise HeadsweepError(
            f"sweep.screen takes a mapping such as {{fraction: 0.2, equivalence: 0.01}}, got {screen!r}")
    unknown = sorted(set(screen) - set(DEFAULTS))
    if unknown:
        raise HeadsweepError(f"unknown key sweep.screen.{unknown[0]} (known: {', '.join(DEFAULTS)})")
    values = {**DEFAULTS, **screen}
    for key in ("fraction", "equivalence", "confidence"):
        if not _is_number(values[key]):
            if key == "equivalence":
                raise HeadsweepError(
                    "sweep.screen needs equivalence: the largest |delta| you call negligible, in the metric's units "
                    "(e.g. 0.005 for accuracy, 0.3 for BLEU)")
            raise HeadsweepError(f"sweep.screen.{key} must be a number, got {values[key]!r}")
    if not 0 < values["fraction"] < 1:
        raise HeadsweepError(f"sweep.screen.fraction must be between 0 and 1 (exclusive), got {values['fraction']}")
    if values["equivalence"] <= 0:
        raise HeadsweepError(f"sweep.screen.equivalence must be positive, got {values['equivalence']}")
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
    equivalence: float
    confidence: float
    n_resamples: int
    seed: int

    @classmethod
    def from_config(cls, screen: dict | None, seed: int) -> ScreenSettings | None:
        if not screen:
            return None
        values = {**DEFAULTS, **screen}
        return cls(float(values["fraction"]), float(values["equivalence"]), float(values["confidence"]),
                   int(values["n_resamples"]), int(seed))

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
    """One mask's screening on the subset: its delta's interval and whether that makes it negligible."""

    ci_low: float
    ci_high: float
    screened_out: bool

    def columns(self, n_examples: int) -> dict:
        """The ``evaluations`` columns that record it."""
        return {"screen": SCREENED_OUT if self.screened_out else COMPLETED, "screen_examples": n_examples,
                "screen_ci_low": self.ci_low, "screen_ci_high": self.ci_high}


def verdicts(metric: str, baseline: np.ndarray, masks: np.ndarray, settings: ScreenSettings) -> list[Verdict]:
    """The rule on ``masks`` (S, n, k) against the unmasked ``baseline`` (n, k), both on the subset."""
    result = paired_bootstrap(baseline, masks, metric_by_name(metric).score_from_stats,
                              n_resamples=settings.n_resamples, seed=settings.seed, confidence=settings.confidence)
    eq = settings.equivalence
    return [Verdict(float(lo), float(hi), bool(-eq <= lo and hi <= eq))
            for lo, hi in zip(result.ci_low, result.ci_high, strict=True)]


def screen(ctx: Context, units: list[WorkUnit], settings: ScreenSettings) -> list[WorkUnit]:
    """Screen the ``single_head`` units among ``units``; returns the units to evaluate on the whole set.

    Screened-out masks are written here (rows on the subset) and recorded in ``ctx.screened``; completed ones
    get their screening columns in ``ctx.screen_notes`` for the full row written later.
    """
    candidates = [u for u in units if u.experiment in SCREENED_EXPERIMENTS]
    if not candidates:
        return units
    positions = settings.positions(ctx.info.n_examples)
    subset = [WorkUnit(SUBSET_BASELINE, "screen", (), examples=positions)]
    subset += [dataclasses.replace(u, examples=positions) for u in candidates]
    by_id = {u.eval_id: u for u in candidates}
    outputs: dict[str, Any] = {}
    progress = Progress(len(subset), enabled=ctx.show_progress, label="screening", detail=ctx.pool.status_line)
    for unit, out, worker in ctx.pool.stream(subset, ctx.units_per_call()):
        outputs[unit.eval_id] = (out, worker)
        progress.update(1, f"[{unit.eval_id}]")
        ctx.record.heartbeat()
    base = outputs.pop(SUBSET_BASELINE)[0]
    ids = [u.eval_id for u in candidates]
    stacked = np.stack([outputs[i][0].stats for i in ids]).astype(np.float64)
    out_ids = []
    for eval_id, verdict in zip(ids, verdicts(ctx.info.metric, base.stats, stacked, settings), strict=True):
        columns = verdict.columns(len(positions))
        if verdict.screened_out:
            out, worker = outputs[eval_id]
            ctx.writer.add(by_id[eval_id], out, base.score, worker, positions=positions, extra=columns)
            ctx.writer.maybe_flush()
            ctx.screened.add(eval_id)
            out_ids.append(eval_id)
            ctx.count_for_budget()
        else:
            ctx.screen_notes[eval_id] = columns
    ctx.say_screened(len(out_ids), len(candidates), len(positions))
    return [u for u in units if u.eval_id not in ctx.screened]
