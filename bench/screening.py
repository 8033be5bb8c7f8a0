"""Benchmark: sequential screening (``sweep.screen``) against the full single-head grid, on both benchmark models.

For each model, two runs of ``headsweep run`` (the Python API, one local Ray instance, one worker), one after
the other on the same machine: the full grid (``experiments: [baseline, single_head]``) and the same grid
with ``sweep.screen`` (``--rule``: ``futility`` with ``--miss``, the default, or ``equivalence`` with the
margins below; ``--fraction`` of the examples first, by default the rule's own default). Measured: the wall
time of each run, and how many heads the full run finds significant (its primary test: paired t-test for
accuracy, paired bootstrap for BLEU, corrected over the grid) that the screened run screened out, i.e. missed.

One screened run is one draw of the subset. The rates are measured too, not assumed: the full run's stored
per-example statistics, at ``--draws`` other random subsets (other seeds), go through the same rule
(``headsweep.sweep.run.screening.verdicts``); a subset's statistics are the full evaluation's at those positions,
which ``tests/run/test_screening.py`` checks for every family. Reported per model: the mean share of heads screened
out, the expected number of the full run's significant heads screened out, and the share of draws that miss
at least one.

* classifier: the 6-layer, 12-head BERT of ``bench/grid_speed.py`` (``bench/classifier.py``: random init, word
  tokenizer over SST-2 train) on the first ``--classifier-examples`` sentences of SST-2 dev; equivalence
  ``--accuracy-margin``.
* translation: the Multi30k en-fr benchmark model of ``bench/multi30k.py`` (3+3 layers, 4 heads,
  trained once and cached) on ``--translation-examples`` sentences of test_2016_flickr, beam 5; equivalence
  ``--bleu-margin`` BLEU points.

Run: ``python -m bench.screening`` (``--skip-translation`` for the classifier alone; ``--smoke``: tiny models and
data, seconds). Per model, as soon as it is measured: ``RESULT screening_<model> speedup=<full_s/screened_s>
missed_significant=<n> of=<m> ...`` and ``RESULT screening_rates_<model> screened_share=<x> expected_missed=<y>
draws_missing_any=<z> draws=<R>``; last, ``RESULT screening speedup=<total full_s / total screened_s>
missed_significant=<n> of=<m>``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import yaml

from bench import classifier, common, multi30k


def classifier_config(workdir: Path, n_examples: int) -> dict:
    """grid_speed's random 6x12 BERT and the first ``n_examples`` SST-2 dev sentences, saved under ``workdir``."""
    model_dir, data, source = classifier.save_classifier(workdir, n_examples)
    print(f"classifier: {source}, up to {n_examples} sentences, {classifier.classifier_shape()}", flush=True)
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
            "sweep": {"batch_size": 64}}


def translation_config(threads: int, n_examples: int, beam: int) -> dict:
    """The Multi30k benchmark model and the first ``n_examples`` sentences of test_2016_flickr."""
    checkpoint, spm_model, data_bin = multi30k.cached_model(threads)
    source, target = multi30k.pair(multi30k.TEST)
    print(f"translation: Multi30k en-fr benchmark model, {n_examples} sentences of test_2016_flickr, beam {beam}",
          flush=True)
    return {"model": {"kind": "fairseq_translation", "checkpoint": str(checkpoint), "data_bin": str(data_bin),
                      "beam": beam},
            "data": {"source": str(source), "target": str(target), "sentencepiece_model": str(spm_model),
                     "max_examples": n_examples, "name": "test_2016_flickr"},
            "sweep": {}}


def compare(name: str, base: dict, screen: dict, workdir: Path, threads: int, address: str, draws: int) -> dict:
    """The full and the screened run of ``base``; their times, what screening missed, and its rates over draws."""
    import headsweep

    sweep = {**base["sweep"], "experiments": ["baseline", "single_head"], "workers": 1,
             "threads_per_worker": threads}
    times, run_ids = {}, {}
    for side, extra in (("full", {}), ("screened", {"screen": screen})):
        path = workdir / f"{name}-{side}.yaml"
        path.write_text(yaml.safe_dump({**base, "name": f"{name}-{side}", "sweep": {**sweep, **extra}}))
        start = time.perf_counter()
        run_ids[side] = headsweep.run(str(path), store=str(workdir / "store"), address=address, show_progress=False)
        times[side] = time.perf_counter() - start
        print(f"  {name} {side}: {times[side]:.1f} s (run {run_ids[side]})", flush=True)
    with headsweep.open_store(str(workdir / "store")) as store:
        significant = {e for (e,) in store.sql(
            "SELECT eval_id FROM deltas WHERE run_id = ? AND experiment = 'single_head' AND significant",
            [run_ids["full"]]).fetchall()}
        screened = dict(store.sql("SELECT eval_id, screen FROM evaluations WHERE run_id = ? "
                                  "AND experiment = 'single_head'", [run_ids["screened"]]).fetchall())
        cfg = json.loads(store.sql("SELECT config FROM runs WHERE run_id = ?", [run_ids["screened"]]).fetchone()[0])
        p_values = dict(store.sql("SELECT eval_id, p_value FROM deltas WHERE run_id = ? AND significant",
                                  [run_ids["full"]]).fetchall())
    out = [e for e, s in screened.items() if s == "screened_out"]
    missed = sorted(significant & set(out))
    print(f"  {name}: {len(screened)} heads, {len(out)} screened out, {len(significant)} significant in the full "
          f"run, missed: {', '.join(missed) or 'none'}", flush=True)
    rates = screening_rates(workdir / "store", run_ids["full"], significant, cfg, draws)
    print(f"  {name} over {draws} subsets: {rates['share']:.1%} of heads screened out on average; significant "
          f"heads screened out: {rates['expected_missed']:.3f} expected, in {rates['missing_any']:.1%} of draws"
          + "".join(f"\n    {e}: full-run p {p_values[e]:.2g}, z {z:.2f} (delta / bootstrap s.e. on the whole set); "
                    f"screened out in {r:.1%} of draws; the rule's promise at that z: {promised:.1%}"
                    for e, (r, z, promised) in rates["per_significant"].items()),
          flush=True)
    return {"full_s": times["full"], "screened_s": times["screened"], "missed": len(missed),
            "significant": len(significant), "screened_out": len(out), "heads": len(screened), "rates": rates}


def screening_rates(store_path: Path, full_id: str, significant: set[str], cfg: dict, draws: int) -> dict:
    """The screened run's rule at ``draws`` random subsets of the full run's stored per-example statistics."""
    import numpy as np

    import headsweep
    from headsweep.sweep.run.screening import ScreenSettings, verdicts
    from headsweep.sweep.statistics.significance import paired_bootstrap
    from headsweep.workers.core.metrics import metric_by_name

    with headsweep.open_store(str(store_path)) as store:
        metric = store.sql("SELECT metric FROM runs WHERE run_id = ?", [full_id]).fetchone()[0]
        rows = store.sql("SELECT e.eval_id, x.example_id, x.stats FROM examples x JOIN evaluations e "
                         "USING (run_id, eval_id) WHERE run_id = ? AND e.experiment IN ('baseline', 'single_head')",
                         [full_id]).fetchall()
    by_eval: dict[str, dict[str, list]] = {}
    for eval_id, example_id, stats in rows:
        by_eval.setdefault(eval_id, {})[example_id] = stats
    base_id = next(e for e in by_eval if not e.startswith("single_head/"))
    order = sorted(by_eval[base_id])  # any fixed order serves: each draw is a random subset of the whole set
    base = np.array([by_eval[base_id][x] for x in order], dtype=np.float64)
    heads = sorted(e for e in by_eval if e.startswith("single_head/"))
    masks = np.stack([[by_eval[e][x] for x in order] for e in heads]).astype(np.float64)
    sig = np.array([e in significant for e in heads])
    screened = np.zeros(len(heads))
    missing_any = 0
    for seed in range(1, draws + 1):
        settings = ScreenSettings.from_config(cfg["sweep"]["screen"], seed, cfg["significance"]["alpha"])
        pos = list(settings.positions(len(order)))
        out = np.array([v.screened_out for v in verdicts(metric, base[pos], masks[:, pos], settings, len(heads))])
        screened += out
        missing_any += bool((out & sig).any())
    share = screened / draws
    whole = paired_bootstrap(base, masks, metric_by_name(metric).score_from_stats, n_resamples=1000, seed=0)
    z_full = np.abs(whole.statistic / whole.std_error)
    rule = ScreenSettings.from_config(cfg["sweep"]["screen"], 0, cfg["significance"]["alpha"])
    return {"share": float(share.mean()), "expected_missed": float(share[sig].sum()),
            "missing_any": missing_any / draws,
            "per_significant": {e: (float(r), float(z), rule.miss_chance(len(heads), z) if rule.rule == "futility"
                                    else float("nan"))
                                for e, r, z, s in zip(heads, share, z_full, sig, strict=True) if s}}


def main() -> None:
    """Both models' full and screened runs (the classifier's alone in smoke mode), each printing its RESULT lines as
    soon as it is measured, then the RESULT screening line."""
    parser = common.command_line(__doc__)
    parser.add_argument("--rule", choices=("futility", "equivalence"), default="futility")
    parser.add_argument("--miss", type=float, default=None, help="futility: sweep.screen.miss (default: its default)")
    parser.add_argument("--fraction", type=float, default=None, help="sweep.screen.fraction (default: the rule's)")
    parser.add_argument("--accuracy-margin", type=float, default=0.01, help="equivalence, accuracy (0.01: 1 point)")
    parser.add_argument("--bleu-margin", type=float, default=0.5, help="equivalence, BLEU points")
    parser.add_argument("--classifier-examples", type=int, default=1000)
    parser.add_argument("--translation-examples", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draws", type=int, default=200, help="random subsets for the rates")
    parser.add_argument("--skip-translation", action="store_true")
    args = parser.parse_args()
    if common.enable_smoke(args):
        # The classifier alone: each run starts its Ray worker (seconds), and the translation model's two runs
        # take the same code path (compare) as the classifier's.
        args.classifier_examples, args.skip_translation = common.SMOKE_DATA_LINES, True
        args.threads, args.draws = 1, 5
    common.quiet_logging()
    import ray

    def screen(margin: float) -> dict:
        chosen = {"rule": args.rule} | ({} if args.fraction is None else {"fraction": args.fraction})
        if args.rule == "equivalence":
            return chosen | {"equivalence": margin}
        return chosen | ({} if args.miss is None else {"miss": args.miss})

    # A private instance: without this Ray turns on token auth and writes ~/.ray/auth_token (see sweep's Ray session).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=args.threads + 1, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results["classifier"] = compare("classifier", classifier_config(workdir, args.classifier_examples),
                                        screen(args.accuracy_margin), workdir, args.threads, address, args.draws)
        report("classifier", results["classifier"], args.draws)
        if not args.skip_translation and multi30k.DATA.is_dir():
            results["translation"] = compare(
                "translation", translation_config(args.threads, args.translation_examples, args.beam),
                screen(args.bleu_margin), workdir, args.threads, address, args.draws)
            report("translation", results["translation"], args.draws)
    full = sum(r["full_s"] for r in results.values())
    screened = sum(r["screened_s"] for r in results.values())
    missed = sum(r["missed"] for r in results.values())
    common.result("screening", speedup=f"{full / screened:.2f}", missed_significant=missed,
                  of=sum(r["significant"] for r in results.values()))


def report(name: str, r: dict, draws: int) -> None:
    """The RESULT lines of one model's comparison."""
    common.result(f"screening_{name}", speedup=f"{r['full_s'] / r['screened_s']:.2f}", missed_significant=r["missed"],
                  of=r["significant"], screened_out=r["screened_out"], heads=r["heads"], full_s=f"{r['full_s']:.1f}",
                  screened_s=f"{r['screened_s']:.1f}")
    rates = r["rates"]
    common.result(f"screening_rates_{name}", screened_share=f"{rates['share']:.3f}",
                  expected_missed=f"{rates['expected_missed']:.3f}", draws_missing_any=f"{rates['missing_any']:.3f}",
                  draws=draws)


if __name__ == "__main__":
    main()
