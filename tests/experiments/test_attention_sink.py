"""The attention-sink role (causal attention): a tiny GPT-2 whose head 0:2 attends to the window's first position (its
BOS) by construction is the one head that ``head_roles`` calls ``attention_sink``, with the share the model's own eager
attention weights give; hand-built maps check the threshold and that bidirectional sites have no share."""

from __future__ import annotations

import pytest
import torch
from tiny_models import lm_text, save_tiny_causal_lm

from headsweep.sweep.experiments.roles.settings import RolesSection
from headsweep.workers.attention.head_roles import (
    ATTENTION_SINK,
    RoleTotals,
    SiteAttention,
    TokenSide,
    sentence_statistics,
)

SINK = (0, 2)  # layer, head


def make_sink(model_dir, bos: int) -> None:
    """Rewrite layer 0 head 2 of the saved GPT-2 so that every query attends to the BOS token: its query is a
    constant (weights 0, bias c), its key reads a zero-sum direction u of the layer input that only the BOS embedding
    has (u projected out of every other token and position embedding, so layer norm keeps it 0 there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    width = model.config.n_embd
    hd = width // model.config.n_head
    u = torch.zeros(width)
    u[0], u[1] = 1.0, -1.0
    u = u / u.norm()
    with torch.no_grad():
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        wte -= torch.outer(wte @ u, u)
        wpe -= torch.outer(wpe @ u, u)
        wte[bos] += 4.0 * u
        attn = model.transformer.h[SINK[0]].attn.c_attn  # Conv1D: weight (in, 3 * width) = [q | k | v]
        q = slice(SINK[1] * hd, (SINK[1] + 1) * hd)
        k = slice(width + SINK[1] * hd, width + (SINK[1] + 1) * hd)
        c = torch.ones(hd)
        attn.weight[:, q] = 0.0
        attn.bias[q] = c
        attn.weight[:, k] = 40.0 * torch.outer(u, c)
        attn.bias[k] = 0.0
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def sink_adapter(tmp_path_factory):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    tmp = tmp_path_factory.mktemp("sink")
    model_dir = save_tiny_causal_lm(tmp / "gpt2", "gpt2", layers=2)
    make_sink(model_dir, bos=2)
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(200, seed=3))
    return CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="eager"),
                           CausalLMData(path=str(corpus), window=16, add_bos=True), RuntimeOptions(batch_size=8))


def test_the_constructed_head_is_the_one_sink_with_the_models_own_share(sink_adapter, one_thread):
    from headsweep.sweep.experiments.roles.worker import head_roles

    adapter = sink_adapter
    result = head_roles(adapter, "hf_causal_lm", RolesSection())
    sinks = [(h.layer, h.head) for h in result.heads if ATTENTION_SINK in h.roles]
    assert sinks == [SINK]
    # The independent route: the model's own eager attention weights, mean weight on position 0 over queries 1..
    on_first, n = {}, 0
    for idx in adapter.batches:
        with torch.no_grad():
            maps = adapter.model(input_ids=adapter.inputs[idx], use_cache=False, output_attentions=True).attentions
        for layer, w in enumerate(maps):
            for h in range(w.shape[1]):
                on_first[(layer, h)] = on_first.get((layer, h), 0.0) + float(w[:, h, 1:, 0].double().sum())
        n += len(idx) * (adapter.inputs.shape[1] - 1)
    for head in result.heads:
        expected = on_first[(head.layer, head.head)] / n
        assert head.sink_share == pytest.approx(expected, rel=1e-5, abs=1e-7)
    share = {(h.layer, h.head): h.sink_share for h in result.heads}
    assert share[SINK] > 0.99 and max(v for k, v in share.items() if k != SINK) < 0.5


def test_threshold_and_bidirectional_sites():
    ids = torch.tensor([[5, 6, 7, 8]])
    tokens = TokenSide(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids, dtype=torch.bool))
    # head 0 puts 0.6 on position 0 from every later query, head 1 0.4 (the rest on the query itself)
    w = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    w[0, :, 0, 0] = 1.0
    for q in range(1, 4):
        for h, share in enumerate((0.6, 0.4)):
            w[0, h, q, 0], w[0, h, q, q] = share, 1.0 - share
    causal = RoleTotals(2).add(sentence_statistics(SiteAttention(w, tokens, tokens, causal=True)))
    h0, h1 = causal.heads("self", 0, RolesSection())
    assert (h0.sink_share, h1.sink_share) == (pytest.approx(0.6), pytest.approx(0.4))
    assert ATTENTION_SINK in h0.roles and ATTENTION_SINK not in h1.roles
    [h1_low] = [h for h in causal.heads("self", 0, RolesSection(sink_threshold=0.3)) if h.head == 1]
    assert ATTENTION_SINK in h1_low.roles
    both = RoleTotals(2).add(sentence_statistics(SiteAttention(w, tokens, tokens, causal=False)))
    assert all(h.sink_share is None and ATTENTION_SINK not in h.roles for h in both.heads("self", 0, RolesSection()))
