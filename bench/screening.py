"""Benchmark: sequential screening (``sweep.screen``) against the full single-head grid, on both benchmark models.

For each model, two runs of ``headsweep run`` (the Python API, one local Ray instance, one worker), one after
the other on the same machine: the full grid (``experiments: [baseline, single_head]``) and the same grid
with ``sweep.screen`` (``--fraction`` of the examples first; a mask is screened out when its subset delta's
99% paired-bootstrap interval lies inside +-equivalence). Measured: the wall time of each run, and how many
heads the full run finds significant (its primary test: paired t-test for accuracy, paired bootstrap for
BLEU, corrected over the grid) that the screened run screened out, i.e. missed.

* classifier: the 6-layer, 12-head BERT of ``bench/grid_speed.py`` (random init, word tokenizer over SST-2
  train) on the first ``--classifier-examples`` sentences of SST-2 dev; equivalence ``--accuracy-margin``.
* translation: the Multi30k en-fr benchmark model of ``bench/multi30k_translation.py`` (3+3 layers, 4 heads,
  trained once and cached) on ``--translation-examples`` sentences of test_2016_flickr, beam 5; equivalence
  ``--bleu-margin`` BLEU points.

Run: ``python bench/screening.py`` (``--skip-translation`` for the classifier alone). Final lines:
``RESULT screening_<model> speedup=<full_s/screened_s> missed_significant=<n> of=<m> ...`` per model and
``RESULT screening speedup=<total full_s / total screened_s> missed_significant=<n> of=<m>``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grid_speed  # noqa: E402
import multi30k_translation as m30k  # noqa: E402


def classifier_config(workdir: Path, n_examples: int) -> dict:
    """grid_speed's random 6x12 BERT and the first ``n_examples`` SST-2 dev sentences, saved under ``workdir``."""
    model_dir, data, source = grid_speed.save_classifier(workdir, n_examples)
    print(f"classifier: {source}, up to {n_examples} sentences, 6 layers x 12 heads", flush=True)
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
            "sweep": {"batch_size": 64}}


def translation_config(threads: int, n_examples: int, beam: int) -> dict:
    checkpoint, spm_model, data_bin = m30k.cached_model(threads)
    print(f"translation: Multi30k en-fr benchmark model, {n_examples} sentences of test_2016_flickr, beam {beam}",
          flush=True)
    return {"model": {"kind": "fairseq_translation", "checkpoint": str(checkpoint), "data_bin": str(data_bin),
                      "beam": beam},
            "data": {"source": str(m30k.DATA / f"test_2016_flickr.{m30k.SRC}.gz"),
                     "target": str(m30k.DATA / f"test_2016_flickr.{m30k.TGT}.gz"),
                     "sentencepiece_model": str(spm_model), "max_examples": n_examples,
                     "name": "test_2016_flickr"},
            "sweep": {}}


def compare(name: str, base: dict, screen: dict, workdir: Path, threads: int, address: str) -> dict:
    """The full and the screened run of ``base``; their times and what screening missed."""
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
    out = [e for e, s in screened.items() if s == "screened_out"]
    missed = sorted(significant & set(out))
    print(f"  {name}: {len(screened)} heads, {len(out)} screened out, {len(significant)} significant in the full "
          f"run, missed: {', '.join(missed) or 'none'}", flush=True)
    return {"full_s": times["full"], "screened_s": times["screened"], "missed": len(missed),
            "significant": len(significant), "screened_out": len(out), "heads": len(screened)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.2)
    parser.add_argument("--accuracy-margin", type=float, default=0.01, help="equivalence, accuracy (0.01: 1 point)")
    parser.add_argument("--bleu-margin", type=float, default=0.5, help="equivalence, BLEU points")
    parser.add_argument("--classifier-examples", type=int, default=1000)
    parser.add_argument("--translation-examples", type=int, default=300)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-translation", action="store_true")
    args = parser.parse_args()
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    import ray

    ray.init(num_cpus=args.threads + 1, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results["classifier"] = compare("classifier", classifier_config(workdir, args.classifier_examples),
                                        {"fraction": args.fraction, "equivalence": args.accuracy_margin},
                                        workdir, args.threads, address)
        if not args.skip_translation and m30k.DATA.is_dir():
            results["translation"] = compare(
                "translation", translation_config(args.threads, args.translation_examples, args.beam),
                {"fraction": args.fraction, "equivalence": args.bleu_margin}, workdir, args.threads, address)
    for name, r in results.items():
        print(f"RESULT screening_{name} speedup={r['full_s'] / r['screened_s']:.2f} missed_significant={r['missed']} "
              f"of={r['significant']} screened_out={r['screened_out']} heads={r['heads']} full_s={r['full_s']:.1f} "
              f"screened_s={r['screened_s']:.1f}")
    full = sum(r["full_s"] for r in results.values())
    screened = sum(r["screened_s"] for r in results.values())
    missed = sum(r["missed"] for r in results.values())
    print(f"RESULT screening speedup={full / screened:.2f} missed_significant={missed} "
          f"of={sum(r['significant'] for r in results.values())}")


if __name__ == "__main__":
    main()
