"""Metrics as per-example sufficient statistics plus a corpus score from their sum.

This is sacrebleu's design: a corpus score is a function of statistics summed over examples,
so any resample of the examples (bootstrap) is scored from a weighted sum of the same rows
without re-running the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def accuracy_from_stats(stats_sum: np.ndarray, n: int) -> np.ndarray:
    """Accuracy (fraction in [0, 1]) from summed ``[correct]`` statistics of ``n`` examples."""
    return np.asarray(stats_sum, dtype=np.float64)[..., 0] / n


def first_stat(stats: np.ndarray) -> np.ndarray:
    """Per-example values for tests on them: the first statistic (accuracy: correct or not)."""
    return np.asarray(stats, dtype=np.float64)[..., 0]


def second_stat(stats: np.ndarray) -> np.ndarray:
    """Per-example values from the second statistic (multiple choice: correct by the length-normalised rule)."""
    return np.asarray(stats, dtype=np.float64)[..., 1]


def accuracy_norm_from_stats(stats_sum: np.ndarray, n: int) -> np.ndarray:
    """Length-normalised multiple-choice accuracy from summed ``[correct, correct_norm]`` of ``n`` questions."""
    return np.asarray(stats_sum, dtype=np.float64)[..., 1] / n


@dataclass(frozen=True)
class Metric:
    """A corpus metric: the names of its per-example statistics and its corpus score.

    ``higher_is_better`` is the metric's direction (perplexity: lower is better): what "a head whose
    removal hurts" means, how heads are ranked by harm, which kept head is best. ``example_values``
    turns per-example statistics (..., n_stats) into one value per example (...) for tests on
    per-example values (the paired t-test). ``binary``: those values are 0/1 outcomes (right or
    wrong), which McNemar's exact test needs.
    """

    name: str
    stat_names: tuple[str, ...]
    score_from_stats: Callable[[np.ndarray, int], np.ndarray]
    higher_is_better: bool = True
    example_values: Callable[[np.ndarray], np.ndarray] = first_stat
    binary: bool = False

    def score(self, stats: np.ndarray) -> float:
        """Corpus score of per-example statistics of shape (n_examples, n_stats)."""
        stats = np.asarray(stats, dtype=np.float64)
        return float(self.score_from_stats(stats.sum(axis=0), len(stats)))

    @property
    def sign(self) -> int:
        """+1 when higher is better, -1 when lower is: ``sign * delta < 0`` means the masked heads were needed."""
        return 1 if self.higher_is_better else -1

    def harm(self, delta: float) -> float:
        """How much worse a score is than the baseline (``delta`` = score - baseline; positive = worse)."""
        return -self.sign * delta


ACCURACY = Metric("accuracy", ("correct",), accuracy_from_stats, binary=True)

# Multiple choice (causal LMs, lm-evaluation-harness's acc and acc_norm): every question carries both outcomes,
# ``[correct, correct_norm]``, whichever one the run reports. ``accuracy`` reads column 0 as ACCURACY does, so
# the registered ACCURACY serves runs of either (significance and the views look metrics up by name).
MC_STAT_NAMES = ("correct", "correct_norm")
MC_ACCURACY = Metric("accuracy", MC_STAT_NAMES, accuracy_from_stats, binary=True)
MC_ACCURACY_NORM = Metric("accuracy_norm", MC_STAT_NAMES, accuracy_norm_from_stats, example_values=second_stat,
                          binary=True)


BLEU_STAT_NAMES = (
    "hyp_len", "ref_len",
    "correct_1", "correct_2", "correct_3", "correct_4",
    "total_1", "total_2", "total_3", "total_4",
)
# sacrebleu's my_log: log(0) is floored to this, which sends the score to exactly 0.
_LOG_ZERO = -9999999999.0


def bleu_from_stats(stats_sum: np.ndarray, n: int | None = None, effective_order: bool = False) -> np.ndarray:
    """Corpus BLEU (0-100) from summed sentence statistics, as ``sacrebleu.BLEU.compute_bleu``.

    ``stats_sum`` has shape (..., 10) in sacrebleu's order (hyp_len, ref_len, correct_1..4,
    total_1..4); every leading index is one corpus (e.g. one bootstrap resample). Smoothing is
    sacrebleu's default 'exp' (NIST: the k-th order with no match counts as
    1 / (2^k * total)); ``effective_order`` as in sacrebleu (off for corpus BLEU). ``n`` (the
    number of sentences) is not needed and only kept for the ``Metric`` signature.
    """
    s = np.asarray(stats_sum, dtype=np.float64)
    sys_len, ref_len = s[..., 0], s[..., 1]
    correct, total = s[..., 2:6], s[..., 6:10]
    with np.errstate(divide="ignore", invalid="ignore"):
        bp = np.where(sys_len < ref_len, np.where(sys_len > 0, np.exp(1.0 - ref_len / sys_len), 0.0), 1.0)
        # sacrebleu stops at the first order with no n-grams at all; later orders keep precision 0.
        reached = np.cumprod(total > 0, axis=-1).astype(bool)
        missing = (correct == 0) & reached
        halvings = np.cumsum(missing, axis=-1)
        precision = np.where(missing, 100.0 / (2.0**halvings * total), 100.0 * correct / total)
        precision = np.where(reached, precision, 0.0)
        log_p = np.where(precision > 0, np.log(np.where(precision > 0, precision, 1.0)), _LOG_ZERO)
    if effective_order:
        order = np.maximum(reached.sum(axis=-1), 1)
        kept = np.arange(4) < order[..., None]
        mean_log = np.where(kept, log_p, 0.0).sum(axis=-1) / order
    else:
        mean_log = log_p.sum(axis=-1) / 4.0
    score = bp * np.exp(mean_log)
    return np.where((correct > 0).any(axis=-1), score, 0.0)


BLEU = Metric("bleu", BLEU_STAT_NAMES, bleu_from_stats)


# chrF (Popovic 2015) as sacrebleu 2.x's CHRF computes it by default: character n-grams of orders 1-6 (no word
# n-grams), beta 2, effective-order averaging of the precisions and recalls (eps_smoothing off). Per sentence and order
# n: [hyp_n, ref_n, match_n] (hypothesis n-grams, reference n-grams, matches), sacrebleu's order.
CHRF_CHAR_ORDER = 6
CHRF_BETA = 2
CHRF_STAT_NAMES = tuple(f"{kind}_{n}" for n in range(1, CHRF_CHAR_ORDER + 1) for kind in ("hyp", "ref", "match"))
# sacrebleu's epsilon for an order without n-grams (only its eps_smoothing variant, not ours, keeps it in the score).
_CHRF_EPS = 1e-16


def chrf_from_stats(stats_sum: np.ndarray, n: int | None = None) -> np.ndarray:
    """Corpus chrF (0-100) from summed sentence statistics, as ``sacrebleu.CHRF`` (defaults) computes it.

    ``stats_sum`` has shape (..., 18): per character order 1..6 ``[hyp, ref, match]``; every leading index is one
    corpus (e.g. one bootstrap resample). Precision and recall are averaged over the orders where both hypothesis and
    reference have n-grams (sacrebleu's effective order), then combined as F-beta with beta 2. ``n`` (the number of
    sentences) is not needed and only kept for the ``Metric`` signature.
    """
    s = np.asarray(stats_sum, dtype=np.float64)
    hyp, ref, match = s[..., 0::3], s[..., 1::3], s[..., 2::3]
    counted = (hyp > 0) & (ref > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(hyp > 0, match / np.where(hyp > 0, hyp, 1.0), _CHRF_EPS)
        recall = np.where(ref > 0, match / np.where(ref > 0, ref, 1.0), _CHRF_EPS)
        orders = counted.sum(axis=-1)
        # sacrebleu adds the orders one at a time; summing in order 1..6 keeps its rounding
        avg_p = np.where(orders > 0, np.where(counted, precision, 0.0).sum(axis=-1) / np.maximum(orders, 1), 0.0)
        avg_r = np.where(orders > 0, np.where(counted, recall, 0.0).sum(axis=-1) / np.maximum(orders, 1), 0.0)
        factor = CHRF_BETA**2
        score = 100 * (1 + factor) * avg_p * avg_r / (factor * avg_p + avg_r)
    return np.where(avg_p + avg_r > 0, score, 0.0)


CHRF = Metric("chrf", CHRF_STAT_NAMES, chrf_from_stats)


PERPLEXITY_STAT_NAMES = ("nll_sum", "n_tokens")


def perplexity_from_stats(stats_sum: np.ndarray, n: int | None = None) -> np.ndarray:
    """Corpus perplexity ``exp(sum nll / sum tokens)`` from summed per-window ``[nll_sum, n_tokens]``
    (natural log; every leading index is one corpus, e.g. one bootstrap resample). ``n`` (the number
    of windows) is not needed and only kept for the ``Metric`` signature."""
    s = np.asarray(stats_sum, dtype=np.float64)
    return np.exp(s[..., 0] / s[..., 1])


def mean_nll(stats: np.ndarray) -> np.ndarray:
    """Per-window mean negative log-likelihood in nats (``nll_sum / n_tokens``): the paired t-test's values."""
    s = np.asarray(stats, dtype=np.float64)
    return s[..., 0] / s[..., 1]


PERPLEXITY = Metric("perplexity", PERPLEXITY_STAT_NAMES, perplexity_from_stats, higher_is_better=False,
                    example_values=mean_nll)

def mean_logit_diff(stats_sum: np.ndarray, n: int) -> np.ndarray:
    """The mean logit difference (answer minus wrong answer, at the last position) from summed per-pair
    ``[logit_diff]`` of ``n`` pairs (every leading index is one corpus, e.g. one bootstrap resample)."""
    return np.asarray(stats_sum, dtype=np.float64)[..., 0] / n


# Paired prompts (activation patching, hf_causal_lm data.task: paired): per pair the logit of the answer token minus
# that of the wrong answer at the last position, a sufficient statistic of its own; the corpus score is their mean,
# so the bootstrap rescores resamples from the rows and the t-test reads the per-pair values.
LOGIT_DIFF = Metric("logit_diff", ("logit_diff",), mean_logit_diff)

# lm-evaluation-harness tasks (hf_causal_lm data.task: lm_eval), each document's statistics as the task's own
# process_results gives them. Multiple choice stores [correct, correct_norm] (MC_STAT_NAMES, read by ``accuracy`` and
# ``accuracy_norm``). Loglikelihood tasks store [correct (is_greedy), loglikelihood]: ``accuracy`` reads column 0 and
# lm-eval's ``perplexity``, exp(-mean loglikelihood over documents), column 1. Rolling tasks store [loglikelihood,
# words, bytes]: lm-eval's weighted_perplexity and bits_per_byte aggregations are functions of their sums.
LOGLIKELIHOOD_STAT_NAMES = ("correct", "loglikelihood")
ROLLING_STAT_NAMES = ("loglikelihood", "words", "bytes")


def _nll_per(i: int) -> Callable[[np.ndarray], np.ndarray]:
    """Per-document negative log-likelihood per unit (column ``i``: words or bytes): the t-test's values."""
    return lambda stats: -np.asarray(stats, dtype=np.float64)[..., 0] / np.asarray(stats, dtype=np.float64)[..., i]


LOGLIKELIHOOD_PERPLEXITY = Metric(
    "loglikelihood_perplexity", LOGLIKELIHOOD_STAT_NAMES,
    lambda s, n: np.exp(-np.asarray(s, dtype=np.float64)[..., 1] / n), higher_is_better=False,
    example_values=lambda stats: -np.asarray(stats, dtype=np.float64)[..., 1])
WORD_PERPLEXITY = Metric("word_perplexity", ROLLING_STAT_NAMES,
                         lambda s, n: np.exp(-np.asarray(s, dtype=np.float64)[..., 0] / np.asarray(s)[..., 1]),
                         higher_is_better=False, example_values=_nll_per(1))
BYTE_PERPLEXITY = Metric("byte_perplexity", ROLLING_STAT_NAMES,
                         lambda s, n: np.exp(-np.asarray(s, dtype=np.float64)[..., 0] / np.asarray(s)[..., 2]),
                         higher_is_better=False, example_values=_nll_per(2))
BITS_PER_BYTE = Metric("bits_per_byte", ROLLING_STAT_NAMES,
                       lambda s, n: -np.asarray(s, dtype=np.float64)[..., 0] / np.asarray(s)[..., 2] / np.log(2.0),
                       higher_is_better=False, example_values=_nll_per(2))
LM_EVAL_METRICS = (LOGLIKELIHOOD_PERPLEXITY, WORD_PERPLEXITY, BYTE_PERPLEXITY, BITS_PER_BYTE)

METRICS = {m.name: m for m in (ACCURACY, MC_ACCURACY_NORM, BLEU, CHRF, PERPLEXITY, LOGIT_DIFF, *LM_EVAL_METRICS)}

#: Names of the metrics for which a lower score is better (the SQL views are generated from it).
LOWER_IS_BETTER = tuple(m.name for m in METRICS.values() if not m.higher_is_better)


def higher_is_better(metric: str | None) -> bool:
    """The direction of the metric a run recorded by name; one headsweep does not know counts as higher-better."""
    known = METRICS.get(metric or "")
    return True if known is None else known.higher_is_better


def metric_by_name(name: str) -> Metric:
    """The metric a run recorded by name (``runs.metric``)."""
    return METRICS[name]
