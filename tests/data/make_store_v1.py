"""Rebuild ``tests/data/store_v1``: a small results store written by schema version 1.

The fixture is what a store written by headsweep's schema v1 looks like on disk, so that later
releases are tested against real old files. It was made with the code of commit 53f0b91 (schema
version 1) by ``python tests/data/make_store_v1.py``; rerunning it with a newer release writes the
newer schema, so do not regenerate it after the schema version changes.

Three real sweeps through the CLI, on tiny models built here (random BERT; fairseq trained a few
seconds on the synthetic task):
1. the tiny BERT classifier over two checkpoints: baseline, single_head, all_but_one, importance,
   prune_level (levels 0, 0.5, 1);
2. the tiny fairseq model: the same experiments, pruning restricted to ``enc_dec``;
3. the same fairseq model, global pruning only (levels 0, 0.5, 1).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

EXPERIMENTS = ["baseline", "single_head", "all_but_one", "importance", "prune_level"]
SIGNIFICANCE = {"n_resamples": 200, "seed": 5}


def sweep(config: dict, work: Path, store: Path, name: str) -> str:
    """One sweep through the real CLI; returns the run id."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path), "--store", str(store), "--quiet",
                           "--workers", "1"], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    from tiny_fairseq import train_tiny
    from tiny_models import save_tiny_classifier
    from workers.synthetic_sentiment import generate, write_tsv

    out = HERE / "store_v1"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = work / "store"
        first = save_tiny_classifier(work / "bert-a")
        second = save_tiny_classifier(work / "bert-b", seed=1)
        dev = write_tsv(generate(40, seed=7), work / "dev.tsv")
        train = write_tsv(generate(60, seed=11), work / "train.tsv")
        classifier = {
            "name": "v1-classifier",
            "model": {"kind": "hf_classifier", "path": str(first)},
            "checkpoints": [str(first), str(second)],
            "data": {"path": str(dev)},
            "sweep": {"experiments": EXPERIMENTS, "batch_size": 20},
            "importance": {"data": {"path": str(train)}},
            "prune": {"levels": [0.0, 0.5, 1.0]},
            "significance": SIGNIFICANCE,
        }
        print("classifier", sweep(classifier, work, store, "classifier"))
        tiny = train_tiny(work / "fairseq")
        translation = {
            "name": "v1-translation",
            "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint),
                      "data_bin": str(tiny.data.data_bin), "beam": 2},
            "data": {"source": str(tiny.data.test_source), "target": str(tiny.data.test_target)},
            "sweep": {"experiments": EXPERIMENTS, "batch_size": 20},
            "importance": {"data": {"data_bin": str(tiny.data.data_bin), "split": "valid"}},
            "prune": {"levels": [0.0, 0.25, 0.5, 0.75, 1.0], "attention": ["enc_dec"]},
            "significance": SIGNIFICANCE,
        }
        print("translation", sweep(translation, work, store, "translation"))
        global_prune = {**translation, "name": "v1-translation-global",
                        "sweep": {"experiments": ["baseline", "importance", "prune_level"], "batch_size": 20},
                        "prune": {"levels": [0.0, 0.5, 1.0]}}
        print("translation-global", sweep(global_prune, work, store, "translation_global"))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(store, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
