"""Multiple-choice accuracy of a causal LM in lm-evaluation-harness's convention (``data.task: multiple_choice``).

Each route is checked against one written out here from lm-eval's source (``TemplateLM.loglikelihood`` and
``_encode_pair`` in lm_eval/api/model.py, ``HFLM._loglikelihood_tokens`` in lm_eval/models/huggingface.py,
``ConfigurableTask.process_results`` for ``multiple_choice`` in lm_eval/api/task.py): per-choice
log-likelihoods from a full forward pass of one request at a time, acc / acc_norm by numpy's argmax rules,
masked heads against weight surgery, a real sweep through the CLI with McNemar and t-test rows against scipy,
and bad lines refused with one line and nothing written.
"""

from __future__ import annotations

import json
import random

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from scipy import stats as sps
from tiny_models import LM_SPECIALS, LM_WORDS, save_tiny_causal_lm, tiny_causal_lm, zeroed_output_columns
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import SignificanceSection
from headsweep.sweep.statistics import significance_runner
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.core.metrics import ACCURACY, MC_ACCURACY_NORM, METRICS, metric_by_name
from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice import MultipleChoiceAdapter
from headsweep.workers.families.hf_causal_lm.tasks.continuations.questions import read_questions

MAX_POSITIONS = 64
# Summation order (tolerances.py): padded batches of several rows (and several masks) against one request at a
# time; 2 decoder layers and the LM head, inner products no longer than the feed-forward width (2 x 32).
DEPTH, WIDTH = 2 + 1, 64

# Word-level questions: a context with trailing whitespace, an empty context (BOS alone), choices of very
# different lengths (so that acc and acc_norm can disagree), a word the tokenizer does not know.
WORD_QUESTIONS = [
    ("the cat sees", ["a dog", "the big red bird", "a tree here"]),
    ("the dog likes ", ["a", "the small green house there"]),
    ("", ["the cat runs", "a bird sleeps quickly"]),
    ("a bird eats", ["the", "slowly and then today", "red river"]),
    ("the big cat runs quickly and then", ["sleeps", "eats a red tree", "a", "then"]),
    ("here the zebra sleeps", ["today", "there and here"]),
]
# Character-level questions: spaces are tokens, so moving the context's trailing whitespace to the
# continuation changes what is scored; the last context is longer than the model's 64 positions.
CHAR_QUESTIONS = [
    ("the cat sees ", ["a dog", "the big red bird"]),
    ("a dog  ", ["runs", "eats a tree"]),
    ("", ["cat", "a small bird"]),
    ("the big red bird sees the small green dog and then the cat runs quickly to the river", ["here", "there"]),
]
CHARS = list("abcdefghijklmnopqrstuvwxyz .,")


def char_tokenizer():
    """Every character its own token (spaces included), with the same special tokens as the word-level one."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(LM_SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def word_lm(tmp_path_factory, one_thread):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("models") / "tiny-llama", "llama_8q2kv")


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("models") / "tiny-gpt2-chars"
    tokenizer = char_tokenizer()
    model = tiny_causal_lm("gpt2", "eager", vocab_size=len(tokenizer), max_positions=MAX_POSITIONS, seed=3)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# -- lm-eval's convention, written out from its source --------------------------------------------------------

def lm_eval_request(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``TemplateLM.loglikelihood`` for one request: an empty context is the prefix token (BOS); otherwise
    ``_encode_pair`` (trailing context whitespace moved to the continuation, continuation tokens sliced off the
    whole encoding), ``tok_encode`` without special tokens as HFLM does for causal models."""
    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    if context == "":
        return [tokenizer.bos_token_id], enc(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole, context_enc = enc(context + continuation), enc(context)
    return context_enc, whole[len(context_enc):]


def direct_loglikelihood(model, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, list[int]]:
    """``HFLM._loglikelihood_tokens`` for one request, alone in its batch: the input is
    ``(context + continuation)[-(max_length + 1):][:-1]``, and the log-likelihood the sum of the log-softmax at
    the last ``len(continuation)`` positions, taken at the continuation tokens. Returns it and the input."""
    ids = (context_enc + continuation_enc)[-(MAX_POSITIONS + 1):][:-1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    first = len(ids) - len(continuation_enc)
    return sum(float(logp[first + k, t]) for k, t in enumerate(continuation_enc)), ids


def direct_scores(model, tokenizer, questions, delimiter=" "):
    """Per question: the choices' log-likelihoods, and each request's (input, continuation) tokens."""
    lls, tokens = [], []
    for context, choices in questions:
        row_lls, row_tokens = [], []
        for choice in choices:
            ctx, cont = lm_eval_request(tokenizer, context, delimiter + choice)
            ll, ids = direct_loglikelihood(model, ctx, cont)
            row_lls.append(ll)
            row_tokens.append((tuple(ids), tuple(cont)))
        lls.append(np.array(row_lls))
        tokens.append(row_tokens)
    return lls, tokens


def by_hand(lls, choices, gold) -> list[float]:
    """``process_results`` for one question: acc and acc_norm (the choice's length in characters)."""
    completion_len = np.array([float(len(c)) for c in choices])
    return [1.0 if np.argmax(lls) == gold else 0.0, 1.0 if np.argmax(lls / completion_len) == gold else 0.0]


def pick_gold(lls, choices, i) -> int:
    """Golds that make every outcome appear: where acc and acc_norm pick different choices, the one acc_norm
    picks (acc 0, acc_norm 1); elsewhere the likeliest or another choice, by turns."""
    plain = int(np.argmax(lls))
    norm = int(np.argmax(lls / np.array([float(len(c)) for c in choices])))
    if plain != norm:
        return norm
    return plain if i % 2 == 0 else (plain + 1) % len(choices)


def write_questions(path, questions, golds, fields=("context", "choices", "gold")):
    path.write_text("".join(json.dumps({fields[0]: c, fields[1]: ch, fields[2]: g}) + "\n"
                            for (c, ch), g in zip(questions, golds, strict=True)))
    return path


def mc_adapter(model_dir, path, batch_size=3, **data) -> MultipleChoiceAdapter:
    adapter = load_causal_lm_adapter(CausalLMModel(path=str(model_dir), attn_implementation="eager"),
                                     CausalLMData(path=str(path), task="multiple_choice", **data),
                                     RuntimeOptions(batch_size=batch_size))
    assert isinstance(adapter, MultipleChoiceAdapter)
    return adapter


def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


# -- (a) log-likelihoods and (b) acc / acc_norm ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["word", "char"])
def test_loglikelihoods_and_outcomes_equal_lm_evals_rules(kind, word_lm, char_lm, tmp_path):
    model_dir, questions = (word_lm, WORD_QUESTIONS) if kind == "word" else (char_lm, CHAR_QUESTIONS)
    model, tokenizer = loaded(model_dir)
    lls, tokens = direct_scores(model, tokenizer, questions)
    golds = [pick_gold(ll, ch, i) for i, (ll, (_, ch)) in enumerate(zip(lls, questions, strict=True))]
    a = mc_adapter(model_dir, write_questions(tmp_path / "q.jsonl", questions, golds))

    # The requests: the same input and continuation tokens as lm-eval builds (exact: token ids).
    rows = [[(r.inputs, r.targets) for r in a.rows if r.question == q] for q in range(len(questions))]
    assert rows == tokens
    # The log-likelihoods of every choice.
    got = a.loglikelihoods([[]])[0]
    flat = np.concatenate(lls)
    assert_routes_agree(got, flat, depth=DEPTH, width=WIDTH, what=kind)
    assert np.all(flat < 0)  # other: log-probabilities of real tokens

    # acc and acc_norm, by hand on the direct log-likelihoods (exact: 0/1 outcomes).
    base = a.evaluate([[]])[0]
    expected = [by_hand(ll, ch, g) for ll, (_, ch), g in zip(lls, questions, golds, strict=True)]
    assert base.stats.tolist() == expected
    assert [0.0, 1.0] in expected  # a question where acc and acc_norm disagree
    assert base.score == np.mean([e[0] for e in expected])  # exact: the metric is accuracy (choice_score acc)
    assert base.outputs == [str(int(np.argmax(ll))) for ll in lls]
    assert_routes_agree(base.loss, [-ll[g] for ll, g in zip(lls, golds, strict=True)], depth=DEPTH, width=WIDTH)
    facts = a.describe().facts
    assert (facts["baseline_acc"], facts["baseline_acc_norm"]) == tuple(np.mean(expected, axis=0))
    assert facts["task"] == "multiple_choice" and facts["questions"] == len(questions)

    if kind == "char":
        space = tokenizer.convert_tokens_to_ids(" ")
        # "the cat sees " + " a dog": the context's space moves to the continuation, so two spaces are scored
        assert tokens[0][0][1][:3] == (space, space, tokenizer.convert_tokens_to_ids("a"))
        assert tokens[0][0][0][-1] != space
        assert tokens[2][0][0][0] == tokenizer.bos_token_id  # the empty context is BOS alone
        # the long context is cut from the left to the model's 64 positions
        assert all(len(ids) == MAX_POSITIONS for ids, _ in tokens[3])
        assert facts["truncated_questions"] == 1 and "context cut from the left" in facts["warnings"][0]
    else:
        inputs, cont = tokens[2][1]  # empty context: BOS alone, then the continuation (its last token only scored)
        assert inputs == (tokenizer.bos_token_id, *cont[:-1]) and len(cont) == 4
        assert facts["truncated_questions"] == 0


def test_continuation_tokens_are_sliced_off_the_whole_encoding(word_lm, tmp_path):
    """``_encode_pair``: the continuation is ``encode(context + continuation)[len(encode(context)):]`` and the
    model reads ``encode(context)`` before it, even where the two encodings differ at the seam."""
    model, tokenizer = loaded(word_lm)
    # "the ca" + "t sees": the whole text is "the cat sees" (3 words); the context alone is "the <unk>".
    questions = [("the ca", ["t sees", "t runs"]), ("a dog", [" eats", " sleeps here"])]
    lls, tokens = direct_scores(model, tokenizer, questions, delimiter="")
    a = mc_adapter(word_lm, write_questions(tmp_path / "q.jsonl", questions, [0, 1]), target_delimiter="")
    unk, sees = tokenizer.convert_tokens_to_ids("<unk>"), tokenizer.convert_tokens_to_ids("sees")
    assert tokens[0][0] == ((tokenizer.convert_tokens_to_ids("the"), unk), (sees,))
    assert [(r.inputs, r.targets) for r in a.rows] == [t for row in tokens for t in row]  # exact: token ids
    kept = a.loglikelihoods([[]])[0]
    assert_routes_agree(kept, np.concatenate(lls), depth=DEPTH, width=WIDTH)
    # Without logits_to_keep (models that lack it): every position's logits, the scored ones taken after.
    assert a._keep_logits
    a._keep_logits = False
    # summation order: the LM head over every position against the kept ones only
    assert_routes_agree(a.loglikelihoods([[]])[0], kept, depth=DEPTH, width=WIDTH)


def test_acc_norm_run_reports_the_normalised_column(word_lm, tmp_path):
    model, tokenizer = loaded(word_lm)
    lls, _ = direct_scores(model, tokenizer, WORD_QUESTIONS)
    golds = [pick_gold(ll, ch, i) for i, (ll, (_, ch)) in enumerate(zip(lls, WORD_QUESTIONS, strict=True))]
    a = mc_adapter(word_lm, write_questions(tmp_path / "q.jsonl", WORD_QUESTIONS, golds), choice_score="acc_norm",
                   max_questions=4)
    info = a.describe()
    assert (info.metric, info.stat_names) == ("accuracy_norm", ["correct", "correct_norm"])
    assert info.facts["questions"] == 4 and info.facts["questions_available"] == len(WORD_QUESTIONS)
    base = a.baseline()
    expected = [by_hand(ll, ch, g) for ll, (_, ch), g in zip(lls[:4], WORD_QUESTIONS[:4], golds[:4], strict=True)]
    assert base.stats.tolist() == expected  # exact: 0/1 outcomes
    assert base.score == np.mean([e[1] for e in expected])  # exact: the mean of the correct_norm column
    norm = [int(np.argmax(ll / np.array([float(len(c)) for c in ch])))
            for ll, (_, ch) in zip(lls[:4], WORD_QUESTIONS[:4], strict=True)]
    assert base.outputs == [str(p) for p in norm]


# -- (c) a masked head equals weight surgery ---------------------------------------------------------------------

def test_masked_heads_equal_the_weight_surgery_route(word_lm, tmp_path):
    _, tokenizer = loaded(word_lm)
    model, _ = loaded(word_lm)
    base_lls, _ = direct_scores(model, tokenizer, WORD_QUESTIONS)
    golds = [pick_gold(ll, ch, i) for i, (ll, (_, ch)) in enumerate(zip(base_lls, WORD_QUESTIONS, strict=True))]
    a = mc_adapter(word_lm, write_questions(tmp_path / "q.jsonl", WORD_QUESTIONS, golds))
    masks = [[Head("self", 0, 5)], [Head("self", 1, h) for h in range(8) if h != 2], [Head("self", 0, 0)]]
    a.runtime.masks_per_batch = 3  # all three masks in one forward pass per batch
    outs = a.evaluate(masks)
    packed = a.loglikelihoods(masks)
    for mask, out, got in zip(masks, outs, packed, strict=True):
        lls, _ = direct_scores(zeroed_output_columns(model, mask), tokenizer, WORD_QUESTIONS)
        assert_routes_agree(got, np.concatenate(lls), depth=DEPTH, width=WIDTH, what=mask)
        assert not np.allclose(np.concatenate(lls), np.concatenate(base_lls), atol=1e-3)  # other: the head matters
        expected = [by_hand(ll, ch, g) for ll, (_, ch), g in zip(lls, WORD_QUESTIONS, golds, strict=True)]
        assert out.stats.tolist() == expected  # exact: 0/1 outcomes
    a.runtime.masks_per_batch = 1
    # summation order: three masks per forward against one
    assert_routes_agree(a.loglikelihoods(masks), packed, depth=DEPTH, width=WIDTH)


def test_loss_batches_sum_the_gold_continuations_and_workload_runs(word_lm, tmp_path):
    a = mc_adapter(word_lm, write_questions(tmp_path / "q.jsonl", WORD_QUESTIONS, [0] * len(WORD_QUESTIONS)))
    batches = a.loss_batches(None, torch.float64)
    assert sum(b.n_examples for b in batches.batches) == len(WORD_QUESTIONS)
    with torch.no_grad():
        total = sum(float(b.loss()) for b in batches.batches)
    gold_lls = [a.loglikelihoods([[]])[0][r] for r in a.gold_rows]
    # summation order: gold rows batched apart from the other choices; the loss in float64 logits
    assert_routes_agree(total, -np.sum(gold_lls), depth=DEPTH, width=WIDTH)
    for b in batches.batches:  # the real tokens: every unpadded position, per site
        assert all(t.shape == next(iter(b.tokens.values())).shape for t in b.tokens.values())
    work = a.workload(5, 0)
    assert work.examples == 5 and work.run(a.model).logits.shape[0] == 5


# -- significance on per-question outcomes ------------------------------------------------------------------------

def expected_mcnemar(base, system) -> float:
    b = int(np.sum((base == 1) & (system == 0)))
    c = int(np.sum((base == 0) & (system == 1)))
    return 1.0 if b + c == 0 else sps.binomtest(c, b + c, 0.5).pvalue


def expected_ttest(base, system) -> float:
    d = system - base
    if np.all(d == d[0]):  # zero variance: headsweep's documented values (scipy gives NaN)
        return 1.0 if d[0] == 0 else 0.0
    return float(sps.ttest_rel(system, base).pvalue)


def test_mcnemar_and_ttest_use_each_metrics_own_column():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, size=(40, 2)).astype(np.float64)
    system = base.copy()
    system[:12, 0] = 1 - system[:12, 0]  # acc changes on 12 questions, acc_norm on 5 others
    system[20:25, 1] = 1 - system[20:25, 1]
    for name, col in (("accuracy", 0), ("accuracy_norm", 1)):
        assert significance_runner.tests_for(SignificanceSection(), name) == ["paired_ttest", "mcnemar_exact"]
        ttest, mcnemar = significance_runner.raw_tests(name, base, system[None], ["paired_ttest", "mcnemar_exact"],
                                                       10, 0)
        # other: closed forms against scipy, float64
        assert mcnemar.p_value[0] == pytest.approx(expected_mcnemar(base[:, col], system[:, col]), rel=1e-9)
        assert ttest.p_value[0] == pytest.approx(expected_ttest(base[:, col], system[:, col]), rel=1e-9)
    # one registered "accuracy" serves classifiers ([correct]) and multiple choice ([correct, correct_norm])
    assert metric_by_name("accuracy") is ACCURACY and METRICS["accuracy_norm"] is MC_ACCURACY_NORM
    assert ACCURACY.score(base[:, :1]) == ACCURACY.score(base) == base[:, 0].mean()
    assert MC_ACCURACY_NORM.score(base) == base[:, 1].mean()
    with pytest.raises(HeadsweepError, match="mcnemar_exact needs binary outcomes"):
        significance_runner.tests_for(SignificanceSection(tests=["mcnemar_exact"]), "perplexity")


# -- (d) a sweep through the CLI ----------------------------------------------------------------------------------

def random_questions(n: int, seed: int):
    rng = random.Random(seed)
    words = list(LM_WORDS)
    out = []
    for _ in range(n):
        context = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        choices = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 4))]
        out.append((context, choices))
    return out


def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


@pytest.fixture(scope="module")
def sweep_files(tmp_path_factory, word_lm):
    tmp = tmp_path_factory.mktemp("mc-sweep")
    questions = random_questions(40, seed=4)
    golds = [random.Random(i).randrange(len(ch)) for i, (_, ch) in enumerate(questions)]
    data = write_questions(tmp / "questions.jsonl", questions, golds, fields=("ctx", "endings", "label"))
    return tmp, data, questions, golds


def mc_config(path, model_dir, data_file, **data):
    cfg = {
        "name": "mc-sweep",
        "model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {"path": str(data_file), "task": "multiple_choice", "context_field": "ctx",
                 "choices_field": "endings", "gold_field": "label", **data},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": 16},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


# acc_norm through the CLI is the slow variant: its scoring is tested in-process like acc's, and the CLI route is one
@pytest.mark.parametrize("score, metric, column", [
    ("acc", "accuracy", 0), pytest.param("acc_norm", "accuracy_norm", 1, marks=pytest.mark.slow)])
def test_sweep_through_the_cli(score, metric, column, sweep_files, word_lm, ray_address):
    tmp, data, questions, golds = sweep_files
    store = tmp / f"store-{score}"
    config = mc_config(tmp / f"{score}.yaml", word_lm, data, choice_score=score)
    proc = run_cli("run", str(config), "sweep.workers=2", "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    con = duckdb.connect()
    rows = con.sql(f"SELECT eval_id, example_id, stats, output, reference FROM {duck(store, 'examples')} "
                   f"WHERE run_id = '{run_id}' ORDER BY eval_id, CAST(substr(example_id, 2) AS INTEGER)").fetchall()
    stats: dict[str, list] = {}
    for eval_id, _, s, _, _ in rows:
        stats.setdefault(eval_id, []).append(s)
    stats = {k: np.array(v, dtype=np.float64) for k, v in stats.items()}
    evals = con.sql(f"SELECT eval_id, experiment, metric, score, baseline_score, n_examples FROM "
                    f"{duck(store, 'evaluations')} WHERE run_id = '{run_id}'").fetchall()
    assert len(evals) == 1 + 16
    (base_id,) = [e[0] for e in evals if e[1] == "baseline"]
    base = stats[base_id]
    # The stored baseline outcomes against lm-eval's rules on direct log-likelihoods (exact: 0/1 outcomes).
    model, tokenizer = loaded(word_lm)
    lls, _ = direct_scores(model, tokenizer, questions)
    assert base.tolist() == [by_hand(ll, ch, g) for ll, (_, ch), g in zip(lls, questions, golds, strict=True)]
    assert [r[4] for r in rows if r[0] == base_id] == [str(g) for g in golds]
    for eval_id, _, m, score_, baseline_score, n in evals:
        assert (m, n) == (metric, len(questions))
        assert score_ == stats[eval_id][:, column].mean()  # exact: the mean of the metric's column
        assert baseline_score == base[:, column].mean()
    (facts,), = con.sql(f"SELECT facts FROM {duck(store, 'runs')} WHERE run_id = '{run_id}'").fetchall()
    facts = json.loads(facts)
    assert (facts["baseline_acc"], facts["baseline_acc_norm"]) == tuple(base.mean(axis=0))
    assert facts["choice_score"] == score and "lm-evaluation-harness" in facts["convention"]

    # Significance: a t-test and McNemar's exact test per head, on the metric's own column, against scipy.
    tests = con.sql(f"SELECT eval_id, test, p_value FROM {duck(store, 'significance')} "
                    f"WHERE run_id = '{run_id}'").fetchall()
    assert {t for _, t, _ in tests} == {"paired_ttest", "mcnemar_exact"} and len(tests) == 2 * 16
    discordant = 0
    for eval_id, test, p in tests:
        system = stats[eval_id][:, column]
        expected = (expected_mcnemar if test == "mcnemar_exact" else expected_ttest)(base[:, column], system)
        assert p == pytest.approx(expected, rel=1e-9, abs=1e-15), (eval_id, test)  # other: scipy, float64
        discordant += int(np.any(system != base[:, column]))
    assert discordant > 0  # some single heads change some answers: the tests are not all trivially p = 1
    proc = run_cli("query", f"SELECT DISTINCT test FROM deltas WHERE run_id = '{run_id}' AND experiment = "
                   "'single_head'", "--store", str(store), "--format", "csv")
    assert proc.returncode == 0 and "paired_ttest" in proc.stdout, proc.stderr
    if score == "acc":
        check_choice_scores(store, run_id, model, tokenizer, questions, golds)


def check_choice_scores(store, run_id, model, tokenizer, questions, golds) -> None:
    """The drill-down's every choice's log-likelihood (recomputed with the model by ``headsweep report
    --attention``) on the questions of the head that turns the most answers wrong: the gold's equals the run's
    stored loss and the likeliest is its stored output, with the head kept and masked; the masked ones equal the
    weight-surgery copy's direct log-likelihoods."""
    from headsweep.results.query import connect
    from headsweep.results.store import ResultStore
    from headsweep.sweep.reporting.attention_maps import run_patterns
    from headsweep.sweep.reporting.drill_scores import ChoiceScores

    con = connect(ResultStore(str(store)))
    try:
        # the head whose removal turns the most right answers wrong (a random model's heads may help on balance)
        (worst,), = con.sql(
            "SELECT e.attention || ':' || e.layer || ':' || e.head AS name FROM examples m JOIN evaluations e "
            "USING (run_id, eval_id) JOIN examples b ON b.run_id = m.run_id AND b.example_id = m.example_id AND "
            "b.eval_id = (SELECT eval_id FROM evaluations WHERE run_id = ? AND experiment = 'baseline') "
            "WHERE m.run_id = ? AND e.experiment = 'single_head' AND b.stats[1] > m.stats[1] "
            "GROUP BY name ORDER BY count(*) DESC, name LIMIT 1", params=[run_id, run_id]).fetchall()
        run = dict(zip(("run_id", "metric", "config", "ablation"), con.sql(
            "SELECT run_id, metric, config, ablation FROM runs WHERE run_id = ?", params=[run_id]).fetchall()[0],
            strict=True))
        losses: list = []
        # questions: no attention maps; the choices of the 5 questions it changes most in either direction
        assert run_patterns(con, run, None, [worst], losses=losses, scored=5) == []
        helped = {e for (e,) in con.sql(
            "SELECT m.example_id FROM examples m JOIN evaluations e USING (run_id, eval_id) JOIN examples b ON "
            "b.run_id = m.run_id AND b.example_id = m.example_id AND b.eval_id = (SELECT eval_id FROM evaluations "
            "WHERE run_id = ? AND experiment = 'baseline') WHERE m.run_id = ? AND e.attention || ':' || e.layer || "
            "':' || e.head = ? AND e.experiment = 'single_head' AND b.stats[1] < m.stats[1]",
            params=[run_id, run_id, worst]).fetchall()}
        stored = {(experiment, example): (loss, output) for experiment, example, loss, output in con.sql(
            "SELECT e.experiment, x.example_id, x.loss, x.output FROM examples x JOIN evaluations e USING (run_id, "
            "eval_id) WHERE x.run_id = ? AND (e.experiment = 'baseline' OR e.attention || ':' || e.layer || ':' || "
            "e.head = ?)", params=[run_id, worst]).fetchall()}
    finally:
        con.close()
    scores = [t for t in losses if isinstance(t, ChoiceScores)]
    assert scores, "the worst head changes no answer: the run no longer tests the drill-down"
    assert helped & {t.example_id for t in scores}  # the questions it turns right are shown too
    surgery = zeroed_output_columns(model, [Head.parse(worst)])
    for t in scores:
        q = int(t.example_id[1:])
        assert (t.choices, t.gold) == (questions[q][1], golds[q])
        for lls, experiment in ((t.baseline, "baseline"), (t.masked, "single_head")):
            loss, output = stored[(experiment, t.example_id)]
            assert_routes_agree(np.array([lls[t.gold]]), np.array([-loss]), depth=DEPTH, width=WIDTH, what=experiment)
            assert int(np.argmax(lls)) == int(output)
        direct, _ = direct_scores(surgery, tokenizer, [questions[q]])
        assert_routes_agree(np.array(t.masked), direct[0], depth=DEPTH, width=WIDTH, what=t.example_id)


# -- (e) bad input: one line, exit 2, nothing written ---------------------------------------------------------

def fail(tmp_path, ray_address, config, message):
    from headsweep.results.store import ResultStore

    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("headsweep: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""
    for table in ("runs", "evaluations", "examples"):
        assert ResultStore(str(store)).read(table).num_rows == 0


def test_bad_lines_through_the_cli(tmp_path, word_lm, ray_address):
    """Each bad line's message from the reader every run loads its questions with (the sweep's field names); the
    last one through the CLI: that line alone, exit 2, nothing written (one run: the route is the same for any
    line the reader refuses)."""
    good = json.dumps({"ctx": "the cat", "endings": ["runs", "sleeps"], "label": 0})
    cases = {
        "gold": (json.dumps({"ctx": "a dog", "endings": ["runs", "eats"], "label": 2}),
                 "line 2: gold index 2 is out of range for 2 choices (0 to 1)"),
        "empty": (json.dumps({"ctx": "a dog", "endings": [], "label": 0}),
                  "line 2: no choices (field 'endings' is an empty list)"),
        "json": ('{"ctx": "a dog", "endings": ["runs"', "line 2 is not JSON"),
    }
    for name, (line, message) in cases.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text(f"{good}\n{line}\n{good}\n")
        config = mc_config(tmp_path / f"{name}.yaml", word_lm, data)
        with pytest.raises(HeadsweepError) as err:
            read_questions(CausalLMData(**yaml.safe_load(config.read_text())["data"]))
        assert f"data file {data}: {message}" in str(err.value) and "\n" not in str(err.value), str(err.value)
    fail(tmp_path / name, ray_address, config, f"data file {data}: {message}")


def test_bad_lines_and_settings_are_one_line(tmp_path, word_lm):
    def questions(*lines, **data):
        path = tmp_path / "q.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        return read_questions(CausalLMData(path=str(path), task="multiple_choice", **data))

    ok = {"context": "a", "choices": ["b"], "gold": 0}
    assert len(questions(json.dumps(ok), "", json.dumps(ok))) == 2  # blank lines are skipped
    bad = {
        '["a", "b"]': "line 1 is a JSON list, not an object with the fields",
        json.dumps({"context": "a", "choices": ["b"]}): "line 1 has no field 'gold' (fields: 'context', 'choices'); "
                                                        "set data.gold_field",
        json.dumps({**ok, "gold": True}): "field 'gold' is true, not the index of the right choice",
        json.dumps({**ok, "gold": 0.0}): "field 'gold' is 0.0, not the index",
        json.dumps({**ok, "gold": -1}): "gold index -1 is out of range for 1 choice (0 to 0)",
        json.dumps({**ok, "choices": "b"}): "field 'choices' is str, not a list of choices",
        json.dumps({**ok, "choices": ["b", 3]}): "choice 1 is int, not text",
        json.dumps({**ok, "context": None}): "field 'context' is NoneType, not text",
    }
    for line, message in bad.items():
        with pytest.raises(HeadsweepError, match="line 1") as err:
            questions(line)
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(HeadsweepError, match="holds no questions"):
        questions("")
    with pytest.raises(HeadsweepError, match="data file not found"):
        read_questions(CausalLMData(path=str(tmp_path / "none.jsonl"), task="multiple_choice"))

    settings = {
        (("task", "mc"),): "data.task must be perplexity, multiple_choice, paired or lm_eval, got 'mc'",
        (("task", "multiple_choice"), ("window", 16)): "data.window applies to data.task perplexity",
        (("max_questions", 3),): "data.max_questions applies to data.task multiple_choice, not perplexity",
        (("task", "multiple_choice"), ("choice_score", "f1")): "data.choice_score must be acc or acc_norm",
        (("task", "multiple_choice"), ("max_questions", 0)): "data.max_questions must be at least 1",
        (("task", "multiple_choice"), ("gold_field", "context")): "must name three different JSONL fields",
        (("task", "multiple_choice"), ("format", "parquet")): "data.task multiple_choice reads JSONL",
    }
    for pairs, message in settings.items():
        with pytest.raises(HeadsweepError) as err:
            CausalLMData(path="q.jsonl", **dict(pairs)).check()
        assert message in str(err.value), str(err.value)

    # Tokenised lines the convention cannot score: a context of whitespace alone (lm-eval asserts on it), a choice
    # that adds no token.
    for line, message in (({"context": "  ", "choices": ["a dog"], "gold": 0}, "has no tokens once its trailing"),
                          ({"context": "a cat", "choices": ["dog", ""], "gold": 0}, "choice 1 ('') adds no token")):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(line) + "\n")
        with pytest.raises(HeadsweepError, match="line 1") as err:
            mc_adapter(word_lm, path)
        assert message in str(err.value)
