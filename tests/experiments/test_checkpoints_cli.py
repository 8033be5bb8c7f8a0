"""Training dynamics: one run over several checkpoints of a model, a pruning curve for each."""

from __future__ import annotations

import yaml
from conftest import run_cli
from tiny_models import save_tiny_classifier

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv


def test_pruning_curve_per_checkpoint(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    second = save_tiny_classifier(tmp_path / "epoch2", seed=1)
    train = write_tsv(generate(40, seed=5), tmp_path / "train.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "checkpoints": [str(tiny_bert_dir), str(second)],
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "importance", "prune_level"]},
        "importance": {"data": {"path": str(train)}},
        "prune": {"levels": [0.0, 0.5, 1.0]},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "s"), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    store = ResultStore(str(tmp_path / "s"))
    evals = store.read("evaluations").to_pylist()
    assert len(evals) == 2 * (1 + 3)
    for i, ckpt in enumerate([str(tiny_bert_dir), str(second)]):
        mine = [e for e in evals if e["checkpoint"] == ckpt]
        [base] = [e for e in mine if e["experiment"] == "baseline"]
        assert base["eval_id"] == f"ckpt{i}/baseline"
        levels = sorted((e for e in mine if e["experiment"] == "prune_level"), key=lambda e: e["level"])
        assert [e["n_masked"] for e in levels] == [0, 4, 8]
        assert levels[0]["score"] == base["score"]
        assert all(e["baseline_score"] == base["score"] and e["delta"] == e["score"] - base["score"] for e in levels)
    imp = store.read("importance").to_pylist()
    assert sorted({r["checkpoint"] for r in imp}) == sorted([str(tiny_bert_dir), str(second)])
    assert len(imp) == 16
    sig = store.read("significance").to_pylist()
    assert len({s["eval_id"] for s in sig}) == 6
    [run] = store.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_done"] == run["n_planned"] == 8


def listing(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() \
        else {}


def test_every_checkpoint_is_checked_before_anything_is_written(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """A missing or differently shaped later checkpoint stops the run before its first row."""
    from conftest import error_line

    other = save_tiny_classifier(tmp_path / "three-layers", layers=3, seed=2)
    store = tmp_path / "s"
    store.mkdir()
    cases = [
        ([str(tiny_bert_dir), str(tmp_path / "missing")], "checkpoints entry 2 ("),
        ([str(tiny_bert_dir), str(other)], "has other attention heads than the first (self 3x4 vs self 2x4)"),
    ]
    for checkpoints, message in cases:
        cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "checkpoints": checkpoints,
               "data": {"path": str(tiny_dev_tsv)}, "sweep": {"experiments": ["baseline", "single_head"]}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        before = listing(store)
        proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert message in error_line(proc.stderr)
        assert listing(store) == before
        assert ResultStore(str(store)).read("runs").num_rows == 0
