"""Which transformers encoder-decoder models relevance propagation (``importance.method: lrp``) covers.

The conservative rules of :mod:`headsweep.workers.analyses.lrp` rewrite the operations a block is made of: softmax
(attention probabilities held constant, so T5's relative-position bias and the attention mask, added to the scores,
take no relevance), LayerNorm and T5's RMSNorm without mean (the standard deviation held constant), elementwise
activations (GELU, ReLU, SiLU / swish: identity rule) and gated feed-forward products (T5 v1.1 / mT5 ``wi_0``,
``wi_1``: uniform rule). A block made of anything else (a mixture-of-experts router's top-k choice, PegasusX's
local / global blocks, FSMT's time-first attention that returns its weights only when asked) would leak or invent
relevance silently, so only the model types whose blocks are made of those operations alone are accepted; the rest
are refused in one line before anything is written (``lrp_problem_on_worker``).
"""

from __future__ import annotations

from torch import nn

# BART-style blocks (eager_attention_forward, LayerNorm, an ACT2FN activation between two linear layers) and T5-style
# ones (T5Attention with its relative-position bias, RMSNorm, DenseActDense or DenseGatedActDense).
BART_STYLE = ("bart", "mbart", "marian", "m2m_100", "pegasus", "plbart", "blenderbot", "blenderbot-small")
T5_STYLE = ("t5", "mt5", "umt5")
COVERED = BART_STYLE + T5_STYLE


def relevance_problem(model: nn.Module) -> str | None:
    """Why the LRP rules do not cover ``model``'s blocks (None when they do)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in COVERED:
        return None
    return (f"relevance propagation (LRP) rules are written for BART-style ({', '.join(BART_STYLE)}) and T5-style "
            f"({', '.join(T5_STYLE)}) blocks, not for {type(model).__name__} (model_type {model_type!r})")
