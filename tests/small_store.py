"""A small real results store for the view and report tests: one real sweep (``headsweep.run``, in the test
process: the tests only read what it writes; the ``run`` command has tests of its own).

The tiny BERT classifier over two checkpoints (so that views keyed by checkpoint are put to the
test) with single_head, all_but_one, importance and prune_level. Significance uses no correction
and a high alpha so that some cells are significant and the figures carry marks. The store is
built once per test session (under pytest's session temporary folder) and shared by the test
modules that read it.
"""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli, sweep_in_process

LEVELS = [0.0, 0.25, 0.5, 0.75, 1.0]
ALPHA = 0.4


def small_store(tmp_path_factory, ray_address: str, model_dir: Path, dev_tsv: Path) -> tuple[Path, str, list[str]]:
    """The session's small store: (store folder, run id, the two checkpoints)."""
    tmp = tmp_path_factory.getbasetemp() / "small-store"
    done = tmp / "run_id.txt"
    if not done.is_file():
        tmp.mkdir(exist_ok=True)
        store, run_id, checkpoints = build_small_store(tmp, ray_address, model_dir, dev_tsv)
        done.write_text("\n".join([run_id, *checkpoints]))
    run_id, *checkpoints = done.read_text().splitlines()
    return tmp / "store", run_id, checkpoints


def small_report(tmp_path_factory, ray_address: str, model_dir: Path, dev_tsv: Path) -> Path:
    """``headsweep report`` of the small store's run (the real CLI), written once per test session beside the
    store, for the tests that read the page: its ``index.html``."""
    store, run_id, _ = small_store(tmp_path_factory, ray_address, model_dir, dev_tsv)
    out = store.parent / "report"
    done = store.parent / "report-done.txt"
    if not done.is_file():
        proc = run_cli("report", run_id, "--store", str(store), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert Path(proc.stdout.strip()) == out / "index.html"
        done.write_text(run_id)
    return out / "index.html"


def build_small_store(tmp: Path, ray_address: str, model_dir: Path, dev_tsv: Path) -> tuple[Path, str, list[str]]:
    """Run the sweep into ``tmp/store``; returns the store, the run id and the two checkpoints."""
    from tiny_models import save_tiny_classifier  # torch: only when the store is built

    from headsweep.sweep.demo.sentiment import generate, write_tsv

    second = save_tiny_classifier(tmp / "epoch2", seed=1)
    train = write_tsv(generate(40, seed=5), tmp / "train.tsv")
    checkpoints = [str(model_dir), str(second)]
    cfg = {
        "name": "small-store",
        "model": {"kind": "hf_classifier", "path": str(model_dir)},
        "checkpoints": checkpoints,
        "data": {"path": str(dev_tsv)},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one", "importance", "prune_level"],
                  "batch_size": 20},
        "importance": {"data": {"path": str(train)}},
        "prune": {"levels": LEVELS},
        "significance": {"alpha": ALPHA, "correction": "none"},
    }
    store = tmp / "store"
    return store, sweep_in_process(cfg, tmp, "c", store, ray_address), checkpoints
