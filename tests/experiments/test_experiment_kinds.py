"""Experiment kinds are modules the driver looks up: a kind defined here runs without editing the driver."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import error_line, run_cli

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.experiments import KINDS, Experiment, register, schedule
from headsweep.workers.core.work import WorkUnit

HERE = Path(__file__).parent  # this module (the kind) and conftest (its helpers) must import in the CLI's process


class FirstHeads(Experiment):
    """Custom-like: in each layer, its first k heads masked, for k = 1 .. H-1."""

    name = "first_heads"
    planned_before: list[int] = []  # evaluations counted when plan() ran (0 + the baseline: one pass with the others)

    def plan(self, ctx) -> list[WorkUnit]:
        if ctx.record is not None:
            self.planned_before.append(ctx.record.n_planned)
        units = []
        for shape in ctx.inventory.layers:
            heads = shape.heads()
            for k in range(1, len(heads)):
                units.append(WorkUnit(f"first_heads/{shape.attention}:{shape.layer}/{k}", self.name, tuple(heads[:k]),
                                      shape.attention, shape.layer))
        return units


class Tally(Experiment):
    """A step (not mask evaluations) that reads back what ``first_heads`` stored."""

    name = "tally"
    seen: list[list[str]] = []

    def needs(self, cfg) -> tuple[str, ...]:
        return ("first_heads",)

    def run(self, ctx) -> None:
        rows = ctx.store.read("evaluations", ctx.run_id).to_pylist()
        self.seen.append(sorted(r["eval_id"] for r in rows if r["experiment"] == "first_heads"))


FIRST_HEADS = FirstHeads()


def config(model_dir, data_file, experiments: list[str], **extra) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data_file)},
            "sweep": {"experiments": experiments, "batch_size": 16, "flush_every": 4}, **extra}


@pytest.fixture
def test_kinds():
    """FIRST_HEADS and a Tally registered for one test (the registry is the hook for kinds from outside)."""
    tally = Tally()
    register(FIRST_HEADS)
    register(tally)
    yield FIRST_HEADS, tally
    KINDS.pop(FIRST_HEADS.name)
    KINDS.pop(tally.name)


def test_the_registry_names_the_kinds_and_orders_them():
    with pytest.raises(HeadsweepError, match="known: baseline, single_head, all_but_one, custom, importance, "
                                             "prune_level, efficiency"):
        build_config(config("m", "d.tsv", ["baseline", "nope"]))
    cfg = build_config(config("m", "d.tsv", ["efficiency", "prune_level", "all_but_one", "single_head"],
                              importance={"data": {"path": "train.tsv"}}, efficiency={"level": 0.5},
                              sweep={"experiments": ["efficiency", "prune_level", "all_but_one", "single_head"],
                                     "masks": [["self:0:1"]]}))
    assert cfg.sweep.experiments[-1] == "custom"  # implied by sweep.masks, as before
    phases = [[k.name for k in phase.kinds] for phase in schedule(cfg)]
    # Baseline alone first; the grids in one pass (in the order listed); importance pulled in by prune_level.
    assert phases == [["baseline"], ["all_but_one", "single_head", "custom"], ["importance"], ["prune_level"],
                      ["efficiency"]]


def test_a_registered_kind_runs_without_editing_the_driver(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv,
                                                          test_kinds):
    from headsweep.sweep.run.driver import Sweep

    first_heads, tally = test_kinds
    first_heads.planned_before.clear()
    # Only the step is listed: the kind it needs joins the run and streams in one pass with single_head.
    cfg = build_config(config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "single_head", "tally"]))
    assert [[k.name for k in p.kinds] for p in schedule(cfg)] == [["baseline"], ["single_head", "first_heads"],
                                                                   ["tally"]]
    store = ResultStore(str(tmp_path / "store"))
    run_id = Sweep(cfg, store, address=ray_address, show_progress=False).execute()

    evals = {e["eval_id"]: e for e in store.read("evaluations", run_id).to_pylist()}
    mine = sorted((e for e in evals.values() if e["experiment"] == "first_heads"), key=lambda e: e["eval_id"])
    assert len(mine) == 2 * 3
    base = evals["baseline"]["score"]
    for e in mine:
        layer, k = e["eval_id"].split("/")[1], int(e["eval_id"].split("/")[2])
        assert e["heads_masked"] == [f"{layer}:{h}" for h in range(k)] and e["n_masked"] == k
        assert e["baseline_score"] == base and e["delta"] == e["score"] - base
    assert first_heads.planned_before == [1]  # planned beside single_head, before either was streamed
    assert tally.seen == [[e["eval_id"] for e in mine]]  # the step ran after they were stored
    sig = store.read("significance", run_id).to_pylist()
    assert {s["eval_id"] for s in sig if s["eval_id"].startswith("first_heads/")} == {e["eval_id"] for e in mine}
    [run] = store.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_planned"] == run["n_done"] == 1 + 8 + 6


# A kind installed as an entry point, through the CLI: test_kind_parts.py's
# test_a_kind_installed_as_an_entry_point_runs_through_the_cli (one run with that module's kind).


def test_a_config_never_names_a_module_to_import(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    """``this`` prints the Zen of Python when imported: a config naming it must be refused before any import."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "this:X"])))
    for args in ([], ["model.kind=this:X"]):
        proc = run_cli("run", str(tmp_path / "c.yaml"), *args, "--store", str(tmp_path / "store"))
        assert proc.returncode == 2, proc.stderr
        what = "model.kind" if args else "experiment kind"
        group = "headsweep.families" if args else "headsweep.kinds"
        assert error_line(proc.stderr) == (
            f"headsweep: error: {what} 'this:X' is a module path, and configs never import code: install the plugin "
            f"as an entry point in group '{group}' and name it by that entry point's name")
        assert "Zen of Python" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "store").exists()
