"""Which transformers encoder-decoder models relevance propagation (``importance.method: lrp``) covers.

The conservative rules of :mod:`headsweep.workers.analyses.lrp` rewrite the operations a block is made of: softmax
(attention probabilities held constant, so T5's relative-position bias and the attention mask, added to the scores,
take no relevance), LayerNorm and T5's RMSNorm without mean (the standard deviation held constant), elementwise
activations (GELU, ReLU, SiLU / swish: identity rule) and gated feed-forward products (T5 v1.1 / mT5 ``wi_0``,
``wi_1``: uniform rule). FSMT (fairseq's WMT19 models) is BART-style, time-first; MVP is BART's blocks. In a
mixture-of-experts feed-forward layer (NLLB-MoE's top-2, Switch Transformers' top-1 router) the router's softmax is
held constant as the attention probabilities are: the choice of experts and their weights are fixed by the forward
pass, and relevance flows through the chosen experts in proportion to their weighted outputs. A block made of
anything else (PegasusX's local / global blocks and their learned global tokens) would leak or invent relevance
silently, so only the model types whose blocks are made of those operations alone are accepted; the rest are
refused in one line before anything is written (``lrp_problem_on_worker``).
"""

from __future__ import annotations

from torch import nn

# BART-style blocks (eager_attention_forward, LayerNorm, an ACT2FN activation between two linear layers, or routed
# experts of that form) and T5-style ones (T5Attention with its relative-position bias, RMSNorm, DenseActDense or
# DenseGatedActDense, or routed experts of that form).
BART_STYLE = ("bart", "mbart", "marian", "m2m_100", "pegasus", "plbart", "blenderbot", "blenderbot-small", "fsmt",
              "mvp", "nllb-moe")
T5_STYLE = ("t5", "mt5", "umt5", "switch_transformers")
COVERED = BART_STYLE + T5_STYLE


def relevance_problem(model: nn.Module) -> str | None:
    """Why the LRP rules do not cover ``model``'s blocks (None when they do)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in COVERED:
        return None
    return (f"relevance propagation (LRP) rules are written for BART-style ({', '.join(BART_STYLE)}) and T5-style "
            f"({', '.join(T5_STYLE)}) blocks, not for {type(model).__name__} (model_type {model_type!r})")
