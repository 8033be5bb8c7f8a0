"""Significance for every evaluation of a run, computed while the grid runs.

Raw tests (a paired test of a batch of evaluations against the baseline) are pure functions of per-example
statistics. A large batch runs as a Ray task beside the workers as soon as it has landed; a small one (most batches:
milliseconds of numpy) runs in the driver at once, since a Ray task would first start a worker process of its own
(1-2 s at the end of every run). The multiple-comparison adjustment needs the whole family (one experiment of one
run), so an experiment's rows are adjusted and written once all of its evaluations and tests are in: one file per
experiment, written atomically.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import ray

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.results.views import shown_test
from headsweep.sweep.configuration.sections import SignificanceSection
from headsweep.sweep.statistics.significance import (
    _DEFAULT_MAX_BYTES,
    DRAW_BLOCK_BYTES,
    TestResult,
    mcnemar_exact,
    paired_bootstrap,
    paired_ttest,
    significance_rows,
)
from headsweep.workers.core.metrics import METRICS, metric_by_name
from headsweep.workers.core.work import WorkUnit

# The papers' tests: paired bootstrap for BLEU (Koehn 2004; chrF too), a t-test for accuracy, with
# McNemar's exact test as the better-founded companion for binary outcomes (``Metric.binary``: multiple
# choice's ``accuracy_norm`` too). Perplexity: the paired bootstrap over windows (as for BLEU, a corpus score
# from summed statistics), and a paired t-test on per-window mean NLL (``Metric.example_values``); logit_diff (paired
# prompts) the same two, the t-test on per-pair logit differences.
# The ``deltas`` view shows one test per evaluation (``headsweep.results.views.shown_test``): the metric's primary
# test, one of these, unless significance.tests leaves it out.
DEFAULT_TESTS = {"bleu": ["paired_bootstrap"], "chrf": ["paired_bootstrap"],
                 "accuracy": ["paired_ttest", "mcnemar_exact"],
                 "accuracy_norm": ["paired_ttest", "mcnemar_exact"], "perplexity": ["paired_bootstrap", "paired_ttest"],
                 "logit_diff": ["paired_bootstrap", "paired_ttest"],
                 # lm-eval tasks' corpus metrics (data.task lm_eval): the bootstrap over documents, and a t-test on
                 # per-document negative log-likelihood (per word or byte for the rolling ones)
                 **{m: ["paired_bootstrap", "paired_ttest"] for m in ("loglikelihood_perplexity", "word_perplexity",
                                                                      "byte_perplexity", "bits_per_byte")}}
TESTS_PER_TASK = 32
# A batch is tested in the driver up to this many systems x examples x statistics x resamples: about 0.1 s of
# numpy on one core (32 systems of 1,000 BLEU sentences, 10 statistics each, 1,000 resamples: 32 ms).
INLINE_WORK = 200_000_000


def bootstrap_bytes(n_resamples: int, n_examples: int, systems: int = TESTS_PER_TASK) -> int:
    """About what one paired-bootstrap batch holds at its peak (``paired_bootstrap``), with a quarter to spare: the
    resample counts, int32 (resamples x examples); four float64 (resamples x systems) arrays (the deltas, their
    absolute and centred values, the sorted copy the interval is read from); and the larger of the temporaries of
    drawing the counts (three int64 blocks of indices) and of summing them (a float64 chunk of the counts)."""
    indices = 8 * n_resamples * n_examples
    temporaries = max(3 * min(DRAW_BLOCK_BYTES, indices), min(_DEFAULT_MAX_BYTES, indices))
    return int(1.25 * (n_resamples * (4 * n_examples + 4 * 8 * systems) + temporaries))


def check_resample_memory(section: SignificanceSection, tests: list[str], n_examples: int,
                          available: int | None, limit_gib: float | None = None) -> None:
    """Refuse, before the first row, ``significance.n_resamples`` whose paired-bootstrap batch would take more than
    half the memory available (``available`` bytes, capped by ``sweep.memory_limit_gib``): it would fail only once
    every evaluation had been computed, with a MemoryError in the significance task."""
    if not section.enabled or "paired_bootstrap" not in tests:
        return
    known = [x for x in (available, None if limit_gib is None else int(limit_gib * 2**30)) if x is not None]
    if not known:
        return
    have = min(known)
    need = bootstrap_bytes(section.n_resamples, n_examples)
    if need <= have // 2:
        return
    low, high = 1, section.n_resamples  # the most resamples that fit: bootstrap_bytes grows with them
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if bootstrap_bytes(mid, n_examples) <= have // 2 else (low, mid - 1)
    fit = low
    source = "sweep.memory_limit_gib" if limit_gib is not None and have == known[-1] else "MemAvailable"
    raise HeadsweepError(
        f"significance.n_resamples={section.n_resamples:,} paired-bootstrap resamples of {n_examples:,} examples take "
        f"about {need / 2**30:.1f} GiB per batch of tests, more than half of the {have / 2**30:.1f} GiB available "
        f"({source}): use significance.n_resamples={fit:,} or fewer (sacrebleu's default is 1,000)"
    )


def tests_for(section: SignificanceSection, metric: str, averaged: bool = False) -> list[str]:
    """The run's tests: ``significance.tests``, or the metric's defaults. ``averaged``: each example's statistics
    are a mean over resample draws (``ablation.resamples`` > 1), no longer 0/1 outcomes, so McNemar's test is left
    out of the defaults and refused when asked for."""
    tests = section.tests if section.tests is not None else DEFAULT_TESTS.get(metric, ["paired_bootstrap"])
    if averaged and section.tests is None:
        tests = [t for t in tests if t != "mcnemar_exact"]
    if averaged and "mcnemar_exact" in tests:
        raise HeadsweepError("significance.tests: mcnemar_exact needs 0/1 outcomes, and with ablation.resamples above "
                             "1 each example's outcome is the mean of its resample draws: use paired_ttest or "
                             "paired_bootstrap")
    known = METRICS.get(metric)
    if "mcnemar_exact" in tests and not (known and known.binary):
        binary = ", ".join(m.name for m in METRICS.values() if m.binary)
        raise HeadsweepError(f"significance.tests: mcnemar_exact needs binary outcomes (metric {binary}), "
                             f"not {metric}")
    return tests


def raw_tests(
    metric: str, baseline: np.ndarray, systems: np.ndarray, tests: list[str], n_resamples: int, seed: int
) -> list[TestResult]:
    """Each requested test of ``systems`` (S, N, k) against ``baseline`` (N, k)."""
    results = []
    m = metric_by_name(metric)
    for test in tests:
        if test == "paired_bootstrap":
            results.append(paired_bootstrap(baseline, systems, m.score_from_stats, n_resamples=n_resamples, seed=seed))
        elif test == "paired_ttest":
            # per-example values: correctness for accuracy, mean NLL per window for perplexity
            results.append(paired_ttest(m.example_values(baseline), m.example_values(systems)))
        elif test == "mcnemar_exact":
            # the metric's own 0/1 outcomes: correct for accuracy, correct_norm for accuracy_norm
            results.append(mcnemar_exact(m.example_values(baseline), m.example_values(systems)))
    return results


@ray.remote(num_cpus=0.5)
def raw_tests_task(metric, baseline, systems, tests, n_resamples, seed):
    return raw_tests(metric, baseline, systems, tests, n_resamples, seed)


def family_rows(eval_ids: list[str], results: list[TestResult], correction: str, alpha: float) -> list[dict]:
    """Significance rows of one family (one experiment), adjusted over the family per test."""
    return [
        {**row, "alpha": alpha}
        for result in results
        for row in significance_rows(result, eval_ids, correction=correction, alpha=alpha)
    ]


def concat_results(parts: list[TestResult]) -> TestResult:
    first = parts[0]
    return TestResult(
        test=first.test,
        statistic=np.concatenate([p.statistic for p in parts]),
        p_value=np.concatenate([p.p_value for p in parts]),
        ci_low=np.concatenate([p.ci_low for p in parts]),
        ci_high=np.concatenate([p.ci_high for p in parts]),
        n_resamples=first.n_resamples,
        seed=first.seed,
        std_error=None if any(p.std_error is None for p in parts) else np.concatenate([p.std_error for p in parts]),
    )


class SignificanceTracker:
    """Feeds finished evaluations to Ray tasks; writes each experiment's family when complete."""

    def __init__(
        self, section: SignificanceSection, store: ResultStore, run_id: str, metric: str,
        baseline_stats: np.ndarray, family_prefix: str = "", averaged: bool = False, reference: str | None = None,
        counted: tuple[str, ...] = (),
        before_write: Callable[[], None] | None = None,
    ):
        self.section = section
        self.store = store
        self.run_id = run_id
        self.metric = metric
        self.tests = tests_for(section, metric, averaged)
        self.baseline = np.asarray(baseline_stats, dtype=np.float64)
        self.baseline_ref = None  # put into Ray's object store with the first batch tested in a task
        self.expected: Counter = Counter()
        self.buffer: dict[str, list[tuple[str, np.ndarray]]] = defaultdict(list)
        self.submitted: Counter = Counter()
        self.pending: dict = {}
        self.done: dict[str, list[tuple[list[str], list[TestResult]]]] = defaultdict(list)
        self.tested: Counter = Counter()
        self.family_prefix = family_prefix
        self.screened: set[str] = set()
        self.reference = reference  # the kind of the unmasked model's unit: the baseline of every test, not tested
        self.counted = counted  # the kinds whose significant evaluations significant_so_far counts
        # Stores the evaluations buffered so far (the run's chunk writer): a family's rows never land before the
        # evaluations they test, so a run killed in between holds no significance row of an evaluation it lacks.
        self.before_write = before_write

    def expect(self, units: list[WorkUnit]) -> None:
        """Announce units to come; a family is complete once all its announced units are tested."""
        self.expected.update(u.experiment for u in units if u.experiment != self.reference)

    def add(self, unit: WorkUnit, stats: np.ndarray) -> None:
        if unit.experiment == self.reference:
            return
        self.buffer[unit.experiment].append((unit.eval_id, stats))
        buffered = len(self.buffer[unit.experiment])
        complete = self.submitted[unit.experiment] + buffered == self.expected[unit.experiment]
        if buffered >= TESTS_PER_TASK or complete:
            self._submit(unit.experiment)
        self.poll()

    def add_screened(self, unit: WorkUnit) -> None:
        """A mask screened out on a subset (``sweep.screen``): in its family with p = 1 for every test, so the
        correction counts it, and no row of its own."""
        nan = np.full(1, np.nan)
        results = [TestResult(test, nan, np.ones(1), nan, nan, 0, None) for test in self.tests]
        self.screened.add(unit.eval_id)
        self.done[unit.experiment].append(([unit.eval_id], results))
        self.submitted[unit.experiment] += 1
        self.tested[unit.experiment] += 1
        if self.tested[unit.experiment] == self.expected[unit.experiment] and not self.buffer.get(unit.experiment):
            self._write(unit.experiment)

    def _submit(self, experiment: str) -> None:
        batch = self.buffer.pop(experiment, [])
        if not batch:
            return
        ids = [eval_id for eval_id, _ in batch]
        systems = np.stack([s for _, s in batch]).astype(np.float64)
        s = self.section
        self.submitted[experiment] += len(ids)
        if systems.size * s.n_resamples <= INLINE_WORK:
            self._landed(experiment, ids, raw_tests(self.metric, self.baseline, systems, self.tests, s.n_resamples,
                                                    s.seed))
            return
        if self.baseline_ref is None:
            self.baseline_ref = ray.put(self.baseline)
        ref = raw_tests_task.remote(self.metric, self.baseline_ref, systems, self.tests, s.n_resamples, s.seed)
        self.pending[ref] = (experiment, ids)

    def _landed(self, experiment: str, ids: list[str], results: list[TestResult]) -> None:
        self.done[experiment].append((ids, results))
        self.tested[experiment] += len(ids)
        if self.tested[experiment] == self.expected[experiment]:
            self._write(experiment)

    def poll(self, wait: bool = False) -> None:
        """Collect finished tasks (all of them when ``wait``) and write complete families."""
        while self.pending:
            refs = list(self.pending)
            ready, _ = ray.wait(refs, num_returns=len(refs) if wait else 1, timeout=None if wait else 0)
            if not ready:
                break
            for ref in ready:
                experiment, ids = self.pending.pop(ref)
                self._landed(experiment, ids, ray.get(ref))
            if wait:
                break

    def significant_so_far(self) -> int:
        """Evaluations of the counted kinds significant among those tested so far, the correction applied over each
        kind's family so far only (provisional: the written family is corrected over all of its evaluations)."""
        shown = shown_test(self.metric, self.tests)  # the test the views, status and report show
        return sum(r["significant"] for experiment in self.counted if self.done.get(experiment)
                   for r in self._family_rows(experiment) if r["test"] == shown)

    def finish(self) -> None:
        """Submit what is buffered, wait for every task, write every complete family."""
        for experiment in list(self.buffer):
            self._submit(experiment)
        self.poll(wait=True)

    def _family_rows(self, experiment: str) -> list[dict]:
        """Significance rows of the evaluations of ``experiment`` tested so far, corrected over them."""
        parts = self.done[experiment]
        eval_ids = [i for ids, _ in parts for i in ids]
        results = [concat_results([res[t] for _, res in parts]) for t in range(len(self.tests))]
        rows = family_rows(eval_ids, results, self.section.correction, self.section.alpha)
        return [r for r in rows if r["eval_id"] not in self.screened]

    def _write(self, experiment: str) -> None:
        if self.before_write is not None:
            self.before_write()
        rows = self._family_rows(experiment)
        name = (self.family_prefix + experiment).replace("/", "-")
        self.store.write_rows("significance", self.run_id, rows, name=name)
