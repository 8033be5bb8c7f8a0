"""Paired significance tests for head-ablation grids.

Every ablated system is compared with one baseline on the same examples, and a
grid has hundreds of systems, so everything here is vectorised over a leading
"systems" axis: one call tests the whole grid.

Metrics enter as per-example sufficient statistics (the sacrebleu model): a
corpus score is a function of the statistics summed over examples, which makes
a bootstrap resample a matrix product ``counts @ stats`` where ``counts`` holds
how often each example was drawn.

Tests:

* ``paired_bootstrap``: Koehn (2004) paired bootstrap, with the p-value defined
  exactly as ``sacrebleu.significance`` 2.x defines it and, for the same seed,
  the very same resamples as sacrebleu draws.
* ``paired_ttest``: paired t-test over per-example values (e.g. correctness),
  equal to ``scipy.stats.ttest_rel``.
* ``mcnemar_exact``: exact McNemar test (two-sided binomial test on the
  discordant pairs) for binary outcomes.
* ``adjust_pvalues``: multiple-comparison corrections (BH, Holm, Bonferroni).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headsweep.workers.core.metrics import accuracy_from_stats, bleu_from_stats

__all__ = [
    "CorpusScore",
    "TestResult",
    "accuracy_from_stats",
    "adjust_pvalues",
    "bleu_from_stats",
    "mcnemar_exact",
    "paired_bootstrap",
    "paired_ttest",
    "resample_counts",
    "significance_rows",
]

CorpusScore = Callable[[np.ndarray, int], np.ndarray]
"""``score(stats_sum, n)``: summed statistics of shape (..., k) and the number of
examples that were summed; returns scores of shape (...)."""

# Keeps the per-chunk temporaries (summed statistics of R resamples x C systems
# x k statistics and the score arithmetic on them) around this size.
_DEFAULT_MAX_BYTES = 256 * 2**20
# Resample indices are drawn this many bytes (of int64 indices) at a time.
DRAW_BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class TestResult:
    """Result of one paired test of S systems against one baseline.

    Arrays have shape (S,), aligned with the systems passed in.

    * ``statistic``: ``paired_bootstrap``: observed score delta (system -
      baseline); ``paired_ttest``: Student's t of the per-example differences;
      ``mcnemar_exact``: the smaller of the two discordant counts, min(b, c),
      where b = baseline right & system wrong, c = baseline wrong & system right.
    * ``p_value``: two-sided p-value.
    * ``ci_low``/``ci_high``: confidence interval (95% unless asked otherwise)
      of the delta system - baseline; NaN for McNemar, which has none.
    * ``n_resamples``: bootstrap resamples, 0 for tests that do not resample.
    * ``seed``: seed of the resamples, None for tests that do not resample.
    * ``std_error``: ``paired_bootstrap`` only: the standard deviation of the resampled deltas.
    """

    __test__ = False  # not a pytest test class despite the name

    test: str
    statistic: np.ndarray
    p_value: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n_resamples: int
    seed: int | None
    # paired_bootstrap: the resampled deltas' standard deviation (the delta's bootstrap standard error)
    std_error: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.p_value.shape[0])


def resample_counts(n_examples: int, n_resamples: int, seed: int) -> np.ndarray:
    """Bootstrap multiplicities: an (n_resamples, n_examples) int32 matrix whose
    row r counts how often each example was drawn in resample r (rows sum to
    n_examples).

    The draws are exactly sacrebleu 2.x's: ``np.random.default_rng(seed).choice(
    n_examples, size=(n_resamples, n_examples), replace=True)``, so for the same
    seed the resamples are sacrebleu's. The index matrix is drawn in blocks of
    rows to bound memory; numpy's generator consumes its stream element by
    element in C order, so blocks reproduce the one-shot draw (tested).
    """
    if n_examples <= 0 or n_resamples <= 0:
        raise ValueError("n_examples and n_resamples must be positive")
    rng = np.random.default_rng(seed)
    counts = np.empty((n_resamples, n_examples), dtype=np.int32)
    rows_per_block = max(1, DRAW_BLOCK_BYTES // (8 * n_examples))
    for r0 in range(0, n_resamples, rows_per_block):
        r1 = min(n_resamples, r0 + rows_per_block)
        idx = rng.choice(n_examples, size=(r1 - r0, n_examples), replace=True)
        flat = (idx + n_examples * np.arange(r1 - r0)[:, None]).ravel()
        counts[r0:r1] = np.bincount(flat, minlength=(r1 - r0) * n_examples).reshape(
            r1 - r0, n_examples
        )
    return counts


def _ci_indices(n_resamples: int, confidence: float) -> tuple[int, int]:
    # sacrebleu's estimate_ci convention for 95%: sorted[n // 40], sorted[n - n // 40 - 1];
    # the epsilon keeps e.g. 1000 * 0.025 from flooring to 24.
    lo = math.floor(n_resamples * (1.0 - confidence) / 2.0 + 1e-9)
    return lo, n_resamples - lo - 1


def paired_bootstrap(
    baseline_stats: np.ndarray,
    system_stats: np.ndarray,
    corpus_score: CorpusScore,
    n_resamples: int = 1000,
    seed: int | None = 12345,
    counts: np.ndarray | None = None,
    confidence: float = 0.95,
    *,
    identical_p_one: bool = True,
    max_bytes: int = _DEFAULT_MAX_BYTES,
) -> TestResult:
    """Paired bootstrap test of S systems against a baseline on the same N examples.

    ``baseline_stats``: (N, k) per-example sufficient statistics; ``system_stats``:
    (S, N, k), or (N, k) for one system. Every system is scored on the same
    resamples (``counts``, or ``resample_counts(N, n_resamples, seed)``).

    p-value, as in ``sacrebleu.significance._paired_bs_test`` (two-sided, on
    absolute differences): with d_r = |score_sys(r) - score_base(r)| over the
    resamples and D = |observed delta|,
    ``p = (#{r : d_r - mean(d) > D} + 1) / (n_resamples + 1)``.
    For the same seed the resamples are sacrebleu's, so p-values agree with
    sacrebleu's up to its float32 rounding (in rare near-ties, one count).

    One deliberate difference, on by default (``identical_p_one``): a system
    whose statistics equal the baseline's on every example gets p = 1.0.
    sacrebleu gives it 1 / (n_resamples + 1) (every centred difference is 0 and
    its count is strict), which would call a head whose removal changes nothing
    significant at p < 0.01. Pass ``identical_p_one=False`` for sacrebleu's value.

    ``statistic`` is the observed delta (system - baseline, signed); the CI is the
    percentile interval of the resampled deltas, using sacrebleu's order-statistic
    convention (sorted[n // 40] and sorted[n - n // 40 - 1] for 95%).

    Pass ``counts`` to reuse resamples across calls (e.g. chunks of a grid); then
    pass the ``seed`` that made them (it is only recorded), or None. ``seed=None``
    without ``counts`` draws a fresh seed from OS entropy and records it. (Unlike
    sacrebleu, which treats SACREBLEU_SEED=0 as "unseeded", 0 is an ordinary seed.)
    Memory is bounded by processing systems (and, for huge N, resamples) in
    chunks of about ``max_bytes`` of temporaries.
    """
    base = np.asarray(baseline_stats, dtype=np.float64)
    syst = np.asarray(system_stats, dtype=np.float64)
    if syst.ndim == 2:
        syst = syst[None]
    if base.ndim != 2 or syst.ndim != 3 or syst.shape[1:] != base.shape:
        raise ValueError(
            f"need baseline (N, k) and systems (S, N, k); got {base.shape} and {syst.shape}"
        )
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    n_sys, n_ex, k = syst.shape
    if counts is None:
        if seed is None:
            # fresh entropy, but recorded, so the run can be reproduced
            seed = int(np.random.SeedSequence().entropy % 2**63)
        counts = resample_counts(n_ex, n_resamples, seed)
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] != n_ex:
        raise ValueError(f"counts must be (n_resamples, {n_ex}); got {counts.shape}")
    n_res = counts.shape[0]

    base_score = corpus_score(base.sum(axis=0), n_ex)
    sys_score = np.asarray(corpus_score(syst.sum(axis=1), n_ex), dtype=np.float64)
    observed = sys_score - base_score

    # Temporaries per (resample, system): k summed statistics plus a handful of
    # score-sized arrays; the resample axis is split too when N is huge.
    per_cell = 8 * (2 * k + 8)
    res_block = max(1, min(n_res, max_bytes // max(1, 8 * n_ex + per_cell)))
    sys_block = max(1, min(n_sys, max_bytes // (per_cell * res_block)))

    deltas = np.empty((n_res, n_sys), dtype=np.float64)
    # (N, S*k) so one matmul sums every system's statistics for a block of resamples
    flat = np.ascontiguousarray(syst.transpose(1, 0, 2)).reshape(n_ex, n_sys * k)
    for r0 in range(0, n_res, res_block):
        r1 = min(n_res, r0 + res_block)
        c = counts[r0:r1].astype(np.float64)
        base_boot = corpus_score(c @ base, n_ex)
        for s0 in range(0, n_sys, sys_block):
            s1 = min(n_sys, s0 + sys_block)
            sums = (c @ flat[:, s0 * k : s1 * k]).reshape(r1 - r0, s1 - s0, k)
            deltas[r0:r1, s0:s1] = corpus_score(sums, n_ex) - base_boot[:, None]

    # sacrebleu: sample_diffs = |sys - bl|; stats = sample_diffs - mean;
    # c = sum(stats > |real diff|); p = (c + 1) / (n + 1)
    abs_d = np.abs(deltas)
    centred = abs_d - abs_d.mean(axis=0)
    exceed = (centred > np.abs(observed)).sum(axis=0)
    p = (exceed + 1.0) / (n_res + 1.0)
    if identical_p_one:
        same = (syst == base).all(axis=(1, 2))
        p = np.where(same, 1.0, p)

    lo_i, hi_i = _ci_indices(n_res, confidence)
    ordered = np.sort(deltas, axis=0)
    return TestResult(
        test="paired_bootstrap",
        statistic=observed,
        p_value=p,
        ci_low=ordered[lo_i].copy(),
        ci_high=ordered[hi_i].copy(),
        n_resamples=int(n_res),
        seed=seed,
        std_error=deltas.std(axis=0, ddof=1) if n_res > 1 else np.full(n_sys, np.nan),
    )


# --------------------------------------------------------------------------
# Tests on per-example values
# --------------------------------------------------------------------------


def _paired_arrays(baseline: np.ndarray, system: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(baseline, dtype=np.float64)
    s = np.asarray(system, dtype=np.float64)
    if s.ndim == 1:
        s = s[None]
    if b.ndim != 1 or s.ndim != 2 or s.shape[1] != b.shape[0]:
        raise ValueError(f"need baseline (N,) and systems (S, N); got {b.shape} and {s.shape}")
    return b, s


def paired_ttest(
    baseline_values: np.ndarray, system_values: np.ndarray, *, confidence: float = 0.95
) -> TestResult:
    """Two-sided paired t-test of each system against the baseline.

    ``baseline_values``: (N,); ``system_values``: (S, N) (or (N,)), e.g. per-example
    correctness. Equals ``scipy.stats.ttest_rel(system, baseline)`` per system;
    the CI is scipy's ``confidence_interval`` of the mean difference (system -
    baseline). Zero-variance differences, where scipy returns NaN or inf:
    identical systems get t = 0, p = 1.0 and CI [0, 0]; a constant non-zero
    difference d gets t = sign(d) * inf, p = 0.0 and CI [d, d] (scipy's values).
    N < 2 gives NaN.
    """
    b, s = _paired_arrays(baseline_values, system_values)
    d = s - b
    n = d.shape[1]
    df = n - 1
    nan = np.full(d.shape[0], np.nan)
    if n < 2:
        return TestResult("paired_ttest", nan, nan.copy(), nan.copy(), nan.copy(), 0, None)

    mean = d.mean(axis=1)
    se = np.sqrt(d.var(axis=1, ddof=1) / n)
    constant = (d == d[:, :1]).all(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = mean / se
    first = d[:, 0]
    t = np.where(constant, np.where(first > 0, np.inf, np.where(first < 0, -np.inf, 0.0)), t)
    # scipy.stats.t's own sf and ppf are these two functions (t_gen._sf, t_gen._ppf); scipy.special imports in a
    # third of scipy.stats's time, which every driver with a t-test would pay
    from scipy.special import stdtr, stdtrit

    p = 2.0 * stdtr(df, -np.abs(t))
    p = np.minimum(p, 1.0)
    half = stdtrit(df, 0.5 + confidence / 2.0) * np.where(constant, 0.0, se)
    center = np.where(constant, d[:, 0], mean)
    return TestResult(
        test="paired_ttest",
        statistic=t,
        p_value=p,
        ci_low=center - half,
        ci_high=center + half,
        n_resamples=0,
        seed=None,
    )


def mcnemar_exact(baseline_correct: np.ndarray, system_correct: np.ndarray) -> TestResult:
    """Exact McNemar test for binary outcomes.

    ``baseline_correct``: (N,), ``system_correct``: (S, N) (or (N,)), truthy =
    correct. With b = #(baseline right, system wrong) and c = #(baseline wrong,
    system right), the p-value is the two-sided exact binomial test of
    c ~ Binomial(b + c, 1/2) (``scipy.stats.binomtest``), i.e.
    min(1, 2 * P[X <= min(b, c)]); no discordant pairs gives p = 1.
    ``statistic`` is min(b, c). No confidence interval (NaN).
    """
    b_, s_ = _paired_arrays(baseline_correct, system_correct)
    base = b_ != 0
    sys_ = s_ != 0
    b = (base & ~sys_).sum(axis=1)
    c = (~base & sys_).sum(axis=1)
    m = b + c
    low = np.minimum(b, c)
    from scipy.special import bdtr  # the binomial CDF without scipy.stats's import (see paired_ttest)

    p = np.where(m > 0, np.minimum(1.0, 2.0 * bdtr(low, np.maximum(m, 1), 0.5)), 1.0)
    nan = np.full(low.shape, np.nan)
    return TestResult(
        test="mcnemar_exact",
        statistic=low.astype(np.float64),
        p_value=p,
        ci_low=nan,
        ci_high=nan.copy(),
        n_resamples=0,
        seed=None,
    )


# --------------------------------------------------------------------------
# Multiple comparisons
# --------------------------------------------------------------------------

ADJUST_METHODS = ("bh", "holm", "bonferroni", "none")


def adjust_pvalues(p: np.ndarray, method: str) -> np.ndarray:
    """Adjust a family of p-values for multiple comparisons.

    ``method``: "bh" (Benjamini-Hochberg FDR, equal to
    ``scipy.stats.false_discovery_control(p, method='bh')``), "holm" (Holm's
    step-down FWER, made monotone, capped at 1), "bonferroni" (m * p capped at
    1) or "none". Every entry of ``p`` (any shape) is one test of the family;
    NaNs stay NaN and do not count towards the family size m.
    """
    if method not in ADJUST_METHODS:
        raise ValueError(f"unknown correction {method!r}; use one of {ADJUST_METHODS}")
    arr = np.asarray(p, dtype=np.float64)
    out = np.full(arr.shape, np.nan)
    flat = arr.ravel()
    ok = ~np.isnan(flat)
    vals = flat[ok]
    if np.any((vals < 0) | (vals > 1)):
        raise ValueError("p-values must lie in [0, 1]")
    m = vals.size
    if m == 0 or method == "none":
        res = vals.copy()
    elif method == "bonferroni":
        res = np.minimum(1.0, vals * m)
    else:
        order = np.argsort(vals, kind="stable")
        ranked = vals[order]
        i = np.arange(1, m + 1)
        if method == "bh":
            # step-up: running minimum from the largest p down
            adj = np.minimum.accumulate((ranked * m / i)[::-1])[::-1]
        else:
            # step-down: running maximum from the smallest p up
            adj = np.maximum.accumulate(ranked * (m - i + 1))
        res = np.empty(m)
        res[order] = np.minimum(adj, 1.0)
    out_flat = out.reshape(-1)
    out_flat[ok] = res
    return out_flat.reshape(arr.shape)


# --------------------------------------------------------------------------
# Rows for the results store
# --------------------------------------------------------------------------


def significance_rows(
    result: TestResult,
    eval_ids: Sequence[Any] | None = None,
    *,
    correction: str = "bh",
    alpha: float = 0.01,
    p_adjusted: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One dict per system with the ``significance`` table's columns (less run_id):
    eval_id (if ``eval_ids`` given), test, statistic, p_value, p_adjusted,
    correction, ci_low, ci_high, significant, n_resamples, seed.

    ``p_adjusted`` defaults to ``adjust_pvalues(result.p_value, correction)``,
    i.e. the family is this result's systems; pass it precomputed to correct
    over a larger family. ``significant`` is ``p_adjusted < alpha`` (False for NaN).
    """
    n = len(result)
    if eval_ids is not None and len(eval_ids) != n:
        raise ValueError(f"{len(eval_ids)} eval_ids for {n} systems")
    adj = adjust_pvalues(result.p_value, correction) if p_adjusted is None else np.asarray(
        p_adjusted, dtype=np.float64
    )
    if adj.shape != (n,):
        raise ValueError(f"p_adjusted must have shape ({n},)")
    rows = []
    for i in range(n):
        row: dict[str, Any] = {} if eval_ids is None else {"eval_id": eval_ids[i]}
        row.update(
            test=result.test,
            statistic=float(result.statistic[i]),
            p_value=float(result.p_value[i]),
            p_adjusted=float(adj[i]),
            correction=correction,
            ci_low=float(result.ci_low[i]),
            ci_high=float(result.ci_high[i]),
            significant=bool(adj[i] < alpha),
            n_resamples=int(result.n_resamples),
            seed=result.seed,
        )
        rows.append(row)
    return rows
