"""Resample ablation and activation patching (``sweep.ablation: resample | patch``) against a plain loop.

The independent route is written here with transformers alone: for each example, one forward pass of the donor
(resample: the example the adapter's derangement names; patch: the pair's other prompt) with a pre-hook on every
attention output projection recording its input, then one of the example with a pre-hook that puts the donor's
slices of the masked heads in place of its own (TransformerLens's ``hook_z`` patching, one example at a time, no
padding). The adapters run the same through ``evaluate``: donors padded as the batch, recorded once per batch and
installed as the per-example fill, with prefix reuse on and off and several masks packed in one pass. Both routes
run the same function with matrices of other shapes (a batch against one example), so they agree within the
summation-order bound (tests/tolerances.py).

Also: the derangement has no fixed point, stays within a length and is seeded; the logit difference equals one
computed from the model's logits; K resample draws average each example's statistics; bad input through the CLI
is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli, run_refused
from tiny_models import LM_WORDS, lm_text, save_tiny_causal_lm, save_tiny_classifier
from tolerances import assert_routes_agree
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from headsweep.errors import HeadsweepError
from headsweep.sweep.demo.sentiment import generate, write_tsv
from headsweep.workers.ablation.resample import same_length_donors
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_classifier.adapter import ClassifierAdapter
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 3
WINDOW = 12
# (reuse, masks_per_batch): prefix reuse on and off, one mask per pass and three packed in one
PATHS = [(True, 1), (False, 1), (True, 3), (False, 3)]


# -- the plain route -----------------------------------------------------------------------------------------------
def substituted(run, projections, head_dim: int, mask, donor_ids, ids, keep_first: bool = False):
    """``run(ids)`` with the masked heads' slices of each output projection's input (``projections[layer]``) taken
    from ``run(donor_ids)``; position 0 left alone with ``keep_first``."""
    recorded = {}
    handles = [p.register_forward_pre_hook(lambda _m, args, layer=layer: recorded.__setitem__(layer, args[0].clone()))
               for layer, p in enumerate(projections)]
    try:
        run(donor_ids)
    finally:
        for h in handles:
            h.remove()
    first = 1 if keep_first else 0

    def swap(layer):
        def hook(_m, args):
            x = args[0].clone()
            for head in mask:
                if head.layer == layer:
                    cols = slice(head.head * head_dim, (head.head + 1) * head_dim)
                    x[:, first:, cols] = recorded[layer][:, first:, cols]
            return (x, *args[1:])
        return hook

    handles = [p.register_forward_pre_hook(swap(layer)) for layer, p in enumerate(projections)]
    try:
        return run(ids)
    finally:
        for h in handles:
            h.remove()


MASKS = [[Head("self", 0, 1)], [Head("self", 1, 2), Head("self", 2, 0)], [Head("self", 0, 3), Head("self", 2, 1)]]


# -- donors ----------------------------------------------------------------------------------------------------------
def test_same_length_donors_are_seeded_derangements_within_a_length():
    lengths = np.array([4] * 7 + [9] * 2 + [6] * 30)
    donors = same_length_donors(lengths, seed=3, draws=4)
    assert donors.shape == (4, len(lengths))
    assert not (donors == np.arange(len(lengths))).any()  # no example is its own donor
    assert (lengths[donors] == lengths).all()  # always one of its own length
    assert all(sorted(row) == list(range(len(lengths))) for row in donors)  # each draw a permutation
    assert np.array_equal(donors, same_length_donors(lengths, seed=3, draws=4))  # seeded
    assert np.array_equal(donors[:1], same_length_donors(lengths, seed=3, draws=1))  # draw k seeded by (seed, k)
    assert not np.array_equal(donors[0], same_length_donors(lengths, seed=4)[0])
    assert not np.array_equal(donors[0], donors[1])
    with pytest.raises(HeadsweepError, match=r"2 of the 5 examples of the evaluation data have no other of their "
                       r"length \(lengths 3, 8\)"):
        same_length_donors([3, 5, 5, 8, 5], 0)


# -- classifier: resample ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_classifier(tmp_path_factory.mktemp("models") / "bert", layers=LAYERS)


@pytest.fixture(scope="module")
def classifier_data(tmp_path_factory, bert_dir):
    """Demo sentences whose token length some other sentence shares (every one has a donor), as a TSV."""
    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    examples = generate(60, seed=7)
    lengths = [len(tokenizer(text)["input_ids"]) for text, _ in examples]
    kept = [e for e, n in zip(examples, lengths, strict=True) if lengths.count(n) > 1]
    assert len(set(lengths)) > 3 and len(kept) > 30
    return write_tsv(kept, tmp_path_factory.mktemp("data") / "pairable.tsv"), tokenizer


def classifier(model_dir, data, reuse=True, masks_per_batch=1, **spec) -> ClassifierAdapter:
    runtime = RuntimeOptions(batch_size=8, reuse=reuse, masks_per_batch=masks_per_batch,
                             ablation=AblationSpec(method="resample", **spec))
    return ClassifierAdapter(ClassifierModel(path=str(model_dir)), ClassifierData(path=str(data)), runtime)


def test_classifier_resample_equals_a_hook_loop(bert_dir, classifier_data):
    data, tokenizer = classifier_data
    model = AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    projections = [layer.attention.output.dense for layer in model.bert.encoder.layer]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    texts = [line.split("\t")[0] for line in data.read_text().splitlines()[1:]]
    labels = torch.tensor([int(line.split("\t")[1]) for line in data.read_text().splitlines()[1:]])
    ids = [torch.tensor([tokenizer(t)["input_ids"]]) for t in texts]

    def run(x):
        with torch.no_grad():
            return model(input_ids=x).logits[0]

    reference = None
    for reuse, per in PATHS:
        a = classifier(bert_dir, data, reuse, per, seed=11)
        a.describe()
        assert a.reuse_note.startswith("prefix") == reuse
        donors = a.donors.donors[0]
        if reference is None:
            reference = torch.stack([torch.stack([substituted(run, projections, head_dim, m, ids[int(donors[i])],
                                                              ids[i]) for i in range(len(ids))]) for m in MASKS])
            baseline = torch.stack([run(x) for x in ids])
            assert (reference - baseline).abs().amax(dim=(1, 2)).min() > 1e-2  # every mask changes something
        got = a.logits(MASKS)
        assert_routes_agree(got, reference, depth=LAYERS + 1, width=64, what=("resample", reuse, per))
        outputs = a.evaluate(MASKS)
        for m, out in enumerate(outputs):  # the statistics: the hook route's argmax against the labels
            agree = got[m].argmax(-1) == reference[m].argmax(-1)
            expected = (reference[m].argmax(-1) == labels).double().numpy()
            assert np.array_equal(out.stats[:, 0][agree.numpy()], expected[agree.numpy()])


@pytest.mark.parametrize("direction", ["noising", "denoising"])
def test_classifier_patch_equals_a_hook_loop(bert_dir, direction, tmp_path):
    """Paired inputs (data.task: paired) for a classifier: the metric is the answer label's logit minus the wrong
    label's, and patching fills from the pair's other input."""
    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    rng = random.Random(5)
    rows = []
    for text, label in generate(12, seed=3):
        words = text.split()
        words[rng.randrange(len(words))] = rng.choice(["good", "bad", "movie", "plot"])  # one word: the same length
        rows.append({"clean": text, "corrupted": " ".join(words), "answer": str(label), "wrong_answer": str(1 - label)})
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    model = AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    projections = [layer.attention.output.dense for layer in model.bert.encoder.layer]
    head_dim = model.config.hidden_size // model.config.num_attention_heads

    def run(x):
        with torch.no_grad():
            return model(input_ids=x).logits[0]

    def diff(logits, r):
        return float(logits[int(r["answer"])] - logits[int(r["wrong_answer"])])

    ids = {side: [torch.tensor([tokenizer(r[side])["input_ids"]]) for r in rows] for side in ("clean", "corrupted")}
    evaluated, other = ("corrupted", "clean") if direction == "denoising" else ("clean", "corrupted")
    reference = np.array([[diff(substituted(run, projections, head_dim, m, ids[other][i], ids[evaluated][i]), r)
                           for i, r in enumerate(rows)] for m in MASKS])
    unpatched = {side: np.array([diff(run(x), r) for x, r in zip(ids[side], rows, strict=True)]) for side in ids}
    assert (np.abs(reference - unpatched[evaluated]).max(axis=1) > 1e-3).all()
    for reuse, per in PATHS:
        runtime = RuntimeOptions(batch_size=4, reuse=reuse, masks_per_batch=per,
                                 ablation=AblationSpec(method="patch", direction=direction))
        a = ClassifierAdapter(ClassifierModel(path=str(bert_dir)), ClassifierData(path=str(data), task="paired"),
                              runtime)
        info = a.describe()
        assert info.metric == "logit_diff" and a.reuse_note.startswith("prefix") == reuse
        for side in ("clean", "corrupted"):
            assert info.facts[f"logit_diff_{side}"] == pytest.approx(unpatched[side].mean(), abs=1e-4)
        got = np.array([o.stats[:, 0] for o in a.evaluate(MASKS)])
        assert_routes_agree(got, reference, depth=LAYERS + 1, width=64, what=("classifier patch", direction, reuse))
        assert_routes_agree(a.evaluate([[]])[0].stats[:, 0], unpatched[evaluated], depth=LAYERS + 1, width=64,
                            what="baseline")


def test_classifier_pairs_that_cannot_be_patched_are_one_line(bert_dir, tmp_path):
    good = {"clean": "the movie is good", "corrupted": "the movie is bad", "answer": "1", "wrong_answer": "0"}
    cases = [({"corrupted": "the movie is not bad"}, "line 2: the clean input is 6 tokens and the corrupted one 7"),
             ({"wrong_answer": "1"}, "line 2: answer and wrong_answer are the same label"),
             ({"answer": "7"}, "labels outside the model's label set: '7'")]
    for change, message in cases:
        data = write_jsonl(tmp_path / "bad.jsonl", [good, {**good, **change}])
        with pytest.raises(HeadsweepError, match=message):
            ClassifierAdapter(ClassifierModel(path=str(bert_dir)), ClassifierData(path=str(data), task="paired"),
                              RuntimeOptions(ablation=AblationSpec(method="patch")))
    with pytest.raises(HeadsweepError, match="data.text_column applies to data.task classification, not paired"):
        ClassifierData(path="x.jsonl", task="paired", text_column="text").check()


# -- causal LM perplexity: resample, K draws ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(120, seed=3))
    return {"llama": save_tiny_causal_lm(tmp / "llama", "llama_8q2kv", layers=LAYERS),
            "gpt2": save_tiny_causal_lm(tmp / "gpt2", "gpt2", layers=LAYERS), "corpus": corpus, "tmp": tmp}


def lm_route(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h
    projections = [b.self_attn.o_proj if hasattr(b, "self_attn") else b.attn.c_proj for b in blocks]
    head_dim = model.config.hidden_size // model.config.num_attention_heads  # GPT-2's config maps these names too

    def run(x):
        with torch.no_grad():
            return model(input_ids=x, use_cache=False).logits[0].double()

    return run, projections, head_dim


def test_perplexity_resample_equals_a_hook_loop_and_averages_its_draws(lm_files):
    run, projections, head_dim = lm_route(lm_files["llama"])
    tokenizer = AutoTokenizer.from_pretrained(lm_files["llama"])
    tokens = tokenizer(lm_files["corpus"].read_text(), add_special_tokens=False)["input_ids"]
    windows = [torch.tensor([tokens[i : i + WINDOW]]) for i in range(0, len(tokens) - WINDOW + 1, WINDOW)]

    def nll_sum(logits, ids):  # every position after the first is scored (no BOS, windows without overlap)
        return float(-torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).sum())

    def adapter(reuse, per, resamples=1):
        runtime = RuntimeOptions(batch_size=3, reuse=reuse, masks_per_batch=per,
                                 ablation=AblationSpec(method="resample", seed=2, resamples=resamples))
        return load_causal_lm_adapter(CausalLMModel(path=str(lm_files["llama"])),
                                      CausalLMData(path=str(lm_files["corpus"]), window=WINDOW), runtime)

    def reference(donors):
        return np.array([[nll_sum(substituted(run, projections, head_dim, m, windows[int(donors[i])], w), w)
                          for i, w in enumerate(windows)] for m in MASKS])

    first = None
    for reuse, per in PATHS:
        a = adapter(reuse, per)
        a.describe()
        assert len(a.windows) == len(windows) and a.reuse_note.startswith("prefix") == reuse
        first = reference(a.donors.donors[0]) if first is None else first
        got = np.array([o.stats[:, 0] for o in a.evaluate(MASKS)])
        assert_routes_agree(got, first, depth=LAYERS + 1, width=64, what=("perplexity", reuse, per))
    # K = 2 draws: each window's statistics are the mean of its two draws' (the unit stays the window)
    a = adapter(True, 3, resamples=2)
    draws = a.donors.donors
    assert np.array_equal(draws[0], adapter(True, 1).donors.donors[0])
    expected = (reference(draws[0]) + reference(draws[1])) / 2
    got = np.array([o.stats for o in a.evaluate(MASKS)])
    assert got.shape == (len(MASKS), len(windows), 2) and (got[..., 1] == WINDOW - 1).all()
    assert_routes_agree(got[..., 0], expected, depth=LAYERS + 1, width=64, what="two draws")


# -- causal LM paired prompts: patch, logit_diff ---------------------------------------------------------------------
def pair_rows(n: int = 14, seed: int = 0) -> list[dict]:
    """Prompts of two lengths, the corrupted one a word changed; answers one word (one token) each."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        clean = [rng.choice(LM_WORDS) for _ in range(5 + 2 * (i % 2))]
        corrupted = list(clean)
        corrupted[rng.randrange(len(clean))] = rng.choice(LM_WORDS)
        answer, wrong = rng.sample(LM_WORDS, 2)
        rows.append({"clean": " ".join(clean), "corrupted": " ".join(corrupted), "answer": answer,
                     "wrong_answer": wrong, "template": i % 2})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("method", "direction", "keep_first"),
                         [("patch", "noising", False), ("patch", "denoising", True), ("resample", "noising", False)])
def test_paired_prompts_equal_a_hook_loop(lm_files, method, direction, keep_first):
    rows = pair_rows()
    data = write_jsonl(lm_files["tmp"] / f"pairs-{method}-{direction}.jsonl", rows)
    run, projections, head_dim = lm_route(lm_files["gpt2"])
    tokenizer = AutoTokenizer.from_pretrained(lm_files["gpt2"])

    def encode(text):
        return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])

    clean = [encode(r["clean"]) for r in rows]
    corrupted = [encode(r["corrupted"]) for r in rows]
    answers = [(tokenizer.convert_tokens_to_ids(r["answer"]), tokenizer.convert_tokens_to_ids(r["wrong_answer"]))
               for r in rows]

    def logit_diff(logits, i):  # the metric from the model's logits: answer minus wrong answer, last position
        return float(logits[-1, answers[i][0]] - logits[-1, answers[i][1]])

    evaluated, other = (corrupted, clean) if direction == "denoising" else (clean, corrupted)
    reference = None
    for reuse, per in PATHS:
        runtime = RuntimeOptions(batch_size=4, reuse=reuse, masks_per_batch=per,
                                 ablation=AblationSpec(method=method, direction=direction, keep_first=keep_first))
        a = load_causal_lm_adapter(CausalLMModel(path=str(lm_files["gpt2"])),
                                   CausalLMData(path=str(data), task="paired"), runtime)
        info = a.describe()
        assert info.metric == "logit_diff" and a.reuse_note.startswith("prefix") == reuse
        if reference is None:
            donors = a.donors.donors[0]
            donor_side = other if method == "patch" else evaluated
            reference = np.array([[logit_diff(substituted(run, projections, head_dim, m, donor_side[int(donors[i])],
                                                          x, keep_first), i)
                                   for i, x in enumerate(evaluated)] for m in MASKS])
            unpatched = {side: np.array([logit_diff(run(x), i) for i, x in enumerate(prompts)])
                         for side, prompts in (("clean", clean), ("corrupted", corrupted))}
            assert np.abs(unpatched["clean"] - unpatched["corrupted"]).max() > 1e-2
            assert (np.abs(reference - unpatched["corrupted" if direction == "denoising" else "clean"]).max(axis=1)
                    > 1e-3).all()
            if method == "patch":
                assert np.array_equal(donors, np.arange(len(rows)))
        # the baseline: the unpatched evaluated prompts; the facts: both sides' means
        base = a.baseline().stats[:, 0]
        assert_routes_agree(base, unpatched["corrupted" if direction == "denoising" else "clean"], depth=LAYERS + 1,
                            width=64, what="baseline")
        for side in ("clean", "corrupted"):
            assert info.facts[f"logit_diff_{side}"] == pytest.approx(unpatched[side].mean(), abs=1e-5)
        outputs = a.evaluate(MASKS)
        got = np.array([o.stats[:, 0] for o in outputs])
        assert_routes_agree(got, reference, depth=LAYERS + 1, width=64, what=(method, direction, reuse, per))
        assert [o.score for o in outputs] == pytest.approx(list(got.mean(axis=1)), rel=1e-12)


# -- bad input through the CLI -----------------------------------------------------------------------------------------
def refused(tmp_path, ray_address, model, data, *parts, **ablation) -> None:
    method = ablation.pop("method")
    cfg = {"model": model, "data": data, "sweep": {"experiments": ["baseline", "single_head"], "workers": 1,
                                                   "ablation": method}}
    if ablation:
        cfg["ablation"] = ablation
    tmp_path.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_refused(config, tmp_path / "store", ray_address, *parts)


def test_bad_input_is_one_line(tmp_path, lm_files, tiny_bert_dir, tiny_dev_tsv, ray_address):
    gpt2 = {"kind": "hf_causal_lm", "path": str(lm_files["gpt2"])}
    rows = pair_rows(4)
    # patch without paired data: refused before any worker starts
    refused(tmp_path / "a", ray_address, gpt2, {"path": str(lm_files["corpus"]), "window": WINDOW},
            "sweep.ablation patch needs paired data", "data.task: paired", method="patch")
    # an answer of two tokens
    bad = [*rows[:2], {**rows[2], "answer": "big cat"}, rows[3]]
    refused(tmp_path / "b", ray_address, gpt2, {"path": str(write_jsonl(tmp_path / "b.jsonl", bad)), "task": "paired"},
            "line 3", "answer 'big cat' is 2 tokens, not one", method="patch")
    # clean and corrupted prompts of different lengths
    bad = [rows[0], {**rows[1], "corrupted": rows[1]["corrupted"] + " dog"}, *rows[2:]]
    refused(tmp_path / "c", ray_address, gpt2, {"path": str(write_jsonl(tmp_path / "c.jsonl", bad)), "task": "paired"},
            "line 2", "must tokenise to the same length", method="patch", direction="denoising")
    # resample on the demo sentences: three of them have no other of their token length
    refused(tmp_path / "d", ray_address, {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
            {"path": str(tiny_dev_tsv)}, f"3 of the 40 examples of data file {tiny_dev_tsv} have no other of their",
            "data.max_examples", "sweep.ablation mean", method="resample", seed=1)


@pytest.mark.parametrize(("change", "message"), [
    ({"sweep": {"ablation": "resample", "screen": {}}}, "sweep.screen evaluates a subset"),
    ({"sweep": {"ablation": "patch", "experiments": ["baseline", "importance"]},
      "importance": {"data": {"path": "CORPUS"}}},
     "importance.data is not paired data"),
    ({"sweep": {"ablation": "resample"}, "ablation": {"direction": "denoising"}}, "ablation.direction is set but"),
    ({"sweep": {"ablation": "patch"}, "ablation": {"direction": "sideways"}}, "unknown ablation.direction"),
    ({"data": {"max_pairs": 3}}, "data.max_pairs applies to data.task paired, not perplexity"),
])
def test_config_checks(lm_files, change, message):
    """What the driver refuses before any worker starts (the CLI prints it as one line, as above)."""
    from headsweep.sweep.configuration.config import build_config, check_data_files

    pairs = write_jsonl(lm_files["tmp"] / "pairs-config.jsonl", pair_rows(4))
    cfg = {"model": {"kind": "hf_causal_lm", "path": str(lm_files["gpt2"])},
           "data": {"path": str(pairs), "task": "paired"},
           "sweep": {"experiments": ["baseline", "single_head"]}}
    for key, value in change.items():
        value = json.loads(json.dumps(value).replace("CORPUS", str(lm_files["corpus"])))
        cfg[key] = {**cfg.get(key, {}), **value}
    if "max_pairs" in change.get("data", {}):
        cfg["data"] = {"path": str(lm_files["corpus"]), "max_pairs": 3}
    with pytest.raises(HeadsweepError, match=message):
        check_data_files(build_config(cfg))


def test_a_denoising_run_through_the_cli(tmp_path, lm_files, ray_address):
    """The driver's path: metric logit_diff stored per pair, the paired bootstrap on it, the run's facts, and the
    normalised patching score in the deltas view (0 at the baseline: denoising starts from the corrupted run)."""
    from headsweep.results.query import run_query
    from headsweep.results.store import ResultStore

    rows = pair_rows(12, seed=4)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"kind": "hf_causal_lm", "path": str(lm_files["gpt2"])},
        "data": {"path": str(data), "task": "paired"},
        "sweep": {"experiments": ["baseline", "single_head"], "workers": 1, "ablation": "patch"},
        "ablation": {"direction": "denoising"}, "significance": {"n_resamples": 100}}))
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run, _, _ = lm_route(lm_files["gpt2"])
    tokenizer = AutoTokenizer.from_pretrained(lm_files["gpt2"])
    means = {}
    for side in ("clean", "corrupted"):
        diffs = []
        for r in rows:
            logits = run(torch.tensor([tokenizer(r[side], add_special_tokens=False)["input_ids"]]))
            diffs.append(float(logits[-1, tokenizer.convert_tokens_to_ids(r["answer"])]
                               - logits[-1, tokenizer.convert_tokens_to_ids(r["wrong_answer"])]))
        means[side] = np.mean(diffs)
    results = ResultStore(str(store))
    (facts,) = run_query(results, "SELECT facts, metric, ablation FROM runs").to_pylist()
    assert (facts["metric"], facts["ablation"]) == ("logit_diff", "patch")
    stored = json.loads(facts["facts"])
    assert stored["ablation"] == {"method": "patch", "keep_first": False, "direction": "denoising"}
    assert stored["logit_diff_clean"] == pytest.approx(means["clean"], abs=1e-5)
    assert stored["logit_diff_corrupted"] == pytest.approx(means["corrupted"], abs=1e-5)
    deltas = run_query(results, "SELECT experiment, score, baseline_score, test, p_value, logit_diff_normalized "
                                "FROM deltas").to_pylist()
    assert len(deltas) == 1 + 12  # the baseline and the 3 x 4 heads
    for row in deltas:
        assert row["baseline_score"] == pytest.approx(means["corrupted"], abs=1e-5)
        expected = (row["score"] - means["corrupted"]) / (means["clean"] - means["corrupted"])
        assert row["logit_diff_normalized"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
        if row["experiment"] == "single_head":
            assert row["test"] == "paired_bootstrap" and 0 < row["p_value"] <= 1
    assert [r["logit_diff_normalized"] for r in deltas if r["experiment"] == "baseline"] == [pytest.approx(0, abs=1e-9)]
    # A pair's drill-down shows both answers' log-probabilities (from the stored answer NLL and logit difference):
    # the baseline's are the model's own last-position log-softmax on the corrupted prompt (denoising's baseline).
    import re

    from headsweep.sweep.reporting.report import write_report

    text = write_report(results, [proc.stdout.strip().splitlines()[-1]], tmp_path / "report").read_text()
    start = text.index('class="hs-heads"')
    heads = json.loads(text[text.index(">", start) + 1 : text.index("</script>", start)].replace("<\\/", "</"))
    shown = [h["html"] for h in heads.values() if '<tr class="example">' in h["html"]]
    assert shown and "log p(wrong answer), baseline" in shown[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", shown[0].split('<tr class="example">')[1].split("</tr>")[0])
    # the columns by their headers (the page shows only the columns a run fills)
    columns = re.findall(r"<th>(.*?)</th>", shown[0].split('<table class="examples">')[1].split("</tr>")[0])
    pair = rows[int(cells[0][1:])]
    ids = tokenizer(pair["corrupted"], add_special_tokens=False)["input_ids"]
    logp = torch.log_softmax(run(torch.tensor([ids]))[-1], dim=-1)
    expected = [float(logp[tokenizer.convert_tokens_to_ids(pair[k])]) for k in ("answer", "wrong_answer")]
    shown_logp = [float(cells[columns.index(c)]) for c in ("log p(answer), baseline", "log p(wrong answer), baseline")]
    assert shown_logp == pytest.approx(expected, rel=1e-3, abs=1e-4)  # 4 digits shown


def test_gate_gradients_under_patching_are_attribution_patching(lm_files):
    """``loss_batches`` under patch: each gate's gradient at 1 is ``dL/dz' . (z - c)``, c the corrupted prompt's
    slice (attribution patching), computed here with a hook that mixes ``xi z + (1 - xi) c`` itself."""
    rows = pair_rows(6, seed=2)
    data = write_jsonl(lm_files["tmp"] / "pairs-gradients.jsonl", rows)
    runtime = RuntimeOptions(batch_size=4, ablation=AblationSpec(method="patch"))
    a = load_causal_lm_adapter(CausalLMModel(path=str(lm_files["gpt2"])), CausalLMData(path=str(data), task="paired"),
                               runtime)
    sites = a.gates.sites
    gates = {s.key: torch.ones(s.num_heads, dtype=torch.float64, requires_grad=True) for s in sites}
    a.gates.set_values(gates)
    for batch in a.loss_batches(None, torch.float64).batches:
        batch.loss().backward()
    a.gates.clear()
    got = torch.stack([gates[s.key].grad for s in sites])

    model = AutoModelForCausalLM.from_pretrained(lm_files["gpt2"], attn_implementation="eager").eval()
    projections = [b.attn.c_proj for b in model.transformer.h]
    tokenizer = AutoTokenizer.from_pretrained(lm_files["gpt2"])
    heads, head_dim = sites[0].num_heads, sites[0].head_dim
    xi = torch.ones(len(projections), heads, dtype=torch.float64, requires_grad=True)
    recorded: dict[int, torch.Tensor] = {}  # the corrupted prompt's projection inputs, per layer
    for r in rows:
        clean, corrupted = (torch.tensor([tokenizer(r[s], add_special_tokens=False)["input_ids"]])
                            for s in ("clean", "corrupted"))
        handles = [p.register_forward_pre_hook(lambda _m, args, i=i: recorded.__setitem__(i, args[0].detach()))
                   for i, p in enumerate(projections)]
        with torch.no_grad():
            model(input_ids=corrupted)
        for h in handles:
            h.remove()

        def mix(i):
            def hook(_m, args):
                z = args[0].view(*args[0].shape[:-1], heads, head_dim)
                c = recorded[i].view_as(z)
                w = xi[i].view(heads, 1).to(z.dtype)
                return ((z * w + (1 - w) * c).reshape(args[0].shape),)
            return hook

        handles = [p.register_forward_pre_hook(mix(i)) for i, p in enumerate(projections)]
        logits = model(input_ids=clean).logits[0, -1].double()
        for h in handles:
            h.remove()
        answer = tokenizer.convert_tokens_to_ids(r["answer"])
        (-torch.log_softmax(logits, -1)[answer]).backward()
    # float32 forward passes of other shapes on the two routes; the gradients are O(1e-2 .. 1)
    assert got.abs().max() > 1e-3
    assert torch.allclose(got, xi.grad, rtol=1e-4, atol=1e-6), (got - xi.grad).abs().max()


def test_averaged_outcomes_leave_mcnemar_out():
    """K > 1 resample draws make an accuracy outcome a share of draws: McNemar's 0/1 test is left out of the
    defaults, and refused when asked for; the t-test stays."""
    from headsweep.sweep.configuration.sections import SignificanceSection
    from headsweep.sweep.statistics.significance_runner import tests_for

    assert tests_for(SignificanceSection(), "accuracy") == ["paired_ttest", "mcnemar_exact"]
    assert tests_for(SignificanceSection(), "accuracy", averaged=True) == ["paired_ttest"]
    with pytest.raises(HeadsweepError, match="mcnemar_exact needs 0/1 outcomes"):
        tests_for(SignificanceSection(tests=["mcnemar_exact"]), "accuracy", averaged=True)


def test_multiple_choice_refuses_per_example_methods(lm_files, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", [{"context": "the cat", "choices": ["sees", "runs the dog"],
                                                    "gold": 0}] * 2)
    for method, message in (("resample", "sweep.ablation resample is not available for multiple-choice questions"),
                            ("patch", "sweep.ablation patch needs paired data")):
        a = load_causal_lm_adapter(CausalLMModel(path=str(lm_files["gpt2"])),
                                   CausalLMData(path=str(questions), task="multiple_choice"),
                                   RuntimeOptions(ablation=AblationSpec(method=method)))
        with pytest.raises(HeadsweepError, match=message):
            a.describe()
