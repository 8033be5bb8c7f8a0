"""Sequential screening: ``sweep.screen``.

- The subset: an adapter on chosen positions gives, for every family, exactly the full evaluation's rows at
  those positions, and the subset's and the rest's outputs joined give the whole set's (the independent
  route: the whole-set evaluation of the same mask).
- The rules on hand-built statistics with known answers; the futility rule's cut by hand and its promised
  miss rate at the significance boundary checked by Monte Carlo over random subsets.
- Through the real CLI on a constructed classifier whose answer is known (some heads have their output
  projection zeroed, so masking them changes nothing; labels are the model's own predictions, so a head that
  matters costs accuracy): every head the full run finds significant is completed, with the full run's
  values; the zeroed heads are screened out; the rows, examples and significance family say so; and a
  budgeted screened run resumes to the tables of an uninterrupted one.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest
import yaml
from conftest import error_line, run_cli

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.run.screening import ScreenSettings, complement, joined, verdicts
from headsweep.sweep.statistics.significance import adjust_pvalues
from headsweep.workers.core.heads import Head
from headsweep.workers.data.example_subset import at_positions


# -- the subset ---------------------------------------------------------------------------------------------------
def test_positions_are_a_seeded_sorted_sample():
    s = ScreenSettings(fraction=0.2, equivalence=0.01, confidence=0.99, n_resamples=1000, seed=4)
    first = s.positions(101)
    assert len(first) == 21 and list(first) == sorted(set(first)) and 0 <= first[0] and first[-1] < 101
    assert s.positions(101) == first and ScreenSettings(0.2, 0.01, 0.99, 1000, 5).positions(101) != first
    with pytest.raises(HeadsweepError, match="is 8 examples, fewer than 20"):
        s.check_size(40)
    with pytest.raises(HeadsweepError, match="is every example"):
        ScreenSettings(0.99, 0.01, 0.99, 1000, 0).check_size(50)


def test_at_positions_keeps_per_example_lists_and_other_fields():
    from headsweep.workers.families.fairseq_translation.data import ParallelExamples

    ex = ParallelExamples(name="x", ids=["0", "1", "2"], source=[[1], [2], [3]], target=[[4], [5], [6]],
                          references=["a", "b", "c"], unk_rate_source=0.5, unk_rate_target=0.0,
                          source_file="s", target_file="t")
    sub = at_positions(ex, (0, 2))
    assert sub.ids == ["0", "2"] and sub.source == [[1], [3]] and sub.references == ["a", "c"]
    assert sub.name == "x" and sub.unk_rate_source == 0.5
    assert at_positions(["a", "b", "c"], (1,)) == ["b"] and at_positions(ex, None) is ex
    with pytest.raises(HeadsweepError, match="position 3 is outside the evaluation set of 3 examples"):
        at_positions(ex, (3,))


def subset_matches_full(load, model_cfg, data_cfg, masks, positions, **runtime):
    """The adapter on ``positions`` against the whole-set adapter, mask by mask; and the subset's and the rest's
    outputs joined against the whole set's."""
    # the translation family's options (a subclass) carry max_tokens for the translation case
    from headsweep.workers.families.fairseq_translation.config import TranslationRuntime as RuntimeOptions

    whole_set = load(model_cfg, data_cfg, RuntimeOptions(**runtime))
    metric = whole_set.describe().metric
    full = whole_set.evaluate(masks)
    part = load(model_cfg, data_cfg, RuntimeOptions(**runtime, examples=positions)).evaluate(masks)
    rest = complement(positions, len(full[0].outputs))
    rest_part = load(model_cfg, data_cfg, RuntimeOptions(**runtime, examples=rest)).evaluate(masks)
    for f, p, r in zip(full, part, rest_part, strict=True):
        assert p.stats.shape[0] == len(positions)
        np.testing.assert_array_equal(p.stats, f.stats[list(positions)])
        assert p.outputs == [f.outputs[i] for i in positions]
        # completing a screened mask: the subset and the rest joined are the whole-set evaluation
        whole = joined(metric, p, positions, r, rest)
        np.testing.assert_array_equal(whole.stats, f.stats)
        assert whole.outputs == f.outputs and whole.score == f.score
        if f.loss is not None:  # float32 losses of padded batches: other batch-mates, other rounding
            np.testing.assert_allclose(whole.loss, f.loss, rtol=1e-5, atol=1e-5)


def test_subset_adapters_equal_the_full_evaluation_at_their_positions(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    from tiny_fairseq import train_tiny
    from tiny_models import lm_text, save_tiny_causal_lm

    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    positions = (1, 4, 5, 11, 30, 39)
    subset_matches_full(load_classifier, ClassifierModel(path=str(tiny_bert_dir)),
                        ClassifierData(path=str(tiny_dev_tsv)),
                        [(), (Head("self", 0, 1),), (Head("self", 1, 2), Head("self", 0, 0))], positions,
                        batch_size=7)
    tiny = train_tiny(tmp_path / "fairseq")
    subset_matches_full(load_translation, TranslationModel(checkpoint=str(tiny.checkpoint),
                                                           data_bin=str(tiny.data.data_bin)),
                        TranslationData(data_bin=str(tiny.data.data_bin), split="test"),
                        [(), (Head("enc_self", 0, 1),), (Head("enc_dec", 1, 3),)], positions, batch_size=8,
                        max_tokens=0)
    lm_dir = save_tiny_causal_lm(tmp_path / "lm")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(lm_text(900))
    subset_matches_full(load_causal_lm_adapter, CausalLMModel(path=str(lm_dir)),
                        CausalLMData(path=str(corpus), window=16), [(), (Head("self", 1, 3),)], (0, 2, 3), batch_size=4)


# -- the rule -----------------------------------------------------------------------------------------------------
def accuracy_stats(correct: list[int]) -> np.ndarray:
    """Per-example accuracy statistics (correct, 1)."""
    return np.array([[c, 1.0] for c in correct])


def test_the_rule_on_hand_built_cases():
    base = accuracy_stats([1] * 80 + [0] * 20)
    same = base.copy()
    harmful = accuracy_stats([1] * 40 + [0] * 60)  # 40 points worse: far outside any small margin
    one_flip = accuracy_stats([1] * 79 + [0] * 21)  # one point worse on 100 examples: inside a 5-point margin
    s = ScreenSettings(0.2, 0.05, 0.99, 1000, 0)
    v_same, v_harm, v_flip = verdicts("accuracy", base, np.stack([same, harmful, one_flip]), s)
    assert (v_same.ci_low, v_same.ci_high, v_same.screened_out) == (0.0, 0.0, True)
    assert v_harm.ci_low < -0.4 < v_harm.ci_high < -0.2 and not v_harm.screened_out
    assert -0.05 <= v_flip.ci_low <= -0.01 and v_flip.ci_high == 0.0 and v_flip.screened_out
    # a margin below what one flip costs keeps it
    [tight] = verdicts("accuracy", base, one_flip[None], ScreenSettings(0.2, 0.005, 0.99, 1000, 0))
    assert not tight.screened_out


def test_the_rule_follows_the_settings_given():
    # no setting is required: futility on 40% of the examples; a margin alone means the equivalence rule
    assert ScreenSettings.from_config({}, 3) == ScreenSettings(0.4, None, 0.99, 1000, 3, "futility", 0.05, 0.01)
    assert ScreenSettings.from_config({"equivalence": 0.5}, 3).rule == "equivalence"
    assert ScreenSettings.from_config({"equivalence": 0.5}, 3).fraction == 0.2
    assert ScreenSettings.from_config(None, 3) is None


def test_joined_places_each_part_at_its_positions():
    from headsweep.workers.core.family import MaskOutput

    first = MaskOutput(accuracy_stats([1, 0]), np.array([0.1, 0.2]), ["a", "b"], 0.5, 1.0)
    rest = MaskOutput(accuracy_stats([1, 1, 0]), None, ["c", "d", "e"], 2 / 3, 2.0)
    whole = joined("accuracy", first, (1, 3), rest, (0, 2, 4))
    np.testing.assert_array_equal(whole.stats, accuracy_stats([1, 1, 1, 0, 0]))
    assert whole.outputs == ["c", "a", "d", "b", "e"] and whole.score == 0.6 and whole.seconds == 3.0
    assert whole.loss is None  # one part without losses: none stored, never half
    assert complement((1, 3), 5) == (0, 2, 4)
    with pytest.raises(ValueError, match="cover the evaluation set once"):
        joined("accuracy", first, (1, 3), rest, (0, 2, 3))


def test_futility_cut_by_hand():
    # k = sqrt(f) z* + sqrt(1 - f) Phi^-1(miss); miss 0.5 leaves sqrt(f) z*: 0.5 x 1.959964 (alpha 0.05, m 1)
    assert ScreenSettings(0.25, None, 0.99, 1000, 0, "futility", 0.5, 0.05).cut(1) == pytest.approx(0.979982, abs=1e-6)
    # f 0.36, miss 0.1, alpha 0.01 over 50 masks: z* = Phi^-1(1 - 1e-4) = 3.719016, Phi^-1(0.1) = -1.281552
    s = ScreenSettings(0.36, None, 0.99, 1000, 0, "futility", 0.1, 0.01)
    assert s.cut(50) == pytest.approx(0.6 * 3.719016 - 0.8 * 1.281552, abs=1e-5)
    # at the boundary the chance of screening out is miss (both tails: the far one is negligible here)
    assert s.miss_chance(50, 3.719016) == pytest.approx(0.1, abs=1e-4)
    assert s.miss_chance(50, 8.0) < 1e-4
    with pytest.raises(HeadsweepError, match="could screen out no mask: raise the fraction"):
        ScreenSettings(0.1, None, 0.99, 1000, 0, "futility", 0.05, 0.01).check_cut(8)


def flips(n: int, down: int, up: int) -> tuple[np.ndarray, np.ndarray]:
    """A baseline right on the first half and a system that loses ``down`` of those and gains ``up`` of the rest."""
    base = np.r_[np.ones(n // 2), np.zeros(n - n // 2)]
    system = base.copy()
    system[:down] = 0
    system[n // 2 : n // 2 + up] = 1
    return accuracy_stats(list(base)), accuracy_stats(list(system))


def test_futility_rule_misses_a_boundary_head_at_the_promised_rate():
    """Monte Carlo over random subsets: a head whose whole-set z sits at the Bonferroni boundary is screened out
    about ``miss`` of the time (the normal approximation's promise), a head with no net effect mostly."""
    n, m = 1000, 20
    settings = ScreenSettings(0.3, None, 0.99, 200, 0, "futility", 0.1, 0.01)
    base, boundary = flips(n, 57, 23)  # 34 net losses among 80 changes: z about 34 / sqrt(80)
    d = boundary[:, 0] - base[:, 0]
    z_full = abs(d.mean() / d.std(ddof=1) * np.sqrt(n))
    promised = settings.miss_chance(m, z_full)
    assert 3.6 < z_full < 4.2 and 0.03 < promised < 0.2  # near z* = 3.48 for 20 masks at 0.01
    _, null = flips(n, 40, 40)
    draws = 300
    out = np.zeros(2)
    for seed in range(draws):
        s = ScreenSettings(0.3, None, 0.99, 200, seed, "futility", 0.1, 0.01)
        pos = list(s.positions(n))
        v = verdicts("accuracy", base[pos], np.stack([boundary[pos], null[pos]]), s, n_masks=m)
        out += [v[0].screened_out, v[1].screened_out]
    rate, null_rate = out / draws
    assert abs(rate - promised) < 3 * np.sqrt(promised * (1 - promised) / draws) + 0.03
    k = settings.cut(m)
    assert null_rate > (2 * NormalDist().cdf(k) - 1) - 0.1  # |z_sub| ~ N(0, 1) for a head with no net effect


@pytest.mark.parametrize("screen, message", [
    ({"rule": "equivalence"}, "sweep.screen needs equivalence"),
    ({"rule": "fast"}, "unknown sweep.screen.rule 'fast'"),
    ({"rule": "futility", "equivalence": 0.01}, "sweep.screen.equivalence is the equivalence rule's margin"),
    ({"equivalence": 0.01, "miss": 0.1}, "sweep.screen.miss belongs to rule futility"),
    ({"rule": "futility", "miss": 0.5}, r"sweep.screen.miss must be between 0 and 0.5"),
    ({"equivalence": 0.01, "fraction": 0}, "sweep.screen.fraction must be between 0 and 1"),
    ({"equivalence": -1}, "sweep.screen.equivalence must be positive"),
    ({"equivalence": 0.01, "confidence": 1.0}, r"sweep.screen.confidence must be in \[0.5, 1\)"),
    ({"equivalence": 0.01, "n_resamples": 10}, "sweep.screen.n_resamples must be a whole number of at least 100"),
    ({"equivalence": 0.01, "alpha": 0.1}, "unknown key sweep.screen.alpha"),
])
def test_bad_screen_settings(tmp_path, screen, message):
    with pytest.raises(HeadsweepError, match=message):
        build_config(config(tmp_path, tmp_path / "d.tsv", screen=screen))


def test_screen_needs_single_heads_and_refuses_pairs(tmp_path):
    with pytest.raises(HeadsweepError, match="sweep.screen screens single_head masks"):
        build_config(config(tmp_path, tmp_path / "d.tsv", screen={"equivalence": 0.01}, experiments=["baseline"]))
    with pytest.raises(HeadsweepError, match="sweep.screen cannot be combined with pairs"):
        build_config(config(tmp_path, tmp_path / "d.tsv", screen={"equivalence": 0.01},
                            experiments=["single_head", "pairs"]))


# -- a constructed case through the CLI ---------------------------------------------------------------------------
ZEROED = [Head("self", 0, 1), Head("self", 0, 3), Head("self", 1, 0), Head("self", 1, 2)]


@pytest.fixture(scope="module")
def known_case(tmp_path_factory):
    """A tiny classifier with the W_O columns of ``ZEROED`` set to zero, and 300 examples labelled with its own
    predictions (baseline accuracy 1)."""
    import torch
    from tiny_models import save_tiny_classifier, zeroed_copy
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from headsweep.sweep.demo.sentiment import generate, write_tsv

    folder = tmp_path_factory.mktemp("screen_case")
    raw = save_tiny_classifier(folder / "raw")
    model = zeroed_copy(AutoModelForSequenceClassification.from_pretrained(raw).eval(), ZEROED)
    model.save_pretrained(folder / "model")
    tokenizer = AutoTokenizer.from_pretrained(raw)
    tokenizer.save_pretrained(folder / "model")
    texts = [text for text, _ in generate(300, seed=11)]
    with torch.no_grad():
        predicted = [model(**tokenizer(t, return_tensors="pt")).logits.argmax(-1).item() for t in texts]
    return folder / "model", write_tsv(list(zip(texts, predicted, strict=True)), folder / "dev.tsv")


def config(model_dir, data, experiments=("baseline", "single_head"), **sweep) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
            "sweep": {"experiments": list(experiments), "batch_size": 32, **sweep},
            "significance": {"n_resamples": 200, "seed": 5, "correction": "holm"}}


def run(tmp_path, name, cfg, ray_address, store="store"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(path), "--store", str(tmp_path / store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1], proc


def tables(tmp_path, run_id, store="store"):
    s = ResultStore(str(tmp_path / store))
    evals = {r["eval_id"]: r for r in s.read("evaluations", run_id).to_pylist()}
    sig = {(r["eval_id"], r["test"]): r for r in s.read("significance", run_id).to_pylist()}
    examples = s.read("examples", run_id, columns=["eval_id", "example_id", "stats"]).to_pylist()
    return evals, sig, examples


SCREEN = {"fraction": 0.2, "equivalence": 0.02}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_address, known_case):
    """The full grid and the screened grid of the known case, in one store: (folder, full id, screened id, stderr)."""
    model_dir, dev = known_case
    folder = tmp_path_factory.mktemp("screen_runs")
    full_id, _ = run(folder, "full", config(model_dir, dev), ray_address)
    screened_id, proc = run(folder, "screened", config(model_dir, dev, screen=SCREEN), ray_address)
    return folder, full_id, screened_id, proc.stderr


def test_screening_keeps_every_significant_head_and_screens_out_the_dead_ones(two_runs):
    tmp_path, full_id, screened_id, stderr = two_runs
    assert ("screening (equivalence: interval inside +-0.02): 4 of 8 masks screened out on 60 of 300 examples; "
            "4 go on to the rest") in stderr
    full, full_sig, _ = tables(tmp_path, full_id)
    scr, scr_sig, scr_examples = tables(tmp_path, screened_id)
    significant = {e for (e, t), r in full_sig.items() if t == "paired_ttest" and r["significant"]}
    assert significant, "the constructed case must have significant heads, or the test shows nothing"
    dead = {f"single_head/{h}" for h in ZEROED}
    assert {e for e, r in scr.items() if r["screen"] == "screened_out"} == dead
    assert not significant & dead
    for eval_id in significant:  # completed: the full run's row and tests, plus the screening columns
        row = scr[eval_id]
        assert row["screen"] == "completed" and row["screen_examples"] == 60
        assert row["screen_ci_low"] < -0.02  # the subset interval reaches past the margin
        assert (row["score"], row["delta"], row["n_examples"]) == (full[eval_id]["score"], full[eval_id]["delta"], 300)
        assert scr_sig[(eval_id, "paired_ttest")]["p_value"] == full_sig[(eval_id, "paired_ttest")]["p_value"]
        assert scr_sig[(eval_id, "paired_ttest")]["significant"]
    for eval_id in dead:  # screened out: the subset's row and examples, no tests
        row = scr[eval_id]
        assert (row["n_examples"], row["screen_examples"], row["delta"]) == (60, 60, 0.0)
        assert (row["screen_ci_low"], row["screen_ci_high"]) == (0.0, 0.0)
        assert row["baseline_score"] == 1.0 and full[eval_id]["delta"] == 0.0
        assert sum(e["eval_id"] == eval_id for e in scr_examples) == 60
        assert not any(k[0] == eval_id for k in scr_sig)
    # the family counts the screened-out heads with p = 1 (Holm over all 8 heads)
    completed = sorted(e for e, r in scr.items() if r["screen"] == "completed")
    raw = [scr_sig[(e, "paired_ttest")]["p_value"] for e in completed]
    expected = adjust_pvalues(np.array(raw + [1.0] * len(dead)), "holm")[: len(raw)]
    assert [scr_sig[(e, "paired_ttest")]["p_adjusted"] for e in completed] == pytest.approx(expected, rel=1e-12)
    proc = run_cli("query", f"SELECT count(*) FILTER (WHERE screen = 'screened_out') FROM heads "
                   f"WHERE run_id = '{screened_id}'", "--store", str(tmp_path / "store"), "--format", "csv")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "4", proc.stderr


def test_a_budgeted_screened_run_resumes_to_the_uninterrupted_tables(tmp_path, ray_address, known_case, two_runs):
    model_dir, dev = known_case
    partial_id, _ = run(tmp_path, "budget", config(model_dir, dev, screen=SCREEN, budget={"evaluations": 3}),
                        ray_address, store="b")
    runs = ResultStore(str(tmp_path / "b")).read("runs", partial_id).to_pylist()
    assert runs[0]["status"] == "partial"
    resumed_id, _ = run(tmp_path, "budget", config(model_dir, dev, screen=SCREEN), ray_address, store="b")
    assert resumed_id == partial_id
    whole, whole_sig, _ = tables(two_runs[0], two_runs[2])
    resumed, resumed_sig, _ = tables(tmp_path, resumed_id, "b")
    keep = ("score", "delta", "n_examples", "screen", "screen_examples", "screen_ci_low", "screen_ci_high")
    assert {e: [r[k] for k in keep] for e, r in resumed.items()} == {e: [r[k] for k in keep] for e, r in whole.items()}
    assert {k: r["p_adjusted"] for k, r in resumed_sig.items()} == {k: r["p_adjusted"] for k, r in whole_sig.items()}


def test_futility_rule_through_the_cli(tmp_path, ray_address, known_case, two_runs):
    """The futility rule on the known case: the dead heads (no change at all) screened out, every head the full
    run finds significant completed with the full run's row, examples and p-value; a rule that could screen
    nothing is refused with one line before anything is written."""
    model_dir, dev = known_case
    folder, full_id = two_runs[0], two_runs[1]
    run_id, proc = run(tmp_path, "futility", config(model_dir, dev, screen={"rule": "futility", "fraction": 0.3}),
                       ray_address)
    # k = sqrt(0.3) x 3.227 - sqrt(0.7) x 1.645 for 8 heads at alpha 0.01, miss 0.05
    assert "screening (futility: |z| < 0.39, miss 5% at z 3.23): " in proc.stderr
    full, full_sig, full_examples = tables(folder, full_id)
    scr, scr_sig, scr_examples = tables(tmp_path, run_id)
    significant = {e for (e, t), r in full_sig.items() if t == "paired_ttest" and r["significant"]}
    out = {e for e, r in scr.items() if r["screen"] == "screened_out"}
    assert {f"single_head/{h}" for h in ZEROED} <= out and not significant & out
    by_example = {(e["eval_id"], e["example_id"]): e["stats"] for e in full_examples}
    for eval_id in significant:
        assert scr[eval_id]["screen"] == "completed" and scr[eval_id]["screen_examples"] == 90
        assert (scr[eval_id]["score"], scr[eval_id]["n_examples"]) == (full[eval_id]["score"], 300)
        mine = [e for e in scr_examples if e["eval_id"] == eval_id]
        assert len(mine) == 300 and all(e["stats"] == by_example[(eval_id, e["example_id"])] for e in mine)
        assert scr_sig[(eval_id, "paired_ttest")]["p_value"] == full_sig[(eval_id, "paired_ttest")]["p_value"]

    path = tmp_path / "hopeless.yaml"
    path.write_text(yaml.safe_dump(config(model_dir, dev, screen={"rule": "futility", "fraction": 0.1})))
    proc = run_cli("run", str(path), "--store", str(tmp_path / "refused"), "--address", ray_address, "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "the futility rule could screen out no mask: raise the fraction" in error_line(proc.stderr)
    assert not list((tmp_path / "refused").rglob("*.parquet"))
