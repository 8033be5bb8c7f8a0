"""Progressive answers: ``sweep.order: importance``, ``sweep.budget`` and ``headsweep status``.

- The ordering rule on hand-built units; config errors; budget and order stay out of the config hash.
- Through the real CLI on a tiny classifier: an importance-ordered run lands its masks most important first and
  stores the same values as a planned-order run; a budgeted run stops after its budget, is marked partial,
  ``headsweep status`` says so, and the same command finishes it with the tables of an uninterrupted run.
"""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.sweep.experiments.plan import by_importance
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit


def unit(name: str, *heads: Head) -> WorkUnit:
    return WorkUnit(eval_id=name, experiment="x", masked=tuple(heads))


def test_masks_of_the_most_important_heads_go_first():
    a, b, c = Head("self", 0, 0), Head("self", 0, 1), Head("self", 1, 0)
    scores = {a: 0.2, b: 0.7, c: 0.5}
    units = [unit("a", a), unit("b", b), unit("c", c), unit("ac", a, c), unit("none"), unit("a2", a)]
    # ac: 0.7 ties with b and keeps its planned place after it; the two 0.2 masks keep theirs too
    assert [u.eval_id for u in by_importance(units, scores)] == ["b", "ac", "c", "a", "a2", "none"]


def config(model_dir, data, **sweep) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
            "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16, "masks_per_batch": 1,
                      **sweep},
            "significance": {"n_resamples": 200, "seed": 5}}


@pytest.mark.parametrize("budget, message", [
    ({"evaluations": 0}, "sweep.budget.evaluations must be a positive number"),
    ({"minutes": -1}, "sweep.budget.minutes must be a positive number"),
    ({"evaluations": 2.5}, "sweep.budget.evaluations must be a whole number"),
    ({"hours": 1}, "sweep.budget takes one of evaluations, minutes"),
    ({"evaluations": 3, "minutes": 1}, "sweep.budget takes one of evaluations, minutes"),
])
def test_bad_budgets(tmp_path, budget, message):
    with pytest.raises(HeadsweepError, match=message):
        build_config(config(tmp_path, tmp_path / "d.tsv", budget=budget))


def test_order_needs_importance_before_the_grid(tmp_path):
    cfg = config(tmp_path, tmp_path / "d.tsv", order="importance")
    with pytest.raises(HeadsweepError, match="sweep.order: importance evaluates masks by importance estimated"):
        build_config({**cfg, "importance": {"method": "ablation"}})
    with pytest.raises(HeadsweepError, match="unknown sweep.order 'random'"):
        build_config(config(tmp_path, tmp_path / "d.tsv", order="random"))


def test_budget_and_order_leave_the_run_identity_alone(tmp_path):
    train = {"importance": {"data": {"path": str(tmp_path / "train.tsv")}}}
    plain = build_config({**config(tmp_path, tmp_path / "d.tsv"), **train})
    session = build_config({**config(tmp_path, tmp_path / "d.tsv", budget={"minutes": 5}, order="importance"),
                            **train})
    assert plain.hash() == session.hash()
    assert plain.hash() != build_config({**config(tmp_path, tmp_path / "d.tsv", batch_size=8), **train}).hash()


def table(store, name: str, run_id: str, key: str = "eval_id") -> dict:
    return {r[key] if key != "eval_test" else (r["eval_id"], r["test"]): r
            for r in ResultStore(str(store)).read(name, run_id).to_pylist()}


def run(tmp_path, name: str, cfg: dict, ray_address: str, *extra: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(path), "--store", str(tmp_path / "store"), "--address", ray_address, "--quiet",
                   *extra)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1], proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """An uninterrupted planned-order run, the tables every other run is compared with."""
    tmp = tmp_path_factory.mktemp("reference")
    run_id, _ = run(tmp, "plain", config(tiny_bert_dir, tiny_dev_tsv), ray_address)
    return tmp / "store", run_id


def test_ordered_run_lands_important_heads_first_with_the_same_values(tmp_path, reference, ray_address,
                                                                      tiny_bert_dir, tiny_dev_tsv):
    train = write_tsv(generate(40, seed=11), tmp_path / "train.tsv")
    cfg = {**config(tiny_bert_dir, tiny_dev_tsv, order="importance"), "importance": {"data": {"path": str(train)}}}
    run_id, _ = run(tmp_path, "ordered", cfg, ray_address)
    ordered, planned = table(tmp_path / "store", "evaluations", run_id), table(reference[0], "evaluations",
                                                                                 reference[1])
    single = {k: v for k, v in ordered.items() if v["experiment"] == "single_head"}
    assert len(single) == 8
    assert {k: v["score"] for k, v in single.items()} == {k: planned[k]["score"] for k in single}  # exactly
    importance = {(r["layer"], r["head"]): r["score_normalized"]
                  for r in ResultStore(str(tmp_path / "store")).read("importance", run_id).to_pylist()}
    landed = sorted(single.values(), key=lambda r: r["finished_at"])
    for earlier, later in zip(landed, landed[1:], strict=False):
        if earlier["finished_at"] < later["finished_at"]:  # one worker, one mask per call: sent in this order
            assert importance[(earlier["layer"], earlier["head"])] >= importance[(later["layer"], later["head"])]


def test_budgeted_run_stops_partial_and_resumes_to_the_same_tables(tmp_path, reference, ray_address,
                                                                   tiny_bert_dir, tiny_dev_tsv):
    cfg = config(tiny_bert_dir, tiny_dev_tsv, budget={"evaluations": 3})
    run_id, proc = run(tmp_path, "budget", cfg, ray_address)
    store = ResultStore(str(tmp_path / "store"))
    [row] = store.read("runs", run_id).to_pylist()
    assert row["status"] == "partial" and row["n_done"] == 3
    assert len(store.read("evaluations", run_id)) == 3 and len(store.read("significance", run_id)) == 0
    status = run_cli("status", run_id, "--store", str(tmp_path / "store"))
    assert status.returncode == 0, status.stderr
    assert f"run {run_id}" in status.stdout and ": partial" in status.stdout
    assert "evaluations stored: 3 of 9 planned so far" in status.stdout

    cfg["sweep"].pop("budget")
    finished, _ = run(tmp_path, "budget", cfg, ray_address)  # the same run, without a budget: to the end
    assert finished == run_id and store.read("runs", run_id).to_pylist()[0]["status"] == "complete"
    mine, theirs = table(tmp_path / "store", "evaluations", run_id), table(reference[0], "evaluations", reference[1])
    assert {k: v["score"] for k, v in mine.items()} == {k: v["score"] for k, v in theirs.items()}  # exactly
    mine = table(tmp_path / "store", "significance", run_id, "eval_test")
    theirs = table(reference[0], "significance", reference[1], "eval_test")
    assert {k: (v["p_value"], v["p_adjusted"], v["significant"]) for k, v in mine.items()} == \
        {k: (v["p_value"], v["p_adjusted"], v["significant"]) for k, v in theirs.items()}
    status = run_cli("status", run_id, "--store", str(tmp_path / "store"))
    assert ": complete" in status.stdout and "heads significant:" in status.stdout


@pytest.mark.parametrize("attempts", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_budget_spent_before_the_baseline_lands_stores_what_was_computed(tmp_path, ray_address, tiny_bert_dir,
                                                                          tiny_dev_tsv, attempts):
    """Two workers and a budget of one evaluation: a single-head result may land before the baseline (the other
    worker's), and is held until the baseline is there. The stop waits for the baseline, so every result the session
    computed is stored, the baseline first among them (before, the stop came with the first result and the held ones
    were dropped: "partial with 0 evaluations stored")."""
    # Under optimal ablation the baseline lands after a single-head result in about a third of runs here (each
    # worker's first call waits for the constants' install). Every run must store what it computed, whichever
    # landed first: the suite runs one (13 s), `-m slow` four, four chances to land out of order.
    reference = write_tsv(generate(40, seed=11), tmp_path / "reference.tsv")
    for attempt in range(attempts):
        cfg = {**config(tiny_bert_dir, tiny_dev_tsv, budget={"evaluations": 1}, workers=2, ablation="optimal"),
               "ablation": {"reference": {"path": str(reference)}, "steps": 2}}
        store = tmp_path / f"store{attempt}"
        path = tmp_path / f"budget{attempt}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = run_cli("run", str(path), "--store", str(store), "--address", ray_address)
        assert proc.returncode == 0, proc.stderr
        run_id = proc.stdout.strip()
        reader = ResultStore(str(store))
        evaluations = reader.read("evaluations", run_id).to_pylist()
        [row] = reader.read("runs", run_id).to_pylist()
        assert row["status"] == "partial" and row["n_done"] == len(evaluations) >= 1, proc.stderr
        assert "baseline" in {e["experiment"] for e in evaluations} and row["baseline_score"] is not None
        assert f"marked partial with {len(evaluations)} evaluations stored" in proc.stderr
