"""The LM head and loss a slice of the vocabulary at a time (``model.vocab_slices``), against the loss over whole
logits (``F.cross_entropy`` through ``scoring.target_nll``, the route every perplexity took before), a float64
reference, and a case with a known answer; and a model that changes its logits after the head (Gemma 2's
soft-cap), which must keep the whole logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_causal_lm
from tolerances import assert_routes_agree

from headsweep.workers.families.hf_causal_lm.model.scoring import shifted_nll, target_nll
from headsweep.workers.families.hf_causal_lm.model.vocab_slices import SlicedHeadNLL, sliced_nll

IN, VOCAB = 24, 1000


def head_of(bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    head = torch.nn.Linear(IN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.normal_(0, 0.5)
        if bias:
            head.bias.normal_(0, 1.0)
    return head


@pytest.mark.parametrize("columns", [7, 512, VOCAB, 4096])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_sliced_nll_equals_the_loss_over_whole_logits(columns, bias):
    head = head_of(bias)
    hidden = torch.randn(3, 17, IN)
    targets = torch.randint(0, VOCAB, (3, 17))
    targets[0, 0], targets[1, 1] = 0, VOCAB - 1  # the first and last columns' slices
    got = sliced_nll(hidden, head, targets, columns)
    whole = target_nll(head(hidden), targets)
    exact = F.cross_entropy(head.double()(hidden.double()).reshape(-1, VOCAB), targets.reshape(-1),
                            reduction="none").view(targets.shape)
    assert got.shape == targets.shape and got.dtype == torch.float32
    # summation order: the head's products (width IN) and the log-sum-exp over VOCAB terms, taken in slices
    assert_routes_agree(got, whole, depth=1, width=VOCAB, what="sliced against whole logits")
    assert_routes_agree(got, exact, depth=1, width=VOCAB, dtype=torch.float32, what="sliced against float64")


@torch.inference_mode()
def test_sliced_nll_of_equal_logits_is_log_of_the_vocabulary():
    head = torch.nn.Linear(IN, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(3.0)
    got = sliced_nll(torch.randn(2, 5, IN), head, torch.randint(0, VOCAB, (2, 5)), 300)
    # other: every logit equal, so each token's probability is 1 / VOCAB; float32 rounds log(1000) once
    assert torch.allclose(got.double(), torch.full((2, 5), math.log(VOCAB), dtype=torch.float64), rtol=0,
                          atol=4 * torch.finfo(torch.float32).eps * math.log(VOCAB))


@torch.inference_mode()
def test_bfloat16_hidden_states_give_a_float32_loss():
    head = head_of(False).to(torch.bfloat16)
    hidden = torch.randn(2, 9, IN, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (2, 9))
    got = sliced_nll(hidden, head, targets, 128)
    assert got.dtype == torch.float32
    # summation order: the same bfloat16 products, float32 log-sum-exps of slices against one over all
    assert_routes_agree(got, target_nll(head(hidden), targets), depth=1, width=VOCAB, dtype=torch.float32)


def test_a_target_outside_the_vocabulary_is_refused():
    with pytest.raises(IndexError, match="outside the LM head's 1000 words"):
        sliced_nll(torch.randn(1, 2, IN), head_of(False), torch.tensor([[3, VOCAB]]), 100)


@pytest.mark.parametrize("keep", [None, 5, 12])
@torch.inference_mode()
def test_a_causal_lm_is_scored_in_slices_as_by_its_whole_logits(keep):
    model = tiny_causal_lm("llama_8q2kv", vocab_size=3000)
    inputs = torch.randint(4, 3000, (3, 12))
    needed = (keep or 12) - 1
    extra = {} if keep is None else {"logits_to_keep": keep}
    scorer = SlicedHeadNLL(model, columns=512)
    first, again = scorer(inputs, needed, **extra), scorer(inputs, needed, **extra)
    assert scorer.sliced is True
    whole = shifted_nll(model(input_ids=inputs, use_cache=False).logits[:, -(needed + 1) :], inputs)
    assert first.shape == whole.shape == (3, needed)
    assert torch.equal(first, again)  # exact: the checking pass and the passed-through one feed the same floats
    # summation order: slices of 512 of the 3,000 logits against all of them (and the model's two layers)
    assert_routes_agree(first, whole, depth=2, width=3000, what="sliced against the model's logits")


@torch.inference_mode()
def test_a_model_that_soft_caps_its_logits_keeps_the_whole_logits():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=700, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                    final_logit_softcapping=2.0, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    inputs = torch.randint(0, 700, (2, 10))
    scorer = SlicedHeadNLL(model, columns=64)
    got = scorer(inputs, 9)
    assert scorer.sliced is False
    whole = shifted_nll(model(input_ids=inputs, use_cache=False).logits, inputs)
    assert torch.equal(got, whole)  # exact: the same logits and loss
    assert torch.equal(scorer(inputs, 9), whole)
