"""Benchmark: sacrebleu's paired bootstrap vs headsweep.sweep.statistics.significance.paired_bootstrap.

A head-ablation grid of a 6+6-layer, 16-head translation model has 288 ablated
systems, each tested against the baseline with a 1000-resample paired bootstrap
on the test set. This times both routes on such a grid (1000 sentences,
288 perturbed copies of a baseline hypothesis set) and checks that their
p-values agree (same seed, hence the same resamples).

Run: ``python -m bench.significance`` (``--smoke``: 30 sentences, 6 systems, 100 resamples). The last line is
``RESULT significance ratio=<sacrebleu_seconds/our_seconds> max_abs_p_diff=<x>``.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import numpy as np
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from bench import common
from headsweep.sweep.statistics.significance import bleu_from_stats, paired_bootstrap

N_SENT = 1000
N_SYSTEMS = 288
N_IDENTICAL = 2  # heads whose removal changes no output at all
N_RES = 1000
SEED = 12345  # sacrebleu's default SACREBLEU_SEED
SACREBLEU_BUDGET_S = 300.0
REFS = common.DATA / "multi30k" / "test_2016_flickr.fr.gz"


@common.on_smoke
def use_smoke() -> None:
    """30 sentences, 6 systems (one identical to the baseline), 100 resamples."""
    global N_SENT, N_SYSTEMS, N_IDENTICAL, N_RES
    N_SENT, N_SYSTEMS, N_IDENTICAL, N_RES = 30, 6, 1, 100


def _references(rng: random.Random) -> tuple[list[str], str]:
    if REFS.exists():
        lines = common.read_gz(REFS)[:N_SENT]
        if len(lines) == N_SENT:
            return lines, str(REFS)
    vocab = [f"w{i}" for i in range(2000)]
    gen = [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 30))) for _ in range(N_SENT)]
    return gen, "generated sentences"


def _perturb(sentence: str, rate: float, vocab: list[str], rng: random.Random) -> str:
    out = []
    for w in sentence.split():
        x = rng.random()
        if x < rate / 3:
            continue
        if x < 2 * rate / 3:
            out.append(rng.choice(vocab))
        elif x < rate:
            out.extend([w, rng.choice(vocab)])
        else:
            out.append(w)
    return " ".join(out)


def _systems(refs: list[str], rng: random.Random) -> tuple[list[str], list[list[str]]]:
    vocab = sorted({w for r in refs for w in r.split()})
    base = [_perturb(r, 0.3, vocab, rng) for r in refs]
    systems = [list(base) for _ in range(N_IDENTICAL)]
    while len(systems) < N_SYSTEMS:
        # most heads matter little, a few a lot: degrade a small fraction of the
        # sentences (sometimes a large one) and improve a few others
        worse = min(1.0, rng.expovariate(1 / 0.05))
        better = rng.uniform(0.0, 0.03)
        sys_ = []
        for h, r in zip(base, refs, strict=True):
            x = rng.random()
            if x < worse:
                sys_.append(_perturb(h, 0.3, vocab, rng))
            elif x < worse + better:
                sys_.append(_perturb(r, 0.2, vocab, rng))
            else:
                sys_.append(h)
        systems.append(sys_)
    return base, systems


def sacrebleu_route(metric, base: list[str], systems: list[list[str]]) -> tuple[float, np.ndarray, int, str]:
    """sacrebleu's ``PairedTest`` (paired bootstrap, references cached as its CLI does) on every system, or, where
    a pilot of 8 projects past ``SACREBLEU_BUDGET_S``, on as many as fit half the budget, extrapolated linearly:
    (seconds for all systems, the p-values of those run, how many ran, how the time was found)."""

    def run(k: int) -> tuple[float, np.ndarray]:
        named = [("baseline", base)] + [(f"sys{i}", h) for i, h in enumerate(systems[:k])]
        t0 = time.perf_counter()
        _, scores = PairedTest(named, {"BLEU": metric}, None, test_type="bs",
                               n_samples=N_RES, n_jobs=1)()
        return time.perf_counter() - t0, np.array([r.p_value for r in scores["BLEU"][1:]])

    pilot_k = min(8, N_SYSTEMS)
    pilot_s, _ = run(pilot_k)
    projected = pilot_s / pilot_k * N_SYSTEMS
    if projected <= SACREBLEU_BUDGET_S:
        seconds, p_values = run(N_SYSTEMS)
        return seconds, p_values, N_SYSTEMS, f"measured on all {N_SYSTEMS} systems"
    k = max(pilot_k, int(N_SYSTEMS * SACREBLEU_BUDGET_S / projected / 2))
    seconds, p_values = run(k)
    return seconds * N_SYSTEMS / k, p_values, k, f"measured on {k} systems, extrapolated linearly to {N_SYSTEMS}"


def our_route(base_stats: np.ndarray, sys_stats: np.ndarray) -> tuple[list[float], object, object]:
    """Our ``paired_bootstrap`` of the whole grid in one call, three times (sacrebleu's p-values: identical systems
    not set to 1), and once in its default mode: (the three runs' seconds, the first mode's result, the
    default's)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ours = paired_bootstrap(base_stats, sys_stats, bleu_from_stats, n_resamples=N_RES,
                                seed=SEED, identical_p_one=False)
        times.append(time.perf_counter() - t0)
    default = paired_bootstrap(base_stats, sys_stats, bleu_from_stats, n_resamples=N_RES,
                               seed=SEED)
    return times, ours, default


def main() -> None:
    """Time both routes on the same grid, compare their p-values; the RESULT significance line."""
    common.enable_smoke(common.command_line(__doc__).parse_args())
    rng = random.Random(7)
    refs, source = _references(rng)
    base, systems = _systems(refs, rng)
    print(f"references: {source} ({N_SENT} sentences); {N_SYSTEMS} ablated systems "
          f"({N_IDENTICAL} identical to the baseline); {N_RES} resamples, seed {SEED}")

    os.environ["SACREBLEU_SEED"] = str(SEED)
    metric = BLEU(references=[refs])
    sb_total, sb_p, sb_k, sb_note = sacrebleu_route(metric, base, systems)

    # ---- statistics extraction (sacrebleu's, as our translation worker uses it)
    t0 = time.perf_counter()
    base_stats = np.array(metric._extract_corpus_statistics(base, None), dtype=np.float64)
    sys_stats = np.array(
        [metric._extract_corpus_statistics(h, None) for h in systems], dtype=np.float64
    )
    extract_s = time.perf_counter() - t0

    times, ours, default = our_route(base_stats, sys_stats)
    ours_s = statistics.median(times)
    diff = np.abs(ours.p_value[:sb_k] - sb_p)
    ratio = sb_total / ours_s
    ratio_e2e = sb_total / (ours_s + extract_s)
    print(f"sacrebleu PairedTest (bs, n_jobs=1): {sb_total:.2f} s for {N_SYSTEMS} systems "
          f"({sb_note}; {sb_total / N_SYSTEMS * 1000:.0f} ms/system; includes its statistics "
          f"extraction)")
    print(f"ours paired_bootstrap: {ours_s:.3f} s for {N_SYSTEMS} systems x {N_RES} resamples "
          f"(median of 3: {', '.join(f'{t:.3f}' for t in times)} s)")
    print(f"statistics extraction for {N_SYSTEMS + 1} hypothesis sets (sacrebleu's per-sentence "
          f"statistics, needed by both): {extract_s:.2f} s")
    sb_boot_only = max(sb_total - extract_s, 0.0)
    print(f"speed-up: {ratio:.1f}x sacrebleu PairedTest / our paired_bootstrap; "
          f"{sb_boot_only / ours_s:.1f}x excluding sacrebleu's statistics extraction "
          f"(estimated as the extraction time above); {ratio_e2e:.1f}x if our side is "
          f"charged the extraction too")
    print(f"p-values vs sacrebleu on {sb_k} systems, same seed: max |diff| = {diff.max():.3g}, "
          f"exactly equal on {(diff < 1e-12).sum()}/{sb_k}; "
          f"p range [{sb_p.min():.4f}, {sb_p.max():.4f}], "
          f"{(sb_p < 0.01).sum()} with p < 0.01")
    print(f"default mode (identical_p_one=True): {N_IDENTICAL} identical systems get p = "
          f"{default.p_value[:N_IDENTICAL].tolist()} instead of sacrebleu's "
          f"{sb_p[:N_IDENTICAL].round(6).tolist()}")
    common.result("significance", ratio=f"{ratio:.1f}", max_abs_p_diff=f"{diff.max():.3g}")


if __name__ == "__main__":
    main()
