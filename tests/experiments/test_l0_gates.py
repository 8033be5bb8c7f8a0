"""Hard Concrete (L0) head gates: the distribution against its closed forms, training, and the mask it yields.

- Samples against the closed-form CDF (Kolmogorov-Smirnov on the continuous part), P(g = 0) exactly at the
  noise threshold and against the empirical frequency (binomial test), the penalty against sum P(g > 0).
- Training on the real classifier adapter: lambda = 0 keeps every head open, a large lambda closes them
  all; the closed-gate mask evaluated through headsweep equals the model with those heads' W_O columns zeroed.
- A checkpointed trainer resumed mid-way reaches exactly the gates of an uninterrupted one.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from tiny_models import zeroed_copy
from tolerances import assert_routes_agree, max_difference

from headsweep.errors import HeadsweepError
from headsweep.sweep.experiments.l0.hard_concrete import HardConcrete
from headsweep.sweep.experiments.l0.settings import L0Section
from headsweep.sweep.experiments.l0.training import L0Trainer
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.config import TranslationRuntime
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.families.registry import model_family

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the distribution ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.33, 2 / 3])
@pytest.mark.parametrize("log_alpha", [-1.0, 0.0, 1.5])
def test_samples_follow_the_closed_form_cdf(beta, log_alpha):
    hc = HardConcrete(beta=beta)
    la = torch.full((200_000,), log_alpha, dtype=torch.float64)
    g = hc.sample(la, torch.Generator().manual_seed(3)).numpy()
    p0, p1 = float(hc.p_closed(torch.tensor(log_alpha))), float(hc.p_one(torch.tensor(log_alpha)))
    # The atoms: binomial tests of the frequencies of exactly 0 and exactly 1 against the closed forms.
    assert stats.binomtest(int((g == 0).sum()), len(g), p0).pvalue > 1e-3
    assert stats.binomtest(int((g == 1).sum()), len(g), p1).pvalue > 1e-3
    # The continuous part: KS against the CDF conditioned on 0 < g < 1.
    inner = g[(g > 0) & (g < 1)]

    def conditional_cdf(x):
        return (hc.cdf(torch.as_tensor(x), log_alpha).numpy() - p0) / (1 - p0 - p1)

    assert stats.kstest(inner, conditional_cdf).pvalue > 1e-3
    # The test must be able to fail: the same samples against the other temperature's CDF are rejected.
    other = HardConcrete(beta=2 / 3 if beta == 0.33 else 0.33)
    q0, q1 = float(other.p_closed(torch.tensor(log_alpha))), float(other.p_one(torch.tensor(log_alpha)))
    assert stats.kstest(inner, lambda x: (other.cdf(torch.as_tensor(x), log_alpha).numpy() - q0) / (1 - q0 - q1)
                        ).pvalue < 1e-6


@pytest.mark.parametrize("log_alpha", [-2.0, 0.0, 0.7, 3.0])
def test_p_closed_is_exactly_the_noise_threshold(log_alpha):
    """g = 0 exactly when u <= sigmoid(beta log(-gamma/zeta) - log_alpha) = P(g = 0)."""
    hc = HardConcrete()
    threshold = hc.noise_threshold_closed(log_alpha)
    # exact: P(g = 0) is that threshold's probability under U(0, 1) (float64 sigmoid, same formula order)
    assert float(hc.p_closed(torch.tensor(log_alpha, dtype=torch.float64))) == pytest.approx(threshold, rel=1e-14)
    la = torch.tensor([log_alpha], dtype=torch.float64)
    below = torch.tensor([threshold * (1 - 1e-9)], dtype=torch.float64)
    above = torch.tensor([threshold * (1 + 1e-9)], dtype=torch.float64)
    assert float(hc.sample_from_noise(la, below)) == 0.0
    assert float(hc.sample_from_noise(la, above)) > 0.0
    # and P(g > 0) is the penalty's summand
    assert float(hc.p_open(la)) + float(hc.p_closed(la)) == pytest.approx(1.0, abs=1e-15)  # other: two sigmoids


def test_penalty_is_the_expected_number_of_open_gates():
    hc = HardConcrete()
    la = torch.tensor([-3.0, -0.5, 0.0, 2.0, 4.0], dtype=torch.float64)
    samples = torch.stack([hc.sample(la, torch.Generator().manual_seed(s)) for s in range(20_000)])
    open_rate = (samples > 0).double().mean(0)
    # statistical: 20000 Bernoulli draws per gate, 5 standard errors
    se = torch.sqrt(hc.p_open(la) * (1 - hc.p_open(la)) / 20_000)
    assert torch.all((open_rate - hc.p_open(la)).abs() < 5 * se + 1e-12)
    expected = sum(1 / (1 + math.exp(-(v - 0.33 * math.log(0.1 / 1.1)))) for v in la.tolist())
    assert float(hc.penalty(la)) == pytest.approx(expected, rel=1e-14)  # other: summation order


def test_closing_rules():
    hc = HardConcrete()
    # test-time gate is 0 iff sigmoid(log_alpha) <= 0.1 / 1.2, i.e. log_alpha <= log(1/11)
    edge = math.log(1 / 11)
    la = torch.tensor([edge - 1e-6, edge + 1e-6, 0.0], dtype=torch.float64)
    assert hc.closed(la, "test_gate").tolist() == [True, False, False]
    # Voita's rule: P(g=0) > P(g=1); with the symmetric stretch that is log_alpha < 0
    la = torch.tensor([-1e-3, 1e-3], dtype=torch.float64)
    assert hc.closed(la, "larger_probability").tolist() == [True, False]
    with pytest.raises(ValueError):
        hc.closed(la, "nope")


# -- training on the real classifier adapter ------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_factory(tiny_bert_dir, tiny_dev_tsv):
    def make():
        family = model_family("hf_classifier")
        return family.load(ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager"),
                           ClassifierData(path=str(tiny_dev_tsv)), RuntimeOptions(batch_size=8, seed=0))
    return make


def settings(lam, steps=30, **kw):
    """The ``l0`` section and one trial's lambda, as a trainer takes them (``L0Trainer(adapter, *settings(...))``)."""
    return L0Section(steps=steps, lr=kw.pop("lr", 0.3), seed=kw.pop("seed", 1), **kw), lam


def test_lambda_zero_keeps_every_head_open(adapter_factory):
    trainer = L0Trainer(adapter_factory(), *settings(0.0))
    trainer.train()
    rows = trainer.gate_rows()
    assert len(rows) == 8 and not any(r["closed"] for r in rows) and trainer.closed_heads() == []
    assert all(r["step"] == 30 for r in rows)


def test_large_lambda_closes_every_head_and_the_mask_equals_zeroed_w_o(adapter_factory):
    adapter = adapter_factory()
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    trainer = L0Trainer(adapter, *settings(50.0, steps=40))
    history = trainer.train()
    assert history[-1].expected_open < history[0].expected_open
    closed = trainer.closed_heads()
    assert len(closed) == 8
    # train: gates leaves the model's weights untouched
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items())
    # Half the heads closed (a partial mask is the stronger check): through headsweep vs zeroed W_O columns.
    mask = closed[::2]
    [out] = adapter.evaluate([mask])
    reference = zeroed_copy(adapter.model, mask)
    expected = torch.empty(len(adapter.labels), 2)
    with torch.no_grad():
        for idx, inputs in adapter.batches:  # batches hold examples sorted by length; idx says which
            expected[idx] = reference(**inputs).logits.float()
    [logits] = adapter.logits([mask])
    # summation order: the reuse path restarts at the first gated layer with batched masks
    assert_routes_agree(logits, expected, depth=2, width=64)
    assert max_difference(adapter.logits([[]])[0], expected) > 1e-3  # the mask does change the model
    assert out.stats[:, 0].tolist() == [float(v) for v in (expected.argmax(-1) == adapter.labels).tolist()]


def test_intermediate_lambda_closes_some_heads_and_orders_by_lambda(adapter_factory):
    counts = []
    for lam in (0.0, 0.05, 50.0):
        trainer = L0Trainer(adapter_factory(), *settings(lam, steps=40))
        trainer.train()
        counts.append(len(trainer.closed_heads()))
    assert counts[0] == 0 and counts[-1] == 8 and counts == sorted(counts)


def test_a_batch_cut_for_memory_is_still_one_step(adapter_factory):
    """Loss batches cut into one-row pieces (the backward pass's memory budget) train as the whole batches do: one
    step per evaluation batch, the pieces' gradients summed; the same trajectory up to summation order."""
    whole = L0Trainer(adapter_factory(), *settings(0.2, steps=12))
    cut_adapter = adapter_factory()
    cut_adapter.backward_budget = 1
    cut = L0Trainer(cut_adapter, *settings(0.2, steps=12))
    assert len(cut.batches) == len(whole.batches) and sum(len(g) for g in cut.batches) > len(cut.batches)
    history_whole, history_cut = whole.train(), cut.train()
    for a, b in zip(history_whole, history_cut, strict=True):
        assert b.task_loss == pytest.approx(a.task_loss, rel=1e-5)
    for key in whole.log_alpha:
        # float32 gradients of other row counts, summed: the trajectories agree to float32 rounding
        torch.testing.assert_close(cut.log_alpha[key], whole.log_alpha[key], rtol=1e-4, atol=1e-5)


def test_resumed_trainer_matches_an_uninterrupted_one(adapter_factory):
    whole = L0Trainer(adapter_factory(), *settings(0.2, steps=12, train="all", lr=0.05))
    whole.train()
    first = L0Trainer(adapter_factory(), *settings(0.2, steps=12, train="all", lr=0.05))
    first.train(5)
    state = first.state_dict()
    second = L0Trainer(adapter_factory(), *settings(0.2, steps=12, train="all", lr=0.05))
    second.load_state_dict(state)
    second.train()
    for key in whole.log_alpha:
        # bit-identical: the same ops in the same order, noise seeded per step
        assert torch.equal(whole.log_alpha[key], second.log_alpha[key])
    assert all(torch.equal(a, b) for a, b in zip(whole.model.state_dict().values(),
                                                 second.model.state_dict().values(), strict=True))
    # train: all did move the weights
    assert not torch.equal(adapter_factory().model.state_dict()["classifier.weight"],
                           whole.model.state_dict()["classifier.weight"])


def test_bad_settings_are_refused(adapter_factory):
    adapter = adapter_factory()
    for bad, words in [(settings(-1.0), "lambda must be >= 0"), (settings(0.1, steps=0), "l0.steps"),
                       (settings(0.1, train="some"), "l0.train")]:
        with pytest.raises(HeadsweepError, match=words):
            L0Trainer(adapter, *bad)


def test_only_the_named_attention_types_get_gates(adapter_factory):
    with pytest.raises(HeadsweepError, match="names no attention type"):
        L0Trainer(adapter_factory(), *settings(0.1, attention=["enc_self"]))
    assert {r["attention"] for r in L0Trainer(adapter_factory(), *settings(0.1, attention=["self"])).gate_rows()
            } == {"self"}
    assert Head("self", 0, 0) in [Head(r["attention"], r["layer"], r["head"])
                                  for r in L0Trainer(adapter_factory(), *settings(0.1)).gate_rows()]


# -- the l0 experiment through the real CLI (Ray Tune trials, Parquet, DuckDB) -----------------------------------
def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


@pytest.fixture(scope="module")
def train_tsv(tmp_path_factory):
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    return write_tsv(generate(24, seed=11), tmp_path_factory.mktemp("l0data") / "train.tsv")


def l0_config(path, model_dir, dev, train, **l0):
    import yaml

    cfg = {
        "name": "l0-test",
        "model": {"kind": "hf_classifier", "path": str(model_dir), "attn_implementation": "eager"},
        "data": {"path": str(dev)},
        "sweep": {"experiments": ["l0"], "batch_size": 8, "workers": 1},
        "significance": {"tests": ["paired_ttest"]},
        "l0": {"data": {"path": str(train)}, "lambdas": [0.0, 50.0], "steps": 40, "lr": 0.3, "seed": 1,
               "checkpoint_every": 10, **l0},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_killing_one_trial(config, store, ray_address, steps):
    """Run the CLI; SIGKILL the first trial's process once it has a checkpoint and 40+ steps to go.

    Returns the finished process and the step the trial had reported when it was killed.
    """
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(config), "--store", str(store),
                             "--address", ray_address, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    killed = None
    deadline = time.monotonic() + 240
    try:
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            for results in store.glob("tune/*/l0/*/result.json"):
                if not list(results.parent.glob("checkpoint_*")):
                    continue
                lines = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
                if lines and lines[-1]["step"] < steps - 40:
                    killed = (results, lines[-1]["step"])
                    os.kill(lines[-1]["pid"], signal.SIGKILL)  # the trial's own process, as it reported it
                    break
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err, killed


def test_two_lambda_tune_run_through_the_cli_with_a_killed_trial(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv,
                                                                 train_tsv):
    """Two trials (lambda 0 and 50) on a tiny BERT through the CLI; one trial's process is SIGKILLed after its
    first checkpoint: Tune restarts it there (FailureConfig) and it ends with the gates of an uninterrupted
    training with the same seed. Read back with DuckDB."""
    import json

    import duckdb
    import yaml

    steps = 150
    store = tmp_path / "store"
    config = l0_config(tmp_path / "l0.yaml", tiny_bert_dir, tiny_dev_tsv, train_tsv, steps=steps, lr=0.1)
    cfg = yaml.safe_load(config.read_text())
    # gradient-importance pruning in the same run: its curve goes beside the L0 one
    cfg["sweep"]["experiments"] = ["importance", "prune_level", "l0"]
    cfg["importance"] = {"data": {"path": str(train_tsv)}}
    cfg["prune"] = {"levels": [0.0, 0.5, 1.0]}
    config.write_text(yaml.safe_dump(cfg))
    code, out, err, killed = run_killing_one_trial(config, store, ray_address, steps)
    assert killed is not None, "no trial could be killed before it finished"
    assert code == 0, err[-3000:]
    run_id = out.strip().splitlines()[-1]
    reports = [json.loads(x) for x in killed[0].read_text().splitlines() if x.strip()]
    first_pid, killed_step = reports[0]["pid"], killed[1]
    restarted = [r["step"] for r in reports if r["pid"] != first_pid]
    # Tune restarted the trial in a new process, from a checkpoint (every 10 steps) at or before the step it
    # was killed at, not from scratch, and it ran to the end.
    assert len({r["pid"] for r in reports}) == 2 and restarted and restarted[-1] == steps
    # (the first report after resuming from checkpoint c is at most 7 steps later; the process may have passed
    # one more checkpoint between the test reading its report and the kill landing)
    assert 10 < restarted[0] <= killed_step + 20
    con = duckdb.connect()
    gates = con.sql(f"SELECT l0_lambda, attention, layer, head, log_alpha, p_open, closed, step, train FROM "
                    f"{duck(store, 'gates')} WHERE run_id = '{run_id}' ORDER BY l0_lambda, layer, head").fetchall()
    assert len(gates) == 16 and {g[7] for g in gates} == {steps} and {g[8] for g in gates} == {"gates"}
    assert not any(g[6] for g in gates if g[0] == 0.0) and all(g[6] for g in gates if g[0] == 50.0)
    for lam in (0.0, 50.0):
        # The same training in this process, uninterrupted (same seed and data).
        trainer = L0Trainer(model_family("hf_classifier").load(
            ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager"),
            ClassifierData(path=str(train_tsv)), RuntimeOptions(batch_size=8, seed=0, reuse=False)),
            *settings(lam, steps=steps, lr=0.1))
        trainer.train()
        # other: the same float32 computation in another process with its own thread count (reduction order)
        assert [g[4] for g in gates if g[0] == lam] == pytest.approx([r["log_alpha"] for r in trainer.gate_rows()],
                                                                     rel=1e-4, abs=1e-5)
    evals = con.sql(f"SELECT eval_id, experiment, n_masked, level, score, baseline_score, delta FROM "
                    f"{duck(store, 'evaluations')} WHERE run_id = '{run_id}' ORDER BY eval_id").fetchall()
    by_id = {e[0]: e for e in evals}
    assert {e for e in by_id if not e.startswith("prune_level/")} == {
        "baseline", "l0_gates/global/0.0", "l0_gates/global/50.0"}
    assert by_id["l0_gates/global/0.0"][2] == 0 and by_id["l0_gates/global/0.0"][6] == 0.0
    assert by_id["l0_gates/global/50.0"][2] == 8 and by_id["l0_gates/global/50.0"][3] == 1.0
    sig = con.sql(f"SELECT eval_id, test FROM {duck(store, 'significance')} WHERE run_id = '{run_id}' "
                  "AND eval_id LIKE 'l0_gates/%'").fetchall()
    assert sorted(sig) == [("l0_gates/global/0.0", "paired_ttest"), ("l0_gates/global/50.0", "paired_ttest")]
    # The pruning view: both curves at the same numbers of heads masked (0 and 8 of 8 here).
    from headsweep.results.query import run_query
    from headsweep.results.store import ResultStore
    from headsweep.sweep.reporting.report import write_report

    curve = run_query(ResultStore(str(store)), "SELECT method, scope, n_masked, l0_lambda, score FROM pruning "
                      "ORDER BY method, n_masked").to_pylist()
    assert [(r["method"], r["scope"], r["n_masked"], r["l0_lambda"]) for r in curve] == [
        ("importance", "global", 0, None), ("importance", "global", 4, None), ("importance", "global", 8, None),
        ("l0", "global", 0, 0.0), ("l0", "global", 8, 50.0)]
    # no head masked: the baseline on both curves; all masked: the same model whichever method chose the heads
    assert curve[0]["score"] == curve[3]["score"] and curve[2]["score"] == curve[4]["score"]
    page = write_report(ResultStore(str(store)), [run_id], tmp_path / "report")
    assert "L0 gates, global" in page.read_text() and (page.parent / f"{run_id}-pruning.png").is_file()
    # Tune's experiment lives beside the tables, and the trials' live metrics are in it.
    progress = list((store / "tune" / f"run_id={run_id}" / "l0").glob("*/progress.csv"))
    assert len(progress) == 2 and all("expected_open" in p.read_text().splitlines()[0] for p in progress)


# -- train: all: the fine-tuned weights evaluated by the run's workers ------------------------------------------------
def test_a_unit_with_weights_evaluates_a_model_holding_them(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """A worker evaluating units that name ``weights`` (a state dict file) gives what an adapter loaded from a
    save_pretrained folder of that model gives (the independent route); units without weights keep the loaded
    model, in the same call."""
    import shutil

    import numpy as np
    import ray

    from headsweep.workers.actor.eval_worker import EvalWorker
    from headsweep.workers.core.work import WorkUnit

    model_cfg = ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager")
    data_cfg = ClassifierData(path=str(tiny_dev_tsv))
    runtime = RuntimeOptions(batch_size=8, seed=0, threads=1)
    family = model_family("hf_classifier")
    original = family.load(model_cfg, data_cfg, runtime)
    perturbed = family.load(model_cfg, data_cfg, runtime).model
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    weights = tmp_path / "weights.pt"
    torch.save(perturbed.state_dict(), weights)
    folder = tmp_path / "perturbed"
    shutil.copytree(tiny_bert_dir, folder)  # the tokenizer files; the model's are overwritten
    perturbed.save_pretrained(folder)
    independent = family.load(ClassifierModel(path=str(folder), attn_implementation="eager"), data_cfg, runtime)

    head = Head("self", 1, 2)
    units = [WorkUnit("plain", "x", ()), WorkUnit("tuned", "x", (), weights=str(weights)),
             WorkUnit("tuned-masked", "x", (head,), weights=str(weights)), WorkUnit("plain-masked", "x", (head,)),
             WorkUnit("tuned-subset", "x", (head,), examples=(3, 7, 20), weights=str(weights))]
    worker = EvalWorker.options(num_cpus=1).remote("w", "hf_classifier", model_cfg, data_cfg, runtime)
    try:
        ray.get(worker.load.remote())
        got = dict(ray.get(worker.evaluate.remote(units)))
    finally:
        ray.kill(worker)
    expected = dict(zip(["tuned", "tuned-masked"], independent.evaluate([(), (head,)]), strict=True))
    expected.update(zip(["plain", "plain-masked"], original.evaluate([(), (head,)]), strict=True))
    for eval_id, out in expected.items():
        # exact: the same weights (a float32 file round trip), kernels and batches in both routes
        np.testing.assert_array_equal(got[eval_id].stats, out.stats)
        np.testing.assert_array_equal(got[eval_id].loss, out.loss)
        assert got[eval_id].score == out.score
    subset = expected["tuned-masked"]
    np.testing.assert_array_equal(got["tuned-subset"].stats, subset.stats[[3, 7, 20]])
    # summation order: the subset's batches hold other examples, padded to other lengths
    assert_routes_agree(got["tuned-subset"].loss, subset.loss[[3, 7, 20]], depth=2, width=64)
    assert max_difference(got["tuned"].loss, got["plain"].loss) > 1e-3  # the weights do change the model


def test_train_all_through_the_cli_evaluates_each_trials_fine_tuned_model(tmp_path, ray_address, tiny_bert_dir,
                                                                          tiny_dev_tsv, train_tsv):
    """``l0.train: all``, two lambdas: the gates rows say ``all``, each ``l0_gates`` row is the trial's fine-tuned
    model with its closed heads masked (the same training and evaluation in this process), compared with the
    original model's baseline (its score, and the significance test on its per-example statistics)."""
    import duckdb
    import numpy as np
    import yaml
    from conftest import run_cli

    store = tmp_path / "store"
    steps = 60
    config = l0_config(tmp_path / "l0.yaml", tiny_bert_dir, tiny_dev_tsv, train_tsv, steps=steps, lr=0.1,
                       checkpoint_every=30)
    cfg = yaml.safe_load(config.read_text())
    cfg["l0"]["train"] = "all"  # (l0_config's own ``train`` is the training data)
    config.write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]
    con = duckdb.connect()
    gates = con.sql(f"SELECT l0_lambda, layer, head, closed, train FROM {duck(store, 'gates')} "
                    "ORDER BY l0_lambda, layer, head").fetchall()
    assert len(gates) == 16 and {g[4] for g in gates} == {"all"}
    evals = {e[0]: e for e in con.sql(
        f"SELECT eval_id, score, baseline_score, n_masked FROM {duck(store, 'evaluations')}").fetchall()}
    assert set(evals) == {"baseline", "l0_gates/global/0.0", "l0_gates/global/50.0"}
    losses = {}
    for eval_id, loss in con.sql(f"SELECT eval_id, list(loss ORDER BY example_id) FROM {duck(store, 'examples')} "
                                 "GROUP BY eval_id").fetchall():
        losses[eval_id] = np.array(loss)
    ids = [r[0] for r in con.sql(f"SELECT DISTINCT example_id FROM {duck(store, 'examples')} ORDER BY example_id"
                                 ).fetchall()]
    assert con.sql(f"SELECT count(*) FROM {duck(store, 'significance')} WHERE eval_id LIKE 'l0_gates/%'"
                   ).fetchall() == [(2,)]
    model_cfg = ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager")
    evaluator = model_family("hf_classifier").load(model_cfg, ClassifierData(path=str(tiny_dev_tsv)),
                                                   RuntimeOptions(batch_size=8, seed=0))
    order = np.argsort(evaluator.describe().example_ids)
    assert [evaluator.describe().example_ids[i] for i in order] == ids
    for lam in (0.0, 50.0):
        row = evals[f"l0_gates/global/{lam!r}"]
        assert row[2] == evals["baseline"][1]  # the original model is the baseline of every row
        # The same training in this process (same seed, data and steps), then its model evaluated here.
        trainer = L0Trainer(model_family("hf_classifier").load(
            model_cfg, ClassifierData(path=str(train_tsv)), RuntimeOptions(batch_size=8, seed=0, reuse=False)),
            *settings(lam, steps=steps, lr=0.1, train="all"))
        trainer.train()
        mask = trainer.closed_heads()
        assert sorted((g[1], g[2]) for g in gates if g[0] == lam and g[3]) == [(h.layer, h.head) for h in mask]
        assert row[3] == len(mask) == (0 if lam == 0.0 else 8)
        evaluator.model.load_state_dict(trainer.model.state_dict())
        [out] = evaluator.evaluate([mask])
        # other: the same float32 training in another process with its own thread count (reduction order),
        # 60 Adam updates of every weight
        assert losses[f"l0_gates/global/{lam!r}"] == pytest.approx(out.loss[order], rel=1e-4, abs=1e-5)
        assert row[1] == pytest.approx(out.score, abs=1e-12)
        # the fine-tuned model is not the original one
        assert max_difference(losses[f"l0_gates/global/{lam!r}"], losses["baseline"]) > 1e-3
    # the fine-tuned weights stay in the run's Tune folder
    assert sorted(p.name for p in (store / "tune" / f"run_id={run_id}" / "l0-weights").iterdir()) == [
        "lambda-0.0.pt", "lambda-50.0.pt"]


# -- bad input ----------------------------------------------------------------------------------------------------
def l0_cfg(dev, **l0):
    return {"model": {"kind": "hf_classifier", "path": "m"}, "data": {"path": str(dev)},
            "sweep": {"experiments": ["l0"]}, "l0": {"data": {"path": "train.tsv"}, **l0}}


@pytest.mark.parametrize("l0, words", [
    ({"lambdas": [0.1, -0.5]}, "each value of l0.lambdas must be at least 0, got -0.5"),
    ({"steps": 0}, "l0.steps must be at least 1"),
    ({"data": None}, "l0 needs l0.data"),
    ({"data": {"path": "data/test.tsv"}}, "looks like a test split"),
    ({"lambdas": []}, "at least one penalty weight"),
    ({"train": "some"}, "l0.train must be gates or all, got 'some'"),
    ({"train": "all", "model_lr": 0}, "l0.model_lr must be positive, got 0"),
    ({"model_lr": 1e-4}, "l0.model_lr is the learning rate of the model's weights under l0.train: all"),
    ({"closing": "majority"}, "l0.closing"),
])
def test_bad_l0_configs_are_refused_in_one_line(l0, words):
    from headsweep.sweep.configuration.config import build_config

    with pytest.raises(HeadsweepError, match=words.replace("(", r"\(")) as err:
        build_config(l0_cfg("dev.tsv", **l0))
    assert "\n" not in str(err.value)


def test_evaluation_set_as_training_data_fails_the_cli_and_writes_nothing(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    from conftest import error_line, run_cli

    from headsweep.results.store import ResultStore

    store = tmp_path / "store"
    config = l0_config(tmp_path / "l0.yaml", tiny_bert_dir, tiny_dev_tsv, tiny_dev_tsv)
    proc = run_cli("run", str(config), "--store", str(store))
    assert proc.returncode == 2 and "l0.data is the evaluation set" in error_line(proc.stderr)
    assert ResultStore(str(store)).read("runs").num_rows == 0 and not (store / "tune").exists()


# -- fairseq translation and causal LMs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_translation(trained_tiny_fairseq):
    return trained_tiny_fairseq


def test_fairseq_gates_on_encoder_self_attention_with_the_checkpoints_label_smoothing(tiny_translation):
    from tiny_fairseq import TINY_SETTINGS

    from headsweep.sweep.experiments.l0.training import checkpoint_label_smoothing
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    model_cfg = TranslationModel(checkpoint=str(tiny_translation.checkpoint),
                                 data_bin=str(tiny_translation.data.data_bin))
    # the value fairseq-train stored in the checkpoint's criterion options
    assert checkpoint_label_smoothing(model_cfg) == TINY_SETTINGS.label_smoothing
    assert checkpoint_label_smoothing(ClassifierModel(path="x")) is None

    def make(lam):
        adapter = model_family("fairseq_translation").load(
            model_cfg, TranslationData(data_bin=str(tiny_translation.data.data_bin), split="valid"),
            TranslationRuntime(batch_size=20, max_tokens=0))
        return L0Trainer(adapter, *settings(lam, steps=40, attention=["enc_self"],
                                           label_smoothing=checkpoint_label_smoothing(model_cfg)))

    keep, close = make(0.0), make(50.0)
    assert "epsilon 0.1" in keep.loss_name
    before = {k: v.clone() for k, v in close.model.state_dict().items()}
    keep.train()
    close.train()
    assert {(r["attention"], r["layer"]) for r in close.gate_rows()} == {("enc_self", 0), ("enc_self", 1)}
    assert keep.closed_heads() == [] and len(close.closed_heads()) == 8
    assert all(torch.equal(before[k], v) for k, v in close.model.state_dict().items())


def test_causal_lm_gates(tmp_path):
    from tiny_models import lm_text, save_tiny_causal_lm

    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama_8q2kv")
    (tmp_path / "train.txt").write_text(lm_text(120, seed=4))

    def make(lam):
        adapter = model_family("hf_causal_lm").load(
            CausalLMModel(path=str(model_dir), attn_implementation="eager"),
            CausalLMData(path=str(tmp_path / "train.txt")), RuntimeOptions(batch_size=4))
        return L0Trainer(adapter, *settings(lam, steps=40))

    # The loss of a window sums its tokens' NLL (~235 here), so "large" is larger than for a classifier;
    # lambda = 0 may close heads of this random model that raise its loss, so only "fewer" is asserted.
    keep, close = make(0.0), make(5000.0)
    first = keep.train_step()
    keep.train()
    close.train()
    n = sum(s.num_heads for s in close.sites)
    assert n == 16 and len(keep.closed_heads()) < n and len(close.closed_heads()) == n
    assert keep.train_step().task_loss < first.task_loss
    assert first.task_loss > 0 and math.isfinite(first.task_loss)


# fairseq gates in-process: test_fairseq_gates_on_encoder_self_attention_with_the_checkpoints_label_smoothing;
# Tune through the CLI: the killed-trial test
@pytest.mark.slow
def test_two_lambda_tune_run_on_fairseq_through_the_cli(tmp_path, ray_address, tiny_translation):
    import duckdb
    import yaml
    from conftest import run_cli

    data_bin = str(tiny_translation.data.data_bin)
    cfg = {
        "name": "l0-fairseq",
        "model": {"kind": "fairseq_translation", "checkpoint": str(tiny_translation.checkpoint), "data_bin": data_bin,
                  "beam": 2},
        "data": {"source": str(tiny_translation.data.test_source), "target": str(tiny_translation.data.test_target)},
        "sweep": {"experiments": ["l0"], "batch_size": 20, "workers": 1},
        "significance": {"tests": ["paired_bootstrap"], "n_resamples": 100},
        "l0": {"data": {"data_bin": data_bin, "split": "valid"}, "lambdas": [0.0, 50.0], "steps": 40, "lr": 0.3,
               "seed": 1, "checkpoint_every": 20, "attention": ["enc_self"]},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]
    con = duckdb.connect()
    gates = con.sql(f"SELECT l0_lambda, attention, closed FROM {duck(store, 'gates')} WHERE run_id = '{run_id}'"
                    ).fetchall()
    assert len(gates) == 16 and {g[1] for g in gates} == {"enc_self"}
    assert sum(g[2] for g in gates if g[0] == 0.0) == 0 and sum(g[2] for g in gates if g[0] == 50.0) == 8
    evals = dict(con.sql(f"SELECT eval_id, attention || ' ' || n_masked || ' ' || metric FROM "
                         f"{duck(store, 'evaluations')} WHERE experiment = 'l0_gates'").fetchall())
    assert evals == {"l0_gates/enc_self/0.0": "enc_self 0 bleu", "l0_gates/enc_self/50.0": "enc_self 8 bleu"}



@pytest.mark.slow  # Tune failures and restarts through the CLI: the killed-trial test
def test_a_trial_that_fails_its_retries_fails_the_run_naming_its_lambda(tmp_path, ray_address, tiny_bert_dir,
                                                                          tiny_dev_tsv, train_tsv):
    """lambda = 1e308 overflows the loss: that trial fails (no retries left), the run fails with one line naming
    it, and the other trial's gates and evaluation are stored."""
    import duckdb
    from conftest import error_line, run_cli

    store = tmp_path / "store"
    config = l0_config(tmp_path / "l0.yaml", tiny_bert_dir, tiny_dev_tsv, train_tsv, lambdas=[0.0, 1e308], steps=5)
    proc = run_cli("run", str(config), "sweep.max_retries=0", "--store", str(store), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "trial of lambda=1e+308 failed" in line and "loss is not finite" in line, line
    con = duckdb.connect()
    assert con.sql(f"SELECT DISTINCT l0_lambda FROM {duck(store, 'gates')}").fetchall() == [(0.0,)]
    assert con.sql(f"SELECT eval_id FROM {duck(store, 'evaluations')} WHERE experiment = 'l0_gates'"
                   ).fetchall() == [("l0_gates/global/0.0",)]
    assert con.sql(f"SELECT status FROM {duck(store, 'runs')}").fetchall() == [("failed",)]


def test_empty_training_data_fails_before_anything_is_written(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    from conftest import error_line, run_cli

    from headsweep.results.store import ResultStore

    empty = tmp_path / "train.tsv"
    empty.write_text("sentence\tlabel\n")
    store = tmp_path / "store"
    config = l0_config(tmp_path / "l0.yaml", tiny_bert_dir, tiny_dev_tsv, empty)
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "train.tsv" in line or "l0.data" in line, line
    assert ResultStore(str(store)).read("runs").num_rows == 0 and not (store / "tune").exists()
