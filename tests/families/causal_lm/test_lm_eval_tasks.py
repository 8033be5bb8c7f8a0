"""lm-evaluation-harness tasks under head masks (``data.task: lm_eval``), against lm-eval's own ``simple_evaluate``.

The tasks are local YAML files written here over JSON, CSV and Parquet documents (multiple choice, loglikelihood,
loglikelihood_rolling); the independent route is ``simple_evaluate(model=HFLM(pretrained=<model object>))`` on the
same documents: on the unmasked model, and on a weight-surgery copy (the head's ``o_proj`` input columns zeroed)
for masked heads. Both run one request per forward pass (``batch_size`` 1), where HFLM's float32 arithmetic is
reproduced bit for bit; with other batch sizes both sides round differently (lm-eval at batch 8 against itself at
batch 1 too), which the summation-order bound covers.

``simple_evaluate`` runs ``pip list`` and other commands for its environment report on every call (4 s here); the
module replaces that report (``lm_eval.evaluator.add_env_info``), which computes nothing the results depend on.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tiny_models import save_tiny_causal_lm, zeroed_output_columns
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import build_config
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.by_task import check_data
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel, CausalLMRuntime
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter
from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import load_tasks

DEPTH, WIDTH = 2 + 1, 64  # tiny models: 2 layers and the LM head, inner products up to 64 long (tolerances.py)

QUESTIONS = [
    ("the cat sees", ["a dog", "the big red bird", "a tree here"], 0),
    ("the dog likes ", ["a", "the small green house there"], 1),
    ("a bird eats", ["the", "slowly and then today", "red river"], 2),
    ("the big cat runs quickly and then", ["sleeps", "eats a red tree", "a", "then"], 3),
    ("here the zebra sleeps", ["today", "there and here"], 0),
    ("the small bird", ["runs", "sleeps here", "eats"], 1),
]
TRAIN = [("a dog runs", ["here", "there"], 0), ("the tree", ["is green", "sleeps"], 1),
         ("a cat eats", ["a bird", "the river"], 0)]
TEXTS = ["the cat sees a dog and then the bird runs quickly to the river",
         "a big red tree here", "the small green house there and the dog sleeps today",
         "quickly and slowly the cat eats"]


def _write_tasks(folder: Path) -> Path:
    """Three local tasks (JSON, CSV, Parquet documents) and one of each kind headsweep refuses."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = lambda qs: "".join(json.dumps({"q": c, "opts": ch, "label": g}) + "\n" for c, ch, g in qs)  # noqa: E731
    (folder / "mc_test.jsonl").write_text(rows(QUESTIONS))
    (folder / "mc_train.jsonl").write_text(rows(TRAIN))
    # the last context is longer than the model's 64 positions: lm-eval cuts it from the left
    long = " ".join(["the big cat runs quickly and then"] * 12)
    (folder / "ll.csv").write_text("context,word\n" + "".join(f"{c},{ch[g]}\n" for c, ch, g in QUESTIONS)
                                   + f"{long},sleeps\n")
    pq.write_table(pa.table({"text": TEXTS}), folder / "texts.parquet")
    tasks = {
        "tiny_mc": {"dataset_path": "json", "dataset_kwargs": {"data_files": {
            "train": str(folder / "mc_train.jsonl"), "test": str(folder / "mc_test.jsonl")}},
            "training_split": "train", "test_split": "test", "output_type": "multiple_choice",
            "doc_to_text": "{{q}}", "doc_to_choice": "{{opts}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        "tiny_ll": {"dataset_path": "csv", "dataset_kwargs": {"data_files": {"test": str(folder / "ll.csv")}},
                    "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
                    "doc_to_target": " {{word}}", "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]},
        "tiny_rolling": {"dataset_path": "parquet", "dataset_kwargs": {"data_files": {
            "test": str(folder / "texts.parquet")}}, "test_split": "test", "output_type": "loglikelihood_rolling",
            "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                            {"metric": "bits_per_byte"}]},
        "tiny_mc2": {"dataset_path": "json", "dataset_kwargs": {"data_files": {
            "test": str(folder / "mc_train.jsonl")}}, "test_split": "test", "output_type": "multiple_choice",
            "doc_to_text": "{{q}}", "doc_to_choice": "{{opts}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc"}]},
        "tiny_gen": {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / "mc_test.jsonl")}},
                     "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{q}}",
                     "doc_to_target": "{{label}}", "metric_list": [{"metric": "exact_match"}]},
        "tiny_hub": {"dataset_path": "someorg/notcached", "test_split": "test", "output_type": "multiple_choice",
                     "doc_to_text": "{{q}}", "doc_to_choice": "{{opts}}", "doc_to_target": "{{label}}"},
    }
    for name, body in tasks.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **body}))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("lm_eval")
    models = {shape: save_tiny_causal_lm(root / shape, shape) for shape in ("llama_8q2kv", "gpt2")}
    with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
        yield root, _write_tasks(root / "tasks"), models


def data(tasks: Path, names: list[str], **more) -> CausalLMData:
    return CausalLMData(task="lm_eval", tasks=names, include_path=str(tasks), **more)


def adapter(model_dir: Path, cfg: CausalLMData, attn: str = "eager", batch_size: int = 1,
            masks_per_batch: int = 1) -> LmEvalAdapter:
    """One request and one mask per forward pass by default: HFLM's shapes at its batch size 1."""
    return LmEvalAdapter(CausalLMModel(path=str(model_dir), attn_implementation=attn), cfg,
                         RuntimeOptions(batch_size=batch_size, masks_per_batch=masks_per_batch))


def lm_eval_route(model, tokenizer, tasks: Path, names: list[str], num_fewshot: int | None = None) -> dict:
    """lm-eval's own evaluation of the loaded model object: one request per forward pass."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), tasks=names,
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                           num_fewshot=num_fewshot, log_samples=True, bootstrap_iters=0)


def per_doc(result: dict, task: str, metric: str) -> list:
    return [s[metric] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


STAT_COLUMNS = {"tiny_mc": {"acc": 0, "acc_norm": 1}, "tiny_ll": {"acc": 0, "perplexity": 1},
                "tiny_rolling": {"word_perplexity": 0, "byte_perplexity": 0, "bits_per_byte": 0}}


def assert_equal_to_lm_eval(a: LmEvalAdapter, out, result: dict, task: str) -> None:
    """Per-document values and the aggregate of every metric the task computes, identical to lm-eval's."""
    for metric, column in STAT_COLUMNS[task].items():
        theirs = per_doc(result, task, metric)
        if task == "tiny_rolling":  # (loglikelihood, words or bytes) per document
            unit = 1 if metric == "word_perplexity" else 2
            assert [(s[0], s[unit]) for s in out.stats.tolist()] == [tuple(v) for v in theirs], metric
        else:
            assert out.stats[:, column].tolist() == [float(v) for v in theirs], metric  # exact
        assert a.scorer.tasks[0].task.aggregation()[metric](theirs) == result["results"][task][f"{metric},none"]
    assert out.score == result["results"][task][f"{a.metric_name},none"]  # exact: lm-eval's own aggregate


@pytest.mark.parametrize("task, shots", [("tiny_mc", 0), ("tiny_mc", 2), ("tiny_ll", 0), ("tiny_rolling", 0)])
def test_unmasked_documents_and_aggregate_equal_simple_evaluate(setup, task, shots):
    _, tasks, models = setup
    a = adapter(models["llama_8q2kv"], data(tasks, [task], num_fewshot=shots))
    out = a.evaluate([[]])[0]
    result = lm_eval_route(a.model, a.tokenizer, tasks, [task], num_fewshot=shots)
    assert_equal_to_lm_eval(a, out, result, task)
    info = a.describe()
    assert info.example_ids == [f"{task}/{i}" for i in range(len(out.stats))]
    assert info.facts["num_fewshot"] == {task: shots} and info.facts["baseline_by_task"] == {task: out.score}
    assert info.facts["truncated_documents"] == (1 if task == "tiny_ll" else 0)
    if task == "tiny_mc" and shots:
        # few-shot contexts: lm-eval's for the same seed (1234), and other ones for another seed
        theirs = [s["arguments"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]
        mine = [[r.args for r in reqs] for reqs in a.tasks[0].requests]
        assert [[tuple(x) for x in doc.values()] if isinstance(doc, dict) else [tuple(x) for x in doc]
                for doc in theirs] == mine
        assert all(mine[d][0][0].count("\n\n") == shots for d in range(len(mine)))
        other = load_tasks(data(tasks, [task], num_fewshot=shots, fewshot_seed=7))[0]
        assert [[r.args for r in reqs] for reqs in other.requests] != mine
    # batched rows round in another order than one request at a time (lm-eval's own batches do too)
    batched = adapter(models["llama_8q2kv"], data(tasks, [task], num_fewshot=shots), batch_size=4)
    assert_routes_agree(batched.values([[]])[0][:, 0], a.values([[]])[0][:, 0], depth=DEPTH, width=WIDTH)


# Every head of both shapes is 26 lm-eval runs (40 s here): the suite takes a head per layer and key/value group
# position and an all-but-one mask; the slow variant takes every head and every all-but-one mask of layer 1.
@pytest.mark.parametrize("shape, attn, every", [
    ("llama_8q2kv", "sdpa", False), ("gpt2", "eager", False),
    pytest.param("llama_8q2kv", "sdpa", True, marks=pytest.mark.slow),
    pytest.param("gpt2", "eager", True, marks=pytest.mark.slow)])
def test_masked_heads_equal_simple_evaluate_on_weight_surgery(setup, shape, attn, every):
    """Single heads and all-but-one masks of the contract suite's causal-LM shapes against lm-eval on the copy
    whose ``o_proj`` input columns of the masked heads are zero; masks packed into one pass within rounding of one
    at a time."""
    _, tasks, models = setup
    a = adapter(models[shape], data(tasks, ["tiny_mc"]), attn=attn)
    heads = list(a.gates.inventory.heads)
    singles_of = heads if every else [heads[0], heads[-1]]
    kept = sorted({h.head for h in heads}) if every else [1]
    masks = [[h] for h in singles_of]
    masks += [[h for h in heads if h.layer == 1 and h.head != keep] for keep in kept]
    outs = a.evaluate(masks)
    singles = a.values(masks)
    packed = adapter(models[shape], data(tasks, ["tiny_mc"]), attn=attn, masks_per_batch=0).values(masks)
    assert_routes_agree(packed[..., 0], singles[..., 0], depth=DEPTH, width=WIDTH)  # summation order: wider passes
    moved = 0
    for mask, out in zip(masks, outs, strict=True):
        surgery = zeroed_output_columns(a.model, mask)
        result = lm_eval_route(surgery, a.tokenizer, tasks, ["tiny_mc"])
        theirs = [float(x[0][0]) for s in sorted(result["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
                  for x in s["resps"]]
        mine = [singles[masks.index(mask)][r[0], 0] for reqs in a.encoded.requests[0] for r in reqs]
        assert mine == theirs, mask  # exact: the gate multiplies by 0 what surgery zeroes
        assert out.score == result["results"]["tiny_mc"]["acc,none"]
        moved += int(mine != [a.values([[]])[0][r[0], 0] for reqs in a.encoded.requests[0] for r in reqs])
    assert moved == len(masks)


@pytest.mark.parametrize("shape, attn", [("llama_8q2kv", "sdpa"), ("gpt2", "eager")])
def test_prefix_reuse_equals_the_plain_path_bit_for_bit(setup, shape, attn):
    """Every single-head and all-but-one mask of the contract suite's causal-LM shapes, few-shot contexts in padded
    batches: masks started at their first gated layer from cached states equal whole-model passes exactly (one
    mask per pass: the same kernels on the same shapes), and within rounding when masks share passes."""
    _, tasks, models = setup
    cfg = data(tasks, ["tiny_mc"], num_fewshot=2)
    runs = {(reuse, per): LmEvalAdapter(CausalLMModel(path=str(models[shape]), attn_implementation=attn), cfg,
                                        RuntimeOptions(batch_size=3, masks_per_batch=per, reuse=reuse))
            for reuse, per in ((True, 1), (False, 1), (True, 0))}
    assert runs[True, 1].reuse_note.startswith("prefix") and runs[False, 1].reuse_note.startswith("off")
    heads = list(runs[True, 1].gates.inventory.heads)
    masks = [[]] + [[h] for h in heads] + [[h for h in heads if h.layer == g.layer and h != g] for g in heads]
    plain = runs[False, 1].values(masks)
    assert np.array_equal(runs[True, 1].values(masks), plain)  # exact
    assert_routes_agree(runs[True, 0].values(masks)[..., 0], plain[..., 0], depth=DEPTH, width=WIDTH)


@pytest.mark.parametrize("shape, attn", [("llama_8q2kv", "sdpa"), ("gpt2", "eager")])
def test_choices_from_the_context_cache_equal_the_plain_path_within_rounding(setup, shape, attn):
    """``sweep.context_cache``: every single-head and all-but-one mask of the contract suite's causal-LM shapes,
    few-shot contexts of several lengths (left-padded) and choices of 1-5 tokens (right-padded), masks packed: each
    question's context once per mask, its choices from the context's key/value cache, within the summation-order
    bound of the plain path (other matrix shapes), every choice's greedy match and every accuracy the same."""
    _, tasks, models = setup
    cfg = data(tasks, ["tiny_mc"], num_fewshot=2)
    model = CausalLMModel(path=str(models[shape]), attn_implementation=attn)
    cached = LmEvalAdapter(model, cfg, CausalLMRuntime(batch_size=3, masks_per_batch=0, context_cache=True))
    plain = LmEvalAdapter(model, cfg, CausalLMRuntime(batch_size=3, masks_per_batch=1, reuse=False))
    assert cached.reuse_note.startswith("context cache")
    # 6 questions in batches of at most 3 contexts of one length each, their rows every choice of them
    assert sum(b.inputs.contexts for b in cached.context_grid) == 6
    assert max(b.inputs.contexts for b in cached.context_grid) <= 3 < max(b.rows for b in cached.context_grid)
    heads = list(cached.gates.inventory.heads)
    masks = [[]] + [[h] for h in heads] + [[h for h in heads if h.layer == g.layer and h != g] for g in heads]
    ours, theirs = cached.values(masks), plain.values(masks)
    # summation order: a continuation's products have fewer rows than the whole row's
    assert_routes_agree(ours[..., 0], theirs[..., 0], depth=DEPTH, width=WIDTH)
    assert np.array_equal(ours[..., 1], theirs[..., 1])
    assert [o.score for o in cached.evaluate(masks)] == [o.score for o in plain.evaluate(masks)]
    assert 0 < np.abs(ours[..., 0] - theirs[..., 0]).max()  # not the plain path under another name


def test_bfloat16_reuse_and_context_cache_within_the_bound(setup):
    """In bfloat16 (16-bit storage, float32 sums): prefix reuse and the context cache against the plain path, every
    single-head and all-but-one mask of a GQA model, within tests/tolerances.py's 16-bit bound."""
    _, tasks, models = setup
    cfg = data(tasks, ["tiny_mc"], num_fewshot=2)
    model = CausalLMModel(path=str(models["llama_8q2kv"]), attn_implementation="sdpa", dtype="bfloat16")
    runs = {name: LmEvalAdapter(model, cfg, CausalLMRuntime(batch_size=3, masks_per_batch=per, reuse=reuse,
                                                            context_cache=cache))
            for name, reuse, per, cache in (("plain", False, 1, False), ("prefix", True, 0, False),
                                            ("context", True, 0, True))}
    assert runs["context"].reuse_note.startswith("context cache") and runs["prefix"].reuse_note.startswith("prefix")
    heads = list(runs["plain"].gates.inventory.heads)
    masks = [[]] + [[h] for h in heads] + [[h for h in heads if h.layer == g.layer and h != g] for g in heads]
    plain = runs["plain"].values(masks)[..., 0]
    for name in ("prefix", "context"):  # summation order, 16-bit
        assert_routes_agree(runs[name].values(masks)[..., 0], plain, depth=DEPTH, width=WIDTH, dtype=torch.bfloat16,
                            what=name)


def test_context_cache_is_refused_where_no_choices_share_a_context(setup, tmp_path):
    """A config asking for the context cache on another task is one line; a rolling lm-eval task runs the prefix
    path and says so."""
    _, tasks, models = setup
    rolling = LmEvalAdapter(CausalLMModel(path=str(models["gpt2"])), data(tasks, ["tiny_rolling"]),
                            CausalLMRuntime(context_cache=True))
    assert rolling.reuse_note.startswith("prefix")
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sees a dog " * 40)
    with pytest.raises(HeadsweepError, match="^sweep.context_cache applies to causal LMs on multiple-choice questions"):
        build_config({"model": {"kind": "hf_causal_lm", "path": str(models["gpt2"])},
                      "data": {"path": str(corpus)}, "sweep": {"context_cache": True}})


@pytest.mark.parametrize("shape, attn", [("llama_8q2kv", "sdpa"), ("gpt2", "eager")])
def test_multiple_choice_prefix_reuse_equals_the_plain_path_bit_for_bit(setup, shape, attn, tmp_path):
    """``data.task: multiple_choice`` too: every single-head and all-but-one mask, reuse == plain exactly."""
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter

    _, _, models = setup
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"context": c, "choices": ch, "gold": g}) + "\n" for c, ch, g in QUESTIONS))
    model = CausalLMModel(path=str(models[shape]), attn_implementation=attn)
    runs = {reuse: load_causal_lm_adapter(model, CausalLMData(path=str(path), task="multiple_choice"),
                                          RuntimeOptions(batch_size=4, masks_per_batch=1, reuse=reuse))
            for reuse in (True, False)}
    assert runs[True].reuse_note.startswith("prefix")
    heads = list(runs[True].gates.inventory.heads)
    masks = [[]] + [[h] for h in heads] + [[h for h in heads if h.layer == g.layer and h != g] for g in heads]
    plain = runs[False].values(masks)
    assert np.array_equal(runs[True].values(masks), plain)  # exact
    # the context cache (sweep.context_cache), masks packed: within rounding (other matrix shapes), same answers
    cached = load_causal_lm_adapter(model, CausalLMData(path=str(path), task="multiple_choice"),
                                    CausalLMRuntime(batch_size=4, context_cache=True))
    assert cached.reuse_note.startswith("context cache")
    assert_routes_agree(cached.values(masks), plain, depth=DEPTH, width=WIDTH)  # summation order
    assert [o.stats.tolist() for o in cached.evaluate(masks)] == [o.stats.tolist() for o in runs[False].evaluate(masks)]


def test_multiple_choice_task_equals_the_same_questions_as_an_lm_eval_task(setup, tmp_path):
    """``data.task: multiple_choice`` on a JSONL file and the same questions as an lm-eval task: the same outcomes
    and scores; log-likelihoods within rounding (multiple choice sums its tokens in float64, lm-eval in float32)."""
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter

    _, tasks, models = setup
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"context": c, "choices": ch, "gold": g}) + "\n" for c, ch, g in QUESTIONS))
    model = CausalLMModel(path=str(models["llama_8q2kv"]), attn_implementation="eager")
    mc = load_causal_lm_adapter(model, CausalLMData(path=str(path), task="multiple_choice"),
                                RuntimeOptions(batch_size=1))
    lm = adapter(models["llama_8q2kv"], data(tasks, ["tiny_mc"]))
    mask = [Head("self", 1, 3)]
    for m in ([], mask):
        ours, theirs = mc.evaluate([m])[0], lm.evaluate([m])[0]
        assert np.array_equal(ours.stats, theirs.stats) and ours.score == theirs.score  # exact: 0/1 outcomes
        assert_routes_agree(ours.loss, theirs.loss, depth=DEPTH, width=WIDTH)


def test_rolling_metrics_from_summed_statistics_and_their_tests(setup):
    """word_perplexity, byte_perplexity and bits_per_byte from summed [loglikelihood, words, bytes] equal lm-eval's
    aggregations of the same documents; the run's default tests (bootstrap, t-test) take them."""
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity

    from headsweep.sweep.configuration.sections import SignificanceSection
    from headsweep.sweep.statistics.significance_runner import raw_tests, tests_for
    from headsweep.workers.core.metrics import metric_by_name

    _, tasks, models = setup
    a = adapter(models["llama_8q2kv"], data(tasks, ["tiny_rolling"], metric="bits_per_byte"), batch_size=4)
    base, masked = (o.stats for o in a.evaluate([[], [Head("self", 0, 1)]]))
    words, size = [(s[0], s[1]) for s in base.tolist()], [(s[0], s[2]) for s in base.tolist()]
    # other: numpy's pairwise sums against lm-eval's Python sums, float64
    assert metric_by_name("word_perplexity").score(base) == pytest.approx(weighted_perplexity(words), rel=1e-12)
    assert metric_by_name("byte_perplexity").score(base) == pytest.approx(weighted_perplexity(size), rel=1e-12)
    assert metric_by_name("bits_per_byte").score(base) == pytest.approx(bits_per_byte(size), rel=1e-12)
    tests = tests_for(SignificanceSection(), "bits_per_byte")
    assert tests == ["paired_bootstrap", "paired_ttest"]
    results = raw_tests("bits_per_byte", base, masked[None], tests, 200, 1)
    assert all(0 <= float(r.p_value[0]) <= 1 for r in results)


def test_several_tasks_pool_their_documents(setup):
    """Two multiple-choice tasks: their documents side by side, the score the accuracy over both, each task's own
    aggregate in the facts; a metric one task lacks (acc_norm) is NaN there and refused as the run's metric."""
    _, tasks, models = setup
    both = adapter(models["llama_8q2kv"], data(tasks, ["tiny_mc", "tiny_mc2"]))
    one, two = (adapter(models["llama_8q2kv"], data(tasks, [t])).evaluate([[]])[0] for t in ("tiny_mc", "tiny_mc2"))
    out = both.evaluate([[]])[0]
    assert np.array_equal(out.stats[:, 0], np.concatenate([one.stats[:, 0], two.stats[:, 0]]))  # exact
    assert np.isnan(out.stats[len(QUESTIONS):, 1]).all()
    assert out.score == out.stats[:, 0].mean()
    assert both.describe().facts["baseline_by_task"] == {"tiny_mc": one.score, "tiny_mc2": two.score}
    assert both.example_ids[len(QUESTIONS)] == "tiny_mc2/0"
    with pytest.raises(HeadsweepError, match="lm-eval task 'tiny_mc2' does not compute acc_norm"):
        check_data(data(tasks, ["tiny_mc", "tiny_mc2"], metric="acc_norm"))


def test_importance_differentiates_the_gold_continuations(setup):
    """Gradient importance reads the documents' loss: the gold choices' summed NLL, equal to the stored losses."""
    from headsweep.workers.analyses.importance import gradient_importance

    _, tasks, models = setup
    a = adapter(models["llama_8q2kv"], data(tasks, ["tiny_mc"]))
    batches = a.loss_batches(None, torch.float32).batches
    with torch.no_grad():
        total = sum(float(b.loss()) for b in batches)
    assert total == pytest.approx(float(a.evaluate([[]])[0].loss.sum()), rel=1e-5)  # other: float32 sums, two orders
    scores = gradient_importance(a, per_token=False, normalize=False).scores
    assert len(scores) == 16 and all(v >= 0 for v in scores.values()) and max(scores.values()) > 0


def test_bad_input_is_one_line(setup):
    _, tasks, models = setup
    cases = {
        "unknown lm-eval task 'tiny_mcc' (near matches: tiny_mc": data(tasks, ["tiny_mcc"]),
        "is a generate_until task: headsweep scores log-likelihood tasks": data(tasks, ["tiny_gen"]),
        "data.num_fewshot 4 is more than the 3 documents task 'tiny_mc' has": data(tasks, ["tiny_mc"], num_fewshot=4),
        "dataset someorg/notcached is not in the local datasets cache": data(tasks, ["tiny_hub"]),
        "data.tasks mixes output types": data(tasks, ["tiny_mc", "tiny_rolling"]),
        "data.metric bits_per_byte does not apply to multiple_choice tasks": data(tasks, ["tiny_mc"],
                                                                                   metric="bits_per_byte"),
        "data.limit must be at least 1": data(tasks, ["tiny_mc"], limit=0),
        "data.include_path not found": data(tasks / "nowhere", ["tiny_mc"]),
        "data.path does not apply to data.task lm_eval": data(tasks, ["tiny_mc"], path="x.jsonl"),
    }
    for message, cfg in cases.items():
        with pytest.raises(HeadsweepError, match=None) as info:
            check_data(cfg)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    broken = tasks.parent / "broken"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken\ndataset_path: json\n  bad: [\n")
    with pytest.raises(HeadsweepError, match=r"unknown lm-eval task 'broken' in data.include_path: task file "
                                             r".*broken.yaml does not parse as YAML: line 3"):
        check_data(data(broken, ["broken"]))
    # a choice that tokenizes to nothing: found once the model's tokenizer encodes the requests
    empty = tasks.parent / "empty"
    empty.mkdir()
    (empty / "e.jsonl").write_text(json.dumps({"q": "the cat", "opts": ["runs", " "], "label": 0}) + "\n")
    body = yaml.safe_load((tasks / "tiny_mc.yaml").read_text())
    body.update(task="tiny_empty", dataset_kwargs={"data_files": {"test": str(empty / "e.jsonl")}})
    body.pop("training_split")
    (empty / "tiny_empty.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(HeadsweepError, match="document 0: a continuation tokenizes to nothing"):
        adapter(models["llama_8q2kv"], data(empty, ["tiny_empty"]))


# -- Python in task files: run only with data.trust_task_code ---------------------------------------------------
EVIL_MODULE = """from pathlib import Path
Path(__file__).with_name("RAN").write_text("task code ran")
def process_docs(dataset):
    return dataset
class EvilTask:
    pass
"""
TRUST = "headsweep runs no code from a config unless you trust it: set data.trust_task_code: true (only for task files "


def code_task(folder: Path, tasks: Path, name: str, **entries: str) -> Path:
    """``folder`` holding ``evilmod.py`` (it writes ``RAN`` beside itself when imported) and task ``name``: the
    tiny_mc task with ``entries`` added as written (YAML text: tags included)."""
    folder.mkdir(exist_ok=True)
    (folder / "evilmod.py").write_text(EVIL_MODULE)
    body = yaml.safe_load((tasks / "tiny_mc.yaml").read_text()) | {"task": name}
    text = yaml.safe_dump(body) + "".join(f"{key}: {value}\n" for key, value in entries.items())
    (folder / f"{name}.yaml").write_text(text)
    return folder / f"{name}.yaml"


def test_task_code_is_refused_unless_trusted(setup, tmp_path):
    """Each way an lm-eval task file makes lm-eval run Python: refused on the driver, one line naming the file, its
    line and the entry; the module never imported (``RAN`` not written). lm-eval's own tasks are not scanned."""
    _, tasks, _ = setup
    ran = tmp_path / "RAN"
    function = code_task(tmp_path, tasks, "code_fn", process_docs="!function evilmod.process_docs")
    line = len(function.read_text().splitlines())
    cases = {
        "code_fn": f"lm-eval task file {function}: line {line}: `!function evilmod.process_docs` makes lm-eval "
                   f"import and run Python from the task folder; {TRUST}you trust), or remove the entry",
        "code_class": "`!function evilmod.EvilTask`",
        "code_class_name": "`class:` (a Python task class)",
    }
    code_task(tmp_path, tasks, "code_class", **{"class": "!function evilmod.EvilTask"})
    code_task(tmp_path, tasks, "code_class_name", **{"class": "evilmod.EvilTask"})
    # a task that includes a file carrying code, and a group whose member carries it
    (tmp_path / "base.yaml").write_text("process_docs: !function evilmod.process_docs\n")
    code_task(tmp_path, tasks, "code_include", include="base.yaml")
    cases["code_include"] = f"lm-eval task file {tmp_path / 'base.yaml'}: line 1: `!function"
    (tmp_path / "group.yaml").write_text(yaml.safe_dump({"group": "code_group", "task": ["code_fn"]}))
    cases["code_group"] = f"lm-eval task file {function}: line {line}: `!function"
    for name, expected in cases.items():
        with pytest.raises(HeadsweepError) as info:
            check_data(data(tmp_path, [name]))
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert not ran.exists(), name
    # a template that reaches Python: rendered in Jinja's sandbox, which refuses it
    code_task(tmp_path, tasks, "code_jinja")
    body = yaml.safe_load((tmp_path / "code_jinja.yaml").read_text())
    body["doc_to_text"] = "{{ cycler.__init__.__globals__.os.system('touch " + str(ran) + "') }}{{q}}"
    (tmp_path / "code_jinja.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(HeadsweepError) as info:
        check_data(data(tmp_path, ["code_jinja"]))
    assert str(info.value) == (
        "lm-eval task 'code_jinja': a template of its task file reaches into Python (access to attribute '__init__' "
        "of 'type' object is unsafe), which would run code; headsweep renders task templates in Jinja's sandbox "
        "unless you trust them: set data.trust_task_code: true (only for task files you trust), or fix the template")
    assert not ran.exists()
    # trusted: lm-eval runs it (the module and the template)
    check_data(data(tmp_path, ["code_jinja"], trust_task_code=True))
    assert ran.exists()
    # tasks without code in the same folder run untrusted, with ordinary templates rendered as lm-eval renders them
    ran.unlink()
    plain = load_tasks(data(tasks, ["tiny_mc"]))[0]
    assert [[r.arguments for r in reqs] for reqs in plain.requests] == [
        [r.arguments for r in reqs] for reqs in load_tasks(data(tasks, ["tiny_mc"], trust_task_code=True))[0].requests]


def test_include_path_may_name_one_task_file(setup):
    """Documented: a folder of task files, or one such file (lm-eval itself indexes folders only); the file's
    ``include:`` entries are found beside it."""
    _, tasks, _ = setup
    folder = load_tasks(data(tasks, ["tiny_mc"], num_fewshot=2))[0]
    single = load_tasks(data(tasks / "tiny_mc.yaml", ["tiny_mc"], num_fewshot=2))[0]
    assert single.docs == folder.docs and len(single.docs) == len(QUESTIONS)
    assert [[r.arguments for r in reqs] for reqs in single.requests] == [
        [r.arguments for r in reqs] for reqs in folder.requests]


def code_run_config(tmp_path: Path, setup) -> tuple[Path, Path]:
    """A run of task ``code_fn`` (its ``process_docs`` a ``!function`` of ``tasks/evilmod.py``) on the tiny GPT-2;
    returns the config and the task file."""
    _, tasks, models = setup
    evil = code_task(tmp_path / "tasks", tasks, "code_fn", process_docs="!function evilmod.process_docs")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"kind": "hf_causal_lm", "path": str(models["gpt2"])},
        "data": {"task": "lm_eval", "tasks": ["code_fn"], "include_path": "tasks"},
        "sweep": {"experiments": ["baseline"], "workers": 1}}))
    return config, evil


def test_task_code_is_refused_through_the_cli(setup, tmp_path):
    """Refused before Ray starts (no --address: a run that reached the workers would start Ray and say so), exit 2,
    nothing written, the module not imported."""
    config, evil = code_run_config(tmp_path, setup)
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "workers ready" not in proc.stderr, proc.stderr
    assert error_line(proc.stderr) == (
        f"headsweep: error: lm-eval task file {evil}: line {len(evil.read_text().splitlines())}: `!function "
        f"evilmod.process_docs` makes lm-eval import and run Python from the task folder; {TRUST}you trust), or "
        "remove the entry")
    assert not store.exists() and not (tmp_path / "tasks" / "RAN").exists()


@pytest.mark.slow  # the trusted path end to end; test_task_code_is_refused_unless_trusted runs it on the driver
def test_trusted_task_code_runs_through_the_cli(setup, tmp_path, ray_address):
    """With data.trust_task_code and include_path naming the one task file, the run completes and the module ran
    (in the driver's check and the worker)."""
    import duckdb

    config, evil = code_run_config(tmp_path, setup)
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "data.trust_task_code=true", f"data.include_path={evil}",
                   "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tasks" / "RAN").exists()
    (n_examples,), = duckdb.sql(f"SELECT n_examples FROM {duck(store, 'evaluations')}").fetchall()
    assert n_examples == len(QUESTIONS)


def duck(store: Path, table: str) -> str:
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


def test_sweep_through_the_cli_with_a_cached_hub_dataset(setup, tmp_path):
    """A task over a Hub dataset in the local datasets cache (offline), through the real CLI: single heads with
    t-test and McNemar rows, per-document statistics read back from Parquet; then a task that cannot run: one
    line, exit 2, nothing written."""
    import duckdb

    root, tasks, models = setup
    home = tmp_path / "hf"
    _cache_hub_dataset(home, "someorg/tinyq", root / "tasks" / "mc_test.jsonl")
    hub_tasks = tmp_path / "tasks"
    hub_tasks.mkdir()
    body = yaml.safe_load((tasks / "tiny_hub.yaml").read_text())
    (hub_tasks / "hub.yaml").write_text(yaml.safe_dump({**body, "task": "hub_mc", "dataset_path": "someorg/tinyq"}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"kind": "hf_causal_lm", "path": str(models["llama_8q2kv"]), "attn_implementation": "eager"},
        "data": {"task": "lm_eval", "tasks": ["hub_mc"], "include_path": "tasks"},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 1}}))
    store = tmp_path / "store"
    env = {"HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets")}
    # an embedded Ray (no --address): its workers inherit this HF_HOME, the session's Ray has its own
    proc = run_cli("run", str(config), "--store", str(store), "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    con = duckdb.connect()
    evals = con.sql(f"SELECT eval_id, experiment, metric, score FROM {duck(store, 'evaluations')}").fetchall()
    assert len(evals) == 1 + 16 and {e[2] for e in evals} == {"accuracy"}
    stats = con.sql(f"SELECT e.eval_id, list(x.stats ORDER BY x.example_id) FROM {duck(store, 'examples')} x JOIN "
                    f"{duck(store, 'evaluations')} e USING (run_id, eval_id) GROUP BY e.eval_id").fetchall()
    by_eval = {k: np.array(v) for k, v in stats}
    for eval_id, _, _, score in evals:
        assert score == by_eval[eval_id][:, 0].mean()  # exact: accuracy over 6 documents
    tests = con.sql(f"SELECT DISTINCT test FROM {duck(store, 'significance')}").fetchall()
    assert {t for (t,) in tests} == {"paired_ttest", "mcnemar_exact"}
    (facts,), = con.sql(f"SELECT facts FROM {duck(store, 'runs')} WHERE run_id = '{run_id}'").fetchall()
    assert json.loads(facts)["lm_eval_tasks"] == ["hub_mc"]
    # the documents stored once per run (the inputs table): context and numbered choices, gold as the reference
    inputs = con.sql(f"SELECT example_id, position, input FROM {duck(store, 'inputs')} ORDER BY position").fetchall()
    assert inputs == [(f"hub_mc/{d}", d, f"{c} | choices: " + " / ".join(f"{i}:  {x}" for i, x in enumerate(ch)))
                      for d, (c, ch, _) in enumerate(QUESTIONS)]
    references = con.sql(f"SELECT DISTINCT example_id, reference FROM {duck(store, 'examples')}").fetchall()
    assert sorted(references) == sorted((f"hub_mc/{d}", str(g)) for d, (_, _, g) in enumerate(QUESTIONS))
    # not cached (another HF_HOME): refused on the driver, one line naming the dataset
    refused = run_cli("run", str(config), "--store", str(tmp_path / "none"), "--quiet",
                      env={"HF_HOME": str(tmp_path / "empty-home"), "HF_DATASETS_CACHE": str(tmp_path / "e")})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "dataset someorg/tinyq is not in the local datasets cache" in error_line(refused.stderr)
    assert not (tmp_path / "none").exists()


def test_drilldown_choice_scores_equal_simple_evaluate_on_weight_surgery(setup):
    """Every choice's log-likelihood a drill-down recomputes (``headsweep report --attention``) on the documents
    it shows (the adapter loaded on those alone, as the report loads it), against lm-eval's own per-choice
    log-likelihoods (``simple_evaluate``'s samples) on the model and on the copy whose head's ``o_proj`` input
    columns are zero; the gold is lm-eval's target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headsweep.sweep.reporting.drill_scores import choice_scores

    _, tasks, models = setup
    head, docs = "self:1:2", (1, 3)
    a = LmEvalAdapter(CausalLMModel(path=str(models["llama_8q2kv"]), attn_implementation="eager"),
                      data(tasks, ["tiny_mc"]), RuntimeOptions(batch_size=1, masks_per_batch=1, examples=docs))
    found = choice_scores(a, [(head, f"tiny_mc/{d}", row) for row, d in enumerate(docs)])
    model = AutoModelForCausalLM.from_pretrained(models["llama_8q2kv"], attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(models["llama_8q2kv"])
    routes = {"baseline": lm_eval_route(model, tokenizer, tasks, ["tiny_mc"]),
              "masked": lm_eval_route(zeroed_output_columns(model, [Head.parse(head)]), tokenizer, tasks, ["tiny_mc"])}
    assert [t.example_id for t in found] == [f"tiny_mc/{d}" for d in docs]
    for t, d in zip(found, docs, strict=True):
        assert (t.choices, t.gold) == ([" " + c for c in QUESTIONS[d][1]], QUESTIONS[d][2])
        for side, result in routes.items():
            sample = next(s for s in result["samples"]["tiny_mc"] if s["doc_id"] == d)
            assert getattr(t, side) == [float(r[0][0]) for r in sample["resps"]], side  # exact, as lm-eval sums
    assert found[0].masked != found[0].baseline  # the head matters


def _cache_hub_dataset(home: Path, repo: str, jsonl: Path) -> None:
    """What ``datasets.load_dataset(repo)`` leaves in ``HF_HOME`` once it has run with network: built here in a
    child process from a local file (its cache folder named as the Hub dataset's would be)."""
    import subprocess
    import sys

    code = f"""
import datasets, glob, json, os, shutil
d = datasets.load_dataset("json", data_files={{"test": {str(jsonl)!r}}})
src = glob.glob(os.path.join(datasets.config.HF_DATASETS_CACHE, "json", "*", "*", "*"))[0]
org, name = {repo!r}.split("/")
dst = os.path.join(datasets.config.HF_DATASETS_CACHE, f"{{org}}___{{name}}", "default", "0.0.0", "h")
shutil.copytree(src, dst)
os.rename(os.path.join(dst, "json-test.arrow"), os.path.join(dst, f"{{name}}-test.arrow"))
"""
    env = {"HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
