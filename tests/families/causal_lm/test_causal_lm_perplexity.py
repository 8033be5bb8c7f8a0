"""Perplexity of a causal LM: the window convention, statistics equal to the model's own loss on each window,
masked evaluations equal to the weight-surgery route, corpus formats, and the one-line errors of the adapter."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats as scipy_stats
from tiny_models import build_lm_tokenizer, lm_text, save_tiny_causal_lm, zeroed_output_columns
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.sweep.statistics.significance_runner import raw_tests
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.core.metrics import PERPLEXITY
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.corpus import plan_windows
from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

WINDOW = 16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, one_thread):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("models") / "tiny-llama", "llama_8q2kv")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(lm_text(230, seed=3))
    return path


def adapter(model_dir, data_path, **data):
    data.setdefault("window", WINDOW)
    return CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="eager"),
                           CausalLMData(path=str(data_path), **data), RuntimeOptions(batch_size=3))


# -- the window convention -------------------------------------------------------------------------------

def scored_positions(n, window, stride, bos):
    """Text token indices each window scores, from the windows' own description."""
    spans = [w.scored_tokens(bos) for w in plan_windows(n, window, stride, bos)]
    return [list(range(first, last + 1)) for first, last in spans]


def test_windows_without_overlap_score_all_but_each_first_token():
    windows = plan_windows(50, 8, None, False)
    assert [(w.start, w.length, w.score_from) for w in windows] == [(s, 8, 1) for s in range(0, 48, 8)]
    assert scored_positions(50, 8, None, False)[:2] == [list(range(1, 8)), list(range(9, 16))]
    # the last partial window (tokens 48, 49) is dropped
    assert plan_windows(7, 8, None, False) == [] and len(plan_windows(8, 8, None, False)) == 1


def test_bos_windows_score_every_text_token_once():
    windows = plan_windows(50, 8, None, True)
    assert [(w.start, w.length, w.score_from) for w in windows] == [(s, 7, 1) for s in range(0, 43, 7)]
    assert sum(scored_positions(50, 8, None, True), []) == list(range(49))


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("stride", [1, 3, 5])
def test_sliding_windows_score_each_token_once_with_the_longest_context(stride, bos):
    n, window = 40, 8
    spans = scored_positions(n, window, stride, bos)
    flat = sum(spans, [])
    text = window - (1 if bos else 0)
    assert flat == list(range(0 if bos else 1, flat[-1] + 1))  # contiguous, each token once
    assert all(len(s) == stride for s in spans[1:])  # later windows score only their new tokens
    last_start = plan_windows(n, window, stride, bos)[-1].start
    assert last_start + text <= n < last_start + text + stride  # the last window that fits
    with pytest.raises(HeadsweepError, match="data.stride must be between 1 and"):
        plan_windows(n, window, text + 1, bos)


# -- statistics against the model's own loss --------------------------------------------------------------

def direct_nll(model, inputs: torch.Tensor, score_from: list[int]) -> np.ndarray:
    """The model's own loss (transformers' causal LM loss, mean over labelled tokens) times the number of
    tokens, one window at a time, with every position before ``score_from`` labelled -100."""
    sums = []
    with torch.no_grad():
        for row, first in zip(inputs, score_from, strict=True):
            labels = row.clone()
            labels[:first] = -100
            out = model(input_ids=row[None], labels=labels[None], use_cache=False)
            sums.append(float(out.loss) * (len(row) - first))
    return np.array(sums)


@pytest.mark.parametrize("data", [{}, {"add_bos": True}, {"stride": 5}, {"stride": 4, "add_bos": True}],
                         ids=["plain", "bos", "stride", "stride-bos"])
def test_statistics_equal_the_models_loss_on_each_window(llama_dir, corpus, data):
    a = adapter(llama_dir, corpus, **data)
    tokenizer = build_lm_tokenizer()
    ids = tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"]
    assert a.data_facts["corpus_tokens"] == len(ids)
    # The windows hold the corpus's tokens (after BOS where asked), in order.
    for w, row in zip(a.windows, a.inputs, strict=True):
        text = row[1:] if data.get("add_bos") else row
        assert text.tolist() == ids[w.start : w.start + w.length]
        assert not data.get("add_bos") or int(row[0]) == tokenizer.bos_token_id
    out = a.evaluate([[]])[0]
    score_from = [w.score_from for w in a.windows]
    expected = direct_nll(a.model, a.inputs, score_from)
    assert out.stats[:, 1].tolist() == [WINDOW - f for f in score_from]  # exact: token counts
    # summation order: batched windows against one at a time; the loss's mean then times n (float32 throughout)
    assert_routes_agree(out.stats[:, 0], expected, depth=2 + 1, width=WINDOW * 64, what=data)
    ppl = float(np.exp(expected.sum() / out.stats[:, 1].sum()))
    assert out.score == pytest.approx(ppl, rel=1e-5)  # other: float32 losses summed over a few hundred tokens
    assert out.score == PERPLEXITY.score(out.stats)  # exact: the same function of the same rows
    np.testing.assert_array_equal(out.loss, out.stats[:, 0] / out.stats[:, 1])  # exact: the per-window mean NLL
    info = a.describe()
    assert info.metric == "perplexity" and info.stat_names == ["nll_sum", "n_tokens"]
    assert info.facts["mean_nll_nats"] == pytest.approx(np.log(out.score), rel=1e-12)  # other: log of exp
    assert info.facts["kv_groups"]["self:1"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert info.facts["num_key_value_heads"] == {"self:0": 2, "self:1": 2}


def test_masked_perplexity_equals_the_weight_surgery_route(llama_dir, corpus):
    a = adapter(llama_dir, corpus)
    masks = [[Head("self", 0, 5)], [Head("self", 1, h) for h in range(8) if h != 2]]
    outs = a.evaluate(masks)
    for mask, out in zip(masks, outs, strict=True):
        expected = direct_nll(zeroed_output_columns(a.model, mask), a.inputs, [w.score_from for w in a.windows])
        # summation order: several masks per forward (one batch of k copies) against one window at a time
        assert_routes_agree(out.stats[:, 0], expected, depth=2 + 1, width=WINDOW * 64, what=mask)
        assert abs(out.score - a.baseline().score) > 1e-3  # other: masking these heads changes perplexity


def test_masks_packed_in_one_pass_equal_one_at_a_time(llama_dir, corpus):
    masks = [[], [Head("self", 0, 1)], [Head("self", 1, 7), Head("self", 0, 0)], [Head("self", 1, 3)]]
    packed = adapter(llama_dir, corpus)
    packed.runtime.masks_per_batch = 4
    single = adapter(llama_dir, corpus)
    single.runtime.masks_per_batch = 1
    a, b = packed.nll(masks), single.nll(masks)
    # summation order: 4 x 3 windows per forward against 3; 2 layers and the LM head
    assert_routes_agree(a, b, depth=2 + 1, width=WINDOW * 64)


def test_ttest_runs_on_mean_nll_per_window(llama_dir, corpus):
    a = adapter(llama_dir, corpus)
    base, masked = (o.stats for o in a.evaluate([[], [Head("self", 0, 4)]]))
    (boot, ttest) = raw_tests("perplexity", base, masked[None], ["paired_bootstrap", "paired_ttest"], 200, 1)
    expected = scipy_stats.ttest_rel(masked[:, 0] / masked[:, 1], base[:, 0] / base[:, 1])
    # other: scipy against our closed form, both float64
    assert ttest.statistic[0] == pytest.approx(expected.statistic, rel=1e-9)
    assert ttest.p_value[0] == pytest.approx(expected.pvalue, rel=1e-9)
    assert boot.statistic[0] == pytest.approx(PERPLEXITY.score(masked) - PERPLEXITY.score(base), rel=1e-12)


# -- corpus formats -----------------------------------------------------------------------------------------

def test_jsonl_parquet_and_gz_give_the_same_windows(llama_dir, corpus, tmp_path):
    lines = corpus.read_text().splitlines()
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": line, "id": i}) + "\n" for i, line in enumerate(lines)))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": lines}), parquet)
    gz = tmp_path / "c.txt.gz"
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    reference = adapter(llama_dir, corpus).inputs
    for path, extra in ((jsonl, {}), (parquet, {"text_column": "body"}), (gz, {})):
        assert torch.equal(adapter(llama_dir, path, **extra).inputs, reference), path


# -- one-line errors ---------------------------------------------------------------------------------------

def test_errors(llama_dir, corpus, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("the cat sees a dog\n")
    with pytest.raises(HeadsweepError, match=r"too short: 5 tokens, fewer than one window of 16"):
        adapter(llama_dir, short)
    with pytest.raises(HeadsweepError, match="data.window 65 is above the model's maximum of 64 positions"):
        adapter(llama_dir, corpus, window=65)
    with pytest.raises(HeadsweepError, match="data.stride must be between 1 and the window's 16 text tokens"):
        adapter(llama_dir, corpus, stride=17)
    with pytest.raises(HeadsweepError, match="tokenizer directory not found"):
        CausalLMAdapter(CausalLMModel(path=str(llama_dir), tokenizer=str(tmp_path / "nope")),
                        CausalLMData(path=str(corpus), window=WINDOW), RuntimeOptions())
    with pytest.raises(HeadsweepError, match="fetch it with `headsweep fetch meta-llama/Llama-3.2-1B`"):
        adapter("meta-llama/Llama-3.2-1B", corpus)


# -- gradient importance through loss_batches ------------------------------------------------------------

def test_gradient_importance_equals_finite_differences_of_the_corpus_nll(tmp_path, corpus):
    from headsweep.workers.analyses.importance import gradient_importance

    # GPT-2 computes in float64 throughout when asked (Llama's RMSNorm and rotary tables stay float32).
    model_dir = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    a = CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="eager", dtype="float64"),
                        CausalLMData(path=str(corpus), window=WINDOW), RuntimeOptions(batch_size=64))
    assert len(a.batches) == 1  # one batch: batch-level importance is |dL/dxi| of the whole corpus
    result = gradient_importance(a, per_token=False)
    per_token = gradient_importance(a, per_token=True)
    tokens = len(a.windows) * WINDOW
    assert result.loss_name == "token cross-entropy" and set(result.tokens.values()) == {tokens}
    (batch,) = a.loss_batches(None, torch.float64).batches

    def corpus_nll(site, head, value):
        gate = torch.ones(site.num_heads, dtype=torch.float64)
        gate[head] = value
        a.gates.set_values({site.key: gate})
        try:
            with torch.no_grad():
                return float(batch.loss())
        finally:
            a.gates.clear()

    base = a.baseline()
    assert corpus_nll(a.gates.sites[0], 0, 1.0) == pytest.approx(base.stats[:, 0].sum(), rel=1e-9)
    eps = 1e-5
    for site in a.gates.sites:
        for head in (0, 3):
            derivative = (corpus_nll(site, head, 1 + eps) - corpus_nll(site, head, 1 - eps)) / (2 * eps)
            h = Head("self", site.layer, head)
            # other: float64 central differences (truncation ~eps^2, rounding ~1e-16 * loss / eps) against autograd
            assert result.raw[h] * tokens == pytest.approx(abs(derivative), rel=1e-6)
            assert per_token.raw[h] >= result.raw[h] - 1e-12  # |sum| <= sum |.|
    work = a.workload(batch_size=5, max_length=8)
    assert (work.examples, work.tokens) == (5, 40)
    assert work.run(a.model).logits.shape[:2] == (5, 8)
