"""Pairwise head interactions: is removing two heads worse (or better) than the sum of removing each?

For heads i and j, with corpus scores S_b (baseline), S_i, S_j (each head masked alone) and S_ij
(both masked), all on the same examples,

    interaction = delta(i,j) - delta(i) - delta(j) = (S_ij - S_b) - (S_i - S_b) - (S_j - S_b),

in the metric's own units (deltas are score - baseline, as everywhere in headsweep). Zero means the
effects add up. Its meaning depends on the metric's direction (``Metric.higher_is_better``): where
higher is better (accuracy, BLEU) a negative interaction means the pair hurts more than the sum of
its parts (the heads back each other up: each covers for the other when it is removed alone), a
positive one that it hurts less (the heads do overlapping harm); where lower is better (perplexity)
the signs swap. ``excess_harm`` (``-sign * interaction``) reads the same for every metric: positive
when the pair hurts more than the sum.

The test is a paired bootstrap over the per-example sufficient statistics of the four evaluations,
resampled *together*: every resample draws one set of example indices and scores all four
evaluations on it (corpus score from the summed resampled statistics, exactly as
``headsweep.sweep.statistics.significance.paired_bootstrap`` does; same ``resample_counts`` for the same seed),
so the interaction of resample r is computed from four scores of the same pseudo-corpus. The
p-value and CI follow ``paired_bootstrap``'s conventions (sacrebleu's): two-sided on centred
absolute values, ``p = (#{r : |I_r| - mean|I_r| > |I|} + 1) / (R + 1)``, percentile interval with
sacrebleu's order statistics. Interactions that are zero in every resample (e.g. per-example
additive accuracy effects) get p = 1, as identical systems do in ``paired_bootstrap``.

Everything here is a pure function of arrays; the ``pairs`` experiment kind feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from headsweep.sweep.statistics.significance import CorpusScore, _ci_indices, resample_counts

__all__ = ["InteractionResult", "interaction_bootstrap", "resampled_scores"]

# Temporaries per block of resamples (the (R, N) count block and the summed statistics).
_MAX_BYTES = 128 * 2**20
# Interactions smaller than this many float64 ulps of the largest score are rounding, not effects:
# S_ij - S_i - S_j + S_b of effects that add up exactly (k/N accuracies) can come out as 1e-17.
_ROUNDING_ULPS = 64


@dataclass(frozen=True)
class InteractionResult:
    """Interactions of P pairs; arrays of shape (P,).

    ``delta_i``, ``delta_j``, ``delta_ij``: observed deltas (score - baseline) of head i alone, head j
    alone and both; ``interaction`` = delta_ij - delta_i - delta_j; ``ci_low``/``ci_high``: percentile
    interval of the resampled interactions; ``p_value``: two-sided bootstrap p-value (unadjusted).
    """

    delta_i: np.ndarray
    delta_j: np.ndarray
    delta_ij: np.ndarray
    interaction: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    p_value: np.ndarray
    n_resamples: int
    seed: int | None

    def __len__(self) -> int:
        return int(self.interaction.shape[0])


def resampled_scores(stats: np.ndarray, corpus_score: CorpusScore, counts: np.ndarray,
                     max_bytes: int = _MAX_BYTES) -> np.ndarray:
    """Corpus scores of E evaluations on R resamples: (R, E).

    ``stats``: (E, N, k) per-example statistics; ``counts``: (R, N) multiplicities (``resample_counts``).
    Resample r of evaluation e is scored from ``counts[r] @ stats[e]``, the statistics summed over
    the drawn examples, as ``paired_bootstrap`` scores its resamples.
    """
    stats = np.asarray(stats, dtype=np.float64)
    n_eval, n_ex, k = stats.shape
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] != n_ex:
        raise ValueError(f"counts must be (n_resamples, {n_ex}); got {counts.shape}")
    n_res = counts.shape[0]
    flat = np.ascontiguousarray(stats.transpose(1, 0, 2)).reshape(n_ex, n_eval * k)
    block = max(1, min(n_res, max_bytes // max(1, 8 * (n_ex + n_eval * k))))
    out = np.empty((n_res, n_eval), dtype=np.float64)
    for r0 in range(0, n_res, block):
        r1 = min(n_res, r0 + block)
        sums = (counts[r0:r1].astype(np.float64) @ flat).reshape(r1 - r0, n_eval, k)
        out[r0:r1] = corpus_score(sums, n_ex)
    return out


def _interactions(scores: np.ndarray, base: int, i: np.ndarray, j: np.ndarray, ij: np.ndarray) -> np.ndarray:
    """delta_ij - delta_i - delta_j along the last axis of ``scores`` (columns are evaluations)."""
    b = scores[..., [base]]
    return (scores[..., ij] - b) - (scores[..., i] - b) - (scores[..., j] - b)


def interaction_bootstrap(
    baseline_stats: np.ndarray,
    single_stats: np.ndarray,
    pair_stats: np.ndarray,
    index_i: np.ndarray,
    index_j: np.ndarray,
    corpus_score: CorpusScore,
    n_resamples: int = 1000,
    seed: int | None = 12345,
    counts: np.ndarray | None = None,
    confidence: float = 0.95,
) -> InteractionResult:
    """Interaction of each pair with a paired bootstrap CI and p-value.

    ``baseline_stats``: (N, k); ``single_stats``: (H, N, k), one evaluation per head masked alone;
    ``pair_stats``: (P, N, k), pair p masks heads ``index_i[p]`` and ``index_j[p]`` (rows of
    ``single_stats``). All four evaluations of a pair are scored on the same resamples (``counts``,
    or ``resample_counts(N, n_resamples, seed)``, the draws ``paired_bootstrap`` makes for that seed).
    """
    base = np.asarray(baseline_stats, dtype=np.float64)
    singles = np.asarray(single_stats, dtype=np.float64)
    pairs = np.asarray(pair_stats, dtype=np.float64)
    if singles.ndim == 2:
        singles = singles[None]
    if pairs.ndim == 2:
        pairs = pairs[None]
    if base.ndim != 2 or singles.shape[1:] != base.shape or pairs.shape[1:] != base.shape:
        raise ValueError(f"need baseline (N, k), singles (H, N, k) and pairs (P, N, k); got {base.shape}, "
                         f"{singles.shape} and {pairs.shape}")
    index_i = np.asarray(index_i, dtype=np.int64)
    index_j = np.asarray(index_j, dtype=np.int64)
    n_single, n_pair = singles.shape[0], pairs.shape[0]
    if index_i.shape != (n_pair,) or index_j.shape != (n_pair,):
        raise ValueError(f"index_i and index_j need one entry per pair ({n_pair})")
    if n_pair and (min(index_i.min(), index_j.min()) < 0 or max(index_i.max(), index_j.max()) >= n_single):
        raise ValueError(f"pair indices must name rows of single_stats (0..{n_single - 1})")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    n_ex = base.shape[0]
    if counts is None:
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % 2**63)  # recorded, so the run can be reproduced
        counts = resample_counts(n_ex, n_resamples, seed)
    counts = np.asarray(counts)
    n_res = counts.shape[0] if counts.ndim == 2 else 0

    # Columns: baseline, the singles, the pairs; each distinct evaluation is scored once per resample.
    every = np.concatenate([base[None], singles, pairs])
    col_i, col_j, col_ij = 1 + index_i, 1 + index_j, 1 + n_single + np.arange(n_pair)
    observed_scores = np.asarray(corpus_score(every.sum(axis=1), n_ex), dtype=np.float64)
    boot_scores = resampled_scores(every, corpus_score, counts)

    delta = observed_scores - observed_scores[0]
    observed = _interactions(observed_scores, 0, col_i, col_j, col_ij)
    boot = _interactions(boot_scores, 0, col_i, col_j, col_ij)
    # Rounding of four scores of size M leaves a few ulps of M; below that an interaction is exactly zero.
    scale = max(float(np.abs(observed_scores).max(initial=0.0)), float(np.abs(boot_scores).max(initial=0.0)))
    tiny = _ROUNDING_ULPS * np.finfo(np.float64).eps * scale
    observed = np.where(np.abs(observed) <= tiny, 0.0, observed)
    boot = np.where(np.abs(boot) <= tiny, 0.0, boot)

    abs_b = np.abs(boot)
    centred = abs_b - abs_b.mean(axis=0)
    exceed = (centred > np.abs(observed)).sum(axis=0)
    p = (exceed + 1.0) / (n_res + 1.0)
    none_anywhere = (boot == 0).all(axis=0) & (observed == 0)
    p = np.where(none_anywhere, 1.0, p)

    lo, hi = _ci_indices(n_res, confidence)
    ordered = np.sort(boot, axis=0)
    return InteractionResult(
        delta_i=delta[col_i], delta_j=delta[col_j], delta_ij=delta[col_ij], interaction=observed,
        ci_low=ordered[lo].copy(), ci_high=ordered[hi].copy(), p_value=p, n_resamples=int(n_res), seed=seed,
    )
