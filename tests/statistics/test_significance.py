"""Tests for headsweep.sweep.statistics.significance, each against an independent route (sacrebleu,
scipy, or arithmetic done by hand), never the code against itself."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest, _bootstrap_resample
from scipy import stats as sps

from headsweep.sweep.statistics.significance import (
    TestResult,
    accuracy_from_stats,
    adjust_pvalues,
    bleu_from_stats,
    mcnemar_exact,
    paired_bootstrap,
    paired_ttest,
    resample_counts,
    significance_rows,
)
from headsweep.workers.core.metrics import chrf_from_stats

N_SENT = 300
N_RES = 1000

# --------------------------------------------------------------------------
# Sentence fixtures: references, a baseline and systems of varying closeness
# --------------------------------------------------------------------------

_VOCAB = [f"w{i}" for i in range(400)] + ["the", "a", "of", "and", "is", "on", "in"]


def _perturb(sentence: str, rate: float, rng: random.Random) -> str:
    out = []
    for w in sentence.split():
        x = rng.random()
        if x < rate / 3:
            continue  # drop
        if x < 2 * rate / 3:
            out.append(rng.choice(_VOCAB))  # substitute
        elif x < rate:
            out.extend([w, rng.choice(_VOCAB)])  # insert
        else:
            out.append(w)
    return " ".join(out)


def _system(base: list[str], refs: list[str], worse: float, better: float,
            rng: random.Random) -> list[str]:
    """Copy of ``base`` with a fraction ``worse`` of its sentences degraded and a
    fraction ``better`` replaced by a lightly perturbed reference (improved)."""
    out = []
    for h, r in zip(base, refs, strict=True):
        x = rng.random()
        if x < worse:
            out.append(_perturb(h, 0.3, rng))
        elif x < worse + better:
            out.append(_perturb(r, 0.3, rng))
        else:
            out.append(h)
    return out


@pytest.fixture(scope="module")
def corpus() -> dict:
    rng = random.Random(20240601)
    refs = [
        " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(2, 28))) for _ in range(N_SENT)
    ]
    base = [_perturb(r, 0.35, rng) for r in refs]
    # from identical to far, some better and some worse: p-values spread over (0, 1]
    specs = [(0.0, 0.0), (0.02, 0.02), (0.05, 0.03), (0.05, 0.05), (0.02, 0.0), (0.0, 0.03),
             (0.1, 0.05), (0.2, 0.0), (1.0, 0.0)]
    systems = [_system(base, refs, w, b, rng) for w, b in specs]
    metric = BLEU(references=[refs])
    base_stats = np.array(metric._extract_corpus_statistics(base, None), dtype=np.float64)
    sys_stats = np.array(
        [metric._extract_corpus_statistics(h, None) for h in systems], dtype=np.float64
    )
    return {"refs": refs, "base": base, "systems": systems, "metric": metric,
            "base_stats": base_stats, "sys_stats": sys_stats}


def _sacrebleu_paired_bs(corpus: dict, monkeypatch: pytest.MonkeyPatch, seed: int) -> np.ndarray:
    # PairedTest reads its seed from SACREBLEU_SEED when constructed
    monkeypatch.setenv("SACREBLEU_SEED", str(seed))
    named = [("baseline", corpus["base"])] + [
        (f"sys{i}", h) for i, h in enumerate(corpus["systems"])
    ]
    _, scores = PairedTest(named, {"BLEU": corpus["metric"]}, None, test_type="bs",
                           n_samples=N_RES)()
    return np.array([r.p_value for r in scores["BLEU"][1:]])


# --------------------------------------------------------------------------
# Corpus scores
# --------------------------------------------------------------------------


def test_bleu_from_stats_equals_sacrebleu_corpus_score(corpus: dict) -> None:
    hyps = [corpus["base"]] + corpus["systems"]
    stats = np.concatenate([corpus["base_stats"][None], corpus["sys_stats"]])
    ours = bleu_from_stats(stats.sum(axis=1), N_SENT)  # vectorised over systems
    theirs = np.array([BLEU().corpus_score(h, [corpus["refs"]]).score for h in hyps])
    assert ours.shape == (len(hyps),)
    assert 5 < theirs.min() and theirs.max() < 95  # a real spread, not degenerate
    # other: float64 BLEU, vectorised here and per system in sacrebleu (another order of operations)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("hyps", "refs"),
    [
        (["a b c d e f", "x y"], ["a b c q e f", "x y z"]),  # no 4-gram match in 2nd: smoothing
        (["a b x y", "c d"], ["a b c d", "c d e f"]),  # correct_3 = correct_4 = 0: 2**k smoothing
        (["p q r s"], ["a b c d"]),  # no match at all -> 0
        (["a b", "c"], ["a b c", "c d"]),  # no 3-grams in the hypotheses -> 0
        (["", "a b c d e"], ["a b c d e", "a b c d e"]),  # empty hypothesis
        (["a b c d e f g h"], ["a b c d"]),  # longer than reference, no brevity penalty
    ],
)
def test_bleu_from_stats_edge_cases_match_sacrebleu(hyps: list[str], refs: list[str]) -> None:
    metric = BLEU()
    stats = np.array(metric._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)
    expected = BLEU().corpus_score(hyps, [refs]).score
    # other: float64 BLEU against sacrebleu's, as above
    assert bleu_from_stats(stats.sum(axis=0)) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_chrf_from_stats_equals_sacrebleu_corpus_score(corpus: dict) -> None:
    hyps = [corpus["base"]] + corpus["systems"]
    metric = CHRF(references=[corpus["refs"]])
    stats = np.array([metric._extract_corpus_statistics(h, None) for h in hyps], dtype=np.float64)
    ours = chrf_from_stats(stats.sum(axis=1), N_SENT)  # vectorised over systems
    theirs = np.array([CHRF().corpus_score(h, [corpus["refs"]]).score for h in hyps])
    assert stats.shape == (len(hyps), N_SENT, 18) and 20 < theirs.min() and theirs.max() < 95
    # other: float64 chrF, vectorised here and per system in sacrebleu (another order of operations)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("hyps", "refs"),
    [
        (["abcdefg", "xy"], ["abcqefg", "xyz"]),  # partial matches
        (["ab", "c"], ["abcdefgh", "cd"]),  # hypotheses shorter than orders 3-6: effective order
        (["pqrs"], ["abcd"]),  # no match at all -> 0
        (["", "a b c d e"], ["a b c d e", "a b c d e"]),  # empty hypothesis
        (["abc"], [""]),  # empty reference
    ],
)
def test_chrf_from_stats_edge_cases_match_sacrebleu(hyps: list[str], refs: list[str]) -> None:
    stats = np.array(CHRF()._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)
    expected = CHRF().corpus_score(hyps, [refs]).score
    # other: float64 chrF against sacrebleu's, as above
    assert chrf_from_stats(stats.sum(axis=0)) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_accuracy_from_stats() -> None:
    correct = np.array([[1.0], [0.0], [1.0], [1.0]])
    # other: 3/4 in float64 (exactly representable; approx's default rel 1e-6)
    assert accuracy_from_stats(correct.sum(axis=0), 4) == pytest.approx(0.75)
    batched = np.array([[3.0], [1.0]])
    # other: exact quarters in float64 (assert_allclose's default rtol 1e-7)
    np.testing.assert_allclose(accuracy_from_stats(batched, 4), [0.75, 0.25])


# --------------------------------------------------------------------------
# Paired bootstrap against sacrebleu
# --------------------------------------------------------------------------


def test_resample_counts_are_sacrebleus_resamples(corpus: dict,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # sacrebleu's own bootstrap (used by corpus_score(n_bootstrap=...)) draws its
    # indices from SACREBLEU_SEED; its per-resample BLEU must equal ours on our counts.
    seed = 777
    monkeypatch.setenv("SACREBLEU_SEED", str(seed))
    stats_list = corpus["base_stats"].astype(int).tolist()
    _, sb_scores = _bootstrap_resample(stats_list, corpus["metric"], 200)
    counts = resample_counts(N_SENT, 200, seed)
    assert counts.shape == (200, N_SENT)
    assert (counts.sum(axis=1) == N_SENT).all()
    ours = bleu_from_stats(counts @ corpus["base_stats"])
    # other: float64 (ours) against sacrebleu's float32 precisions: rtol 1e-5 is about 80 float32 eps
    np.testing.assert_allclose(ours, [s.score for s in sb_scores], rtol=1e-5)
    assert np.ptp(ours) > 1.0  # resamples really differ


def test_resample_counts_blockwise_draw_is_the_one_shot_draw() -> None:
    # odd N and enough rows to need several blocks inside resample_counts
    n, r = 4099, 1200
    idx = np.random.default_rng(5).choice(n, size=(r, n), replace=True)
    expected = np.zeros((r, n), dtype=np.int64)
    np.add.at(expected, (np.repeat(np.arange(r), n), idx.ravel()), 1)
    np.testing.assert_array_equal(resample_counts(n, r, 5), expected)


def test_paired_bootstrap_matches_sacrebleu_same_seed(corpus: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seed = 12345  # sacrebleu's default
    sb = _sacrebleu_paired_bs(corpus, monkeypatch, seed)
    res = paired_bootstrap(corpus["base_stats"], corpus["sys_stats"], bleu_from_stats,
                           n_resamples=N_RES, seed=seed, identical_p_one=False)
    assert isinstance(res, TestResult)
    assert res.test == "paired_bootstrap" and res.n_resamples == N_RES and res.seed == seed
    # the systems span the range of p-values, so this checks more than "all 1/1001"
    assert sb.min() < 0.01 and sb.max() > 0.2 and len(np.unique(sb)) >= 6
    # same resamples: equal except where sacrebleu's float32 rounding flips a
    # near-tie, which can move a count by one
    diff = np.abs(res.p_value - sb)
    # other: at most one resample count apart (1/(N+1)), plus float64 rounding (1e-12)
    assert diff.max() <= 1.0 / (N_RES + 1) + 1e-12
    # other: equal p-values up to float64 rounding for all systems but one
    assert (diff < 1e-12).sum() >= len(sb) - 1


def test_identical_system_gets_p_one_by_default(corpus: dict,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    sb = _sacrebleu_paired_bs(corpus, monkeypatch, 12345)
    res = paired_bootstrap(corpus["base_stats"], corpus["sys_stats"], bleu_from_stats)
    # system 0 is the baseline's copy: sacrebleu says 1/(n+1), we say 1
    # other: sacrebleu's 1/(N+1), float64 (approx's default rel 1e-6)
    assert sb[0] == pytest.approx(1.0 / (N_RES + 1))
    assert res.p_value[0] == 1.0 and res.statistic[0] == 0.0
    assert res.ci_low[0] == 0.0 and res.ci_high[0] == 0.0
    # other: one resample count (1/(N+1)), plus float64 rounding, as above
    np.testing.assert_allclose(res.p_value[1:], sb[1:], atol=1.0 / (N_RES + 1) + 1e-12)


def test_paired_bootstrap_other_seed_within_monte_carlo_error(
    corpus: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = _sacrebleu_paired_bs(corpus, monkeypatch, 999)
    res = paired_bootstrap(corpus["base_stats"], corpus["sys_stats"], bleu_from_stats,
                           n_resamples=N_RES, seed=4242, identical_p_one=False)
    # Two independent 1000-resample estimates of the same bootstrap p: each has
    # binomial SE sqrt(p(1-p)/1000), their difference sqrt(2) times that. Allow
    # 5 SE (plus one count of discreteness): a false failure is ~1e-6 per system.
    p = (res.p_value + sb) / 2
    tol = 5 * np.sqrt(2 * p * (1 - p) / N_RES) + 1.0 / (N_RES + 1)
    assert (np.abs(res.p_value - sb) <= tol).all(), (res.p_value, sb, tol)
    assert not np.array_equal(res.p_value, sb)  # really different resamples


def test_paired_bootstrap_ci_matches_sacrebleu_resampled_deltas(
    corpus: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # delta CI from sacrebleu's own resampled scores of baseline and one system
    seed = 31
    monkeypatch.setenv("SACREBLEU_SEED", str(seed))
    metric = corpus["metric"]
    _, bl = _bootstrap_resample(corpus["base_stats"].astype(int).tolist(), metric, N_RES)
    _, sy = _bootstrap_resample(corpus["sys_stats"][4].astype(int).tolist(), metric, N_RES)
    deltas = np.sort(np.array([s.score for s in sy]) - np.array([b.score for b in bl]))
    res = paired_bootstrap(corpus["base_stats"], corpus["sys_stats"][4], bleu_from_stats,
                           n_resamples=N_RES, seed=seed)
    assert res.ci_low.shape == (1,)
    # other: sacrebleu rounds its resampled precisions to float32; 1e-4 BLEU points covers that on scores <= 100
    assert res.ci_low[0] == pytest.approx(deltas[N_RES // 40], abs=1e-4)
    assert res.ci_high[0] == pytest.approx(deltas[N_RES - N_RES // 40 - 1], abs=1e-4)
    observed = (BLEU().corpus_score(corpus["systems"][4], [corpus["refs"]]).score
                - BLEU().corpus_score(corpus["base"], [corpus["refs"]]).score)
    # other: float64 BLEU difference against sacrebleu's two float64 scores
    assert res.statistic[0] == pytest.approx(observed, abs=1e-10)
    assert res.ci_low[0] < observed < res.ci_high[0]


def test_paired_bootstrap_accuracy_against_explicit_index_loop() -> None:
    # independent route: resample with explicit indices, one system at a time
    rng = np.random.default_rng(3)
    n, s = 120, 4
    base = (rng.random(n) < 0.7).astype(float)
    flips = rng.random((s, n)) < np.array([0.0, 0.05, 0.15, 0.4])[:, None]
    systems = np.where(flips, 1 - base, base)
    res = paired_bootstrap(base[:, None], systems[:, :, None], accuracy_from_stats,
                           n_resamples=500, seed=8)
    idx = np.random.default_rng(8).choice(n, size=(500, n), replace=True)
    for i in range(s):
        d = systems[i][idx].mean(axis=1) - base[idx].mean(axis=1)
        obs = systems[i].mean() - base.mean()
        a = np.abs(d)
        p = ((a - a.mean() > abs(obs)).sum() + 1) / 501
        expected = 1.0 if i == 0 else p
        # other: the same float64 resamples computed another way (explicit indices); rounding only
        assert res.p_value[i] == pytest.approx(expected, abs=1e-12)
        assert res.statistic[i] == pytest.approx(obs, abs=1e-12)
        assert res.ci_low[i] == pytest.approx(np.sort(d)[12], abs=1e-12)
        assert res.ci_high[i] == pytest.approx(np.sort(d)[487], abs=1e-12)


def test_paired_bootstrap_seeded_reproducible_and_chunking_invariant(corpus: dict) -> None:
    args = (corpus["base_stats"], corpus["sys_stats"], bleu_from_stats)
    a = paired_bootstrap(*args, n_resamples=400, seed=11)
    b = paired_bootstrap(*args, n_resamples=400, seed=11)
    c = paired_bootstrap(*args, n_resamples=400, seed=12)
    for f in ("statistic", "p_value", "ci_low", "ci_high"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(resample_counts(N_SENT, 400, 11), resample_counts(N_SENT, 400, 12))
    assert not (np.array_equal(a.p_value, c.p_value) and np.array_equal(a.ci_low, c.ci_low))
    # tiny memory budget: one system and a few resamples per block, same answer
    d = paired_bootstrap(*args, n_resamples=400, seed=11, max_bytes=20_000)
    # exact: p-values count resamples, whatever the block size; the CI below is a float64 quantile of sums taken in
    # other blocks (summation order, float64: rtol 1e-12)
    np.testing.assert_allclose(d.p_value, a.p_value, rtol=0, atol=0)
    np.testing.assert_allclose(d.ci_low, a.ci_low, rtol=1e-12)
    # explicit counts reproduce the seeded draw
    e = paired_bootstrap(*args, counts=resample_counts(N_SENT, 400, 11), seed=11)
    np.testing.assert_array_equal(e.p_value, a.p_value)
    assert e.n_resamples == 400


def test_paired_bootstrap_unseeded_records_its_seed(corpus: dict) -> None:
    args = (corpus["base_stats"], corpus["sys_stats"][:3], bleu_from_stats)
    a = paired_bootstrap(*args, n_resamples=200, seed=None)
    assert isinstance(a.seed, int)
    b = paired_bootstrap(*args, n_resamples=200, seed=a.seed)
    np.testing.assert_array_equal(a.p_value, b.p_value)


# --------------------------------------------------------------------------
# t-test and McNemar
# --------------------------------------------------------------------------


def test_paired_ttest_equals_scipy() -> None:
    rng = np.random.default_rng(0)
    n = 200
    base = (rng.random(n) < 0.6).astype(float)
    systems = np.array([np.where(rng.random(n) < q, 1 - base, base)
                        for q in (0.02, 0.1, 0.3)])
    systems[2] = rng.normal(size=n)  # any per-example value, not only 0/1
    res = paired_ttest(base, systems)
    assert res.test == "paired_ttest" and res.n_resamples == 0 and res.seed is None
    for i in range(len(systems)):
        ref = sps.ttest_rel(systems[i], base)
        ci = ref.confidence_interval(0.95)
        # other: float64 t-test against scipy's (another formula order); rel 1e-10
        assert res.statistic[i] == pytest.approx(ref.statistic, rel=1e-10)
        assert res.p_value[i] == pytest.approx(ref.pvalue, rel=1e-10)
        assert res.ci_low[i] == pytest.approx(ci.low, rel=1e-10)
        assert res.ci_high[i] == pytest.approx(ci.high, rel=1e-10)


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
def test_paired_ttest_zero_variance() -> None:
    base = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    systems = np.array([base, base + 1.0, base - 0.5])
    res = paired_ttest(base, systems)
    # identical: scipy gives NaN; we define t = 0, p = 1
    assert np.isnan(sps.ttest_rel(systems[0], base).pvalue)
    assert res.statistic[0] == 0.0 and res.p_value[0] == 1.0
    assert res.ci_low[0] == 0.0 and res.ci_high[0] == 0.0
    # constant non-zero difference: scipy's inf / 0
    ref = sps.ttest_rel(systems[1], base)
    assert res.statistic[1] == ref.statistic == np.inf and res.p_value[1] == ref.pvalue == 0.0
    assert res.statistic[2] == -np.inf and res.p_value[2] == 0.0
    assert res.ci_low[2] == res.ci_high[2] == -0.5


def test_paired_ttest_hand_computed() -> None:
    # d = [1, 0, 0, 1, -1]: mean 0.2, sample var 0.7, t = 0.2 / sqrt(0.7 / 5)
    base = np.array([0.0, 1.0, 0.0, 0.0, 1.0])
    sys_ = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    res = paired_ttest(base, sys_)
    t = 0.2 / math.sqrt(0.7 / 5)
    # other: float64 against a closed form computed here; rel 1e-12
    assert res.statistic[0] == pytest.approx(t, rel=1e-12)
    # Student t CDF with 4 df in closed form:
    # F(t) = 1/2 + (3/8) (t / sqrt(a)) (1 - t^2 / (12 a)), a = 1 + t^2 / 4
    a = 1 + t * t / 4
    cdf = 0.5 + 3 / 8 * t / math.sqrt(a) * (1 - t * t / (12 * a))
    # other: float64 against the closed-form CDF and its value; rel 1e-12
    assert res.p_value[0] == pytest.approx(2 * (1 - cdf), rel=1e-12)
    assert res.p_value[0] == pytest.approx(0.6213082950374971, rel=1e-12)


def test_mcnemar_exact_hand_checked_table() -> None:
    # 2x2 table: both right 5, baseline only 1 (b), system only 7 (c), both wrong 3
    base = np.array([1] * 5 + [1] * 1 + [0] * 7 + [0] * 3)
    sys_ = np.array([1] * 5 + [0] * 1 + [1] * 7 + [0] * 3)
    res = mcnemar_exact(base, sys_)
    # two-sided: 2 * P[X <= 1], X ~ Bin(8, 1/2) = 2 * (C(8,0) + C(8,1)) / 2^8 = 18/256
    expected = 2 * (math.comb(8, 0) + math.comb(8, 1)) / 2**8
    # other: float64 against the exact binomial sum; rel 1e-12
    assert res.p_value[0] == pytest.approx(expected, rel=1e-12)
    assert res.p_value[0] == pytest.approx(0.0703125, rel=1e-12)
    assert res.statistic[0] == 1.0
    assert np.isnan(res.ci_low[0]) and np.isnan(res.ci_high[0])
    assert res.test == "mcnemar_exact" and res.n_resamples == 0


def test_mcnemar_exact_against_binomtest_and_degenerate_cases() -> None:
    rng = np.random.default_rng(1)
    n = 150
    base = rng.random(n) < 0.5
    systems = np.array([base, ~base, np.where(rng.random(n) < 0.1, ~base, base),
                        np.where(rng.random(n) < 0.3, ~base, base)])
    res = mcnemar_exact(base, systems)
    assert res.p_value[0] == 1.0 and res.statistic[0] == 0.0  # no discordant pairs
    for i in range(1, len(systems)):
        b = int((base & ~systems[i]).sum())
        c = int((~base & systems[i]).sum())
        # other: float64 against scipy's binomtest; rel 1e-10
        assert res.p_value[i] == pytest.approx(sps.binomtest(c, b + c, 0.5).pvalue, rel=1e-10)
        assert res.statistic[i] == min(b, c)
    # balanced discordance gives p = 1 (capped), as binomtest
    assert mcnemar_exact(np.array([1, 0]), np.array([0, 1])).p_value[0] == 1.0


# --------------------------------------------------------------------------
# Multiple comparisons
# --------------------------------------------------------------------------


def test_bh_equals_scipy() -> None:
    rng = np.random.default_rng(4)
    p = np.concatenate([rng.uniform(0, 0.01, 30), rng.uniform(0, 1, 258)])
    p[[3, 7]] = p[5]  # ties
    # other: float64 Benjamini-Hochberg against scipy's; rtol 1e-12
    np.testing.assert_allclose(adjust_pvalues(p, "bh"),
                               sps.false_discovery_control(p, method="bh"), rtol=1e-12)


def test_nan_safe_adjustment() -> None:
    p = np.array([0.01, np.nan, 0.04, 0.03, np.nan, 0.5])
    ok = ~np.isnan(p)
    for method in ("bh", "holm", "bonferroni", "none"):
        adj = adjust_pvalues(p, method)
        assert np.isnan(adj[~ok]).all()
        assert not np.isnan(adj[ok]).any()
    # other: float64 against scipy (rtol 1e-12) and hand-computed products (assert_allclose's default rtol 1e-7)
    np.testing.assert_allclose(adjust_pvalues(p, "bh")[ok],
                               sps.false_discovery_control(p[ok], method="bh"), rtol=1e-12)
    np.testing.assert_allclose(adjust_pvalues(p, "bonferroni")[ok], [0.04, 0.16, 0.12, 1.0])
    np.testing.assert_array_equal(adjust_pvalues(p, "none")[ok], p[ok])


def test_holm_hand_computed() -> None:
    # m = 4, sorted p: 0.01, 0.02, 0.03, 0.5
    # raw steps: 4*0.01=0.04, 3*0.02=0.06, 2*0.03=0.06, 1*0.5=0.5 -> running max -> same
    p = np.array([0.03, 0.5, 0.01, 0.02])
    # other: float64 products of decimal p-values against decimals (assert_allclose's default rtol 1e-7)
    np.testing.assert_allclose(adjust_pvalues(p, "holm"), [0.06, 0.5, 0.04, 0.06])
    # monotonicity: 4*0.01=0.04, 3*0.011=0.033 -> raised to 0.04; capping: 2*0.6 -> 1
    p2 = np.array([0.01, 0.011, 0.6, 0.7])
    np.testing.assert_allclose(adjust_pvalues(p2, "holm"), [0.04, 0.04, 1.0, 1.0])


def test_adjust_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        adjust_pvalues(np.array([0.1]), "fdr")
    with pytest.raises(ValueError):
        adjust_pvalues(np.array([1.5]), "bh")


def test_significance_rows() -> None:
    res = TestResult("paired_ttest", np.array([2.0, 0.1]), np.array([0.004, 0.6]),
                     np.array([0.1, -0.2]), np.array([0.3, 0.4]), 0, None)
    rows = significance_rows(res, ["e1", "e2"], correction="holm", alpha=0.01)
    assert [r["eval_id"] for r in rows] == ["e1", "e2"]
    # other: a float64 product against a decimal (approx's default rel 1e-6)
    assert rows[0]["p_adjusted"] == pytest.approx(0.008)  # 2 * 0.004
    assert rows[0]["significant"] is True and rows[1]["significant"] is False
    assert set(rows[0]) == {"eval_id", "test", "statistic", "p_value", "p_adjusted",
                            "correction", "ci_low", "ci_high", "significant",
                            "n_resamples", "seed"}
    assert rows[1]["correction"] == "holm" and rows[1]["seed"] is None
