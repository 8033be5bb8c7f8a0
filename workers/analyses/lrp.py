"""Head relevance by layer-wise relevance propagation (Voita et al. 2019 sec. 4, after Ding et al. 2017).

A head's relevance is the share of the relevance of the model's top-1 logit that flows through that head,
summed over the explained predictions (a classifier's examples, a translation's target tokens, a language
model's scored tokens) and divided by their number, then normalised within each (attention type, layer) so a
layer's heads sum to 1 (``importance.method: lrp``, written to the ``importance`` table like the gradient
method).

How relevance is propagated: the conservative rules of Ali et al. 2022 ("XAI for Transformers: Better
Explanations through Conservative Propagation"), the same rules lxt's AttnLRP uses for these layers, applied
so that Gradient x Input of the rewritten network *is* LRP-0 (the z-rule) on it:

* attention probabilities are held constant (the AH rule: ``softmax`` is detached), as Ding et al. treat
  attention weights as part of the weight matrix; relevance then flows to the values only;
* layer and RMS normalisation divide by a constant (the LN rule: the standard deviation / ``rsqrt`` is
  detached), which makes them linear maps;
* elementwise nonlinearities (GELU, ReLU, SiLU, tanh in a pooler) pass relevance through unchanged (the
  identity rule: ``f(x)`` is computed as ``x * (f(x) / x)`` with the ratio detached);
* a gated feed-forward layer's product ``act(gate) * up`` (Llama, Mistral, Qwen, Gemma; T5 v1.1 / mT5's
  ``act(wi_0) * wi_1``) splits relevance evenly between its two factors (the uniform rule, as AttnLRP).

Forward values are unchanged (up to rounding in the rewritten normalisations); only the backward pass
differs. A head's relevance at a token is then ``<ctx_h, dY/dctx_h>``, exactly the per-token gate gradient
that gradient importance computes (:func:`~headsweep.workers.analyses.importance.batch_gate_gradients`), with ``Y`` the
sum of the explained top-1 logits (a translation's: the teacher-forced logits at its reference tokens, fairseq's
and transformers' encoder-decoder models alike). With every bias zero the rules conserve relevance exactly: each
layer's input holds ``Y`` (tests/experiments/test_lrp.py checks it for BERT, Llama-style, fairseq, Marian, FSMT and
T5 v1.1 models, and checks one layer against an explicit z-rule propagation written out by hand); with biases,
part of the relevance is absorbed by them, as in any LRP-0.

The rules need the attention probabilities as a tensor, so the model runs the path that exposes them for the
analysis (``ModelFamily.attention_weights``: transformers models the eager attention path, fairseq modules their
Python path).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from headsweep.errors import HeadsweepError
from headsweep.workers.analyses.importance import ImportanceResult, batch_gate_gradients, loss_batches_of
from headsweep.workers.core.family import EvalAdapter, LossBatch
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.registry import family_of_model

LOSS_NAME = "sum of the top-1 logits of the explained predictions"

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_RSQRT = {torch.rsqrt, torch.Tensor.rsqrt}
_ACTIVATIONS = {F.gelu, F.relu, F.silu, F.tanh, torch.tanh, torch.Tensor.tanh, torch.relu, torch.Tensor.relu}
_ACTIVATION_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh)


def _identity_rule(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` as ``x * (y / x)`` with the ratio detached (0 where ``x`` is 0, where ``x``'s relevance is 0 anyway)."""
    ratio = torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, torch.ones_like(x), x))
    return x * ratio.detach()


def _layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    centred = x - x.mean(dim=dims, keepdim=True)
    std = torch.sqrt(centred.pow(2).mean(dim=dims, keepdim=True) + eps)
    y = centred / std.detach()
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def _rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps).detach()
    return y * weight if weight is not None else y


class ConservativeRules(TorchFunctionMode):
    """While active, torch's softmax, normalisations and elementwise activations take the LRP rules above."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SOFTMAX:
            return func(*args, **kwargs).detach()
        if func in _RSQRT:
            return func(*args, **kwargs).detach()
        if func is F.layer_norm:
            return _layer_norm(*args, **kwargs)
        if func is getattr(F, "rms_norm", None):
            return _rms_norm(*args, **kwargs)
        if func in _ACTIVATIONS:
            return _identity_rule(args[0], func(*args, **kwargs))
        return func(*args, **kwargs)


# Gated feed-forward layers ``down(act(gate(x)) * up(x))`` by their attribute names (gate, up, down, activation):
# Llama-style models, and T5 v1.1 / mT5 / UMT5's ``DenseGatedActDense``.
GATED_MLPS = (("gate_proj", "up_proj", "down_proj", "act_fn"), ("wi_0", "wi_1", "wo", "act"))


def _gated_mlp(module: nn.Module) -> tuple[str, str, str, str] | None:
    """The attribute names of ``module``'s gated feed-forward layer, or None if it is not one."""
    for names in GATED_MLPS:
        *linear, act = names
        if all(isinstance(getattr(module, n, None), nn.Module) for n in linear) and callable(
                getattr(module, act, None)):
            return names
    return None


def _module_rules(model: nn.Module) -> list:
    """Forward hooks giving activation modules the identity rule and gated MLPs the uniform rule."""
    handles = []

    def identity(_module: nn.Module, args: tuple, out: Any) -> Any:
        return _identity_rule(args[0], out) if torch.is_tensor(out) and torch.is_tensor(args[0]) else out

    def uniform(names: tuple[str, str, str, str]) -> Any:
        gate_name, up_name, down_name, act_name = names

        def hook(module: nn.Module, args: tuple, _out: Any) -> torch.Tensor:
            x = args[0]
            act, up = getattr(module, act_name)(getattr(module, gate_name)(x)), getattr(module, up_name)(x)
            down = getattr(module, down_name)
            # The product's value, with half the relevance to each factor (in the down projection's dtype, as T5
            # keeps ``wo`` in float32).
            product = 0.5 * (act * up.detach()) + 0.5 * (act.detach() * up)
            weight = getattr(down, "weight", None)
            return down(product.to(weight.dtype) if torch.is_tensor(weight) and weight.is_floating_point() else product)

        return hook

    from transformers import activations

    for module in model.modules():
        if isinstance(module, _ACTIVATION_MODULES) or type(module).__module__ == activations.__name__:
            handles.append(module.register_forward_hook(identity))
        elif (names := _gated_mlp(module)) is not None:
            handles.append(module.register_forward_hook(uniform(names)))
    return handles


@contextmanager
def lrp_rules(adapter: EvalAdapter) -> Iterator[None]:
    """While inside, the adapter's model propagates gradients by the conservative LRP rules (attention read on
    the path that exposes its probabilities)."""
    model, sites = adapter.model, adapter.gates.sites
    family = family_of_model(model)
    handles = _module_rules(model)
    try:
        with ExitStack() as stack:
            stack.enter_context(family.attention_weights(model, sites, lambda _key, _weights: None))
            stack.enter_context(ConservativeRules())
            yield
    finally:
        for handle in handles:
            handle.remove()


def top_logit_batch(batch: LossBatch, counted: list[int]) -> LossBatch:
    """``batch`` whose scalar is the sum of the top-1 logits of its explained predictions (their number is
    appended to ``counted`` at each call)."""
    if batch.outputs is None:
        raise HeadsweepError("this model family's task exposes no logits to explain, so LRP relevance cannot be "
                             "computed; use importance.method: gradient")

    def explained() -> torch.Tensor:
        logits, keep = batch.outputs()
        top = logits.max(dim=-1).values
        counted.append(int(keep.sum()))
        return (top * keep.to(top.dtype)).sum()

    return LossBatch(batch.tokens, batch.n_examples, explained, batch.outputs)


def share_by_layer(scores: dict[Head, float]) -> dict[Head, float]:
    """Each head's share of its layer's summed relevance (NaN for a layer whose relevance sums to 0)."""
    totals: dict[SiteKey, float] = {}
    for head, value in scores.items():
        totals[head.site] = totals.get(head.site, 0.0) + value
    return {h: v / totals[h.site] if totals[h.site] else float("nan") for h, v in scores.items()}


def lrp_relevance(adapter: EvalAdapter, normalize: bool = True, mask: Sequence[Head] = ()) -> ImportanceResult:
    """LRP relevance of every head of ``adapter``'s model on its data (see the module docstring).

    ``raw[h]``: relevance through head h summed over tokens and predictions, divided by the number of explained
    predictions (signed: a head can carry negative relevance). ``normalized[h]``: its share of the layer's sum.
    ``scores`` is ``normalized`` when ``normalize``. Heads in ``mask`` stay gated off and score 0.
    """
    gates = adapter.gates
    for head in mask:
        gates.inventory.check(head)
    masked = tuple(sorted(set(mask)))
    prepared = loss_batches_of(adapter, None)
    counted: list[int] = []
    batches = [top_logit_batch(b, counted) for b in prepared.batches]
    totals = {site.key: torch.zeros(site.num_heads, dtype=torch.float64) for site in gates.sites}
    tokens = dict.fromkeys(totals, 0)
    explained_sum, n_examples = 0.0, 0
    with lrp_rules(adapter):
        for batch in batch_gate_gradients(adapter, masked, batches):
            explained_sum += batch.loss
            n_examples += batch.n_examples
            for key, grad in batch.grads.items():
                totals[key] += grad.detach().to(torch.float64).sum(tuple(range(grad.dim() - 1))).cpu()
                tokens[key] += int(batch.tokens[key].sum())
    predictions = sum(counted)
    if predictions == 0:
        raise HeadsweepError("no predictions to explain (the data has no scored tokens or examples)")
    raw = {head: float(totals[head.site][head.head]) / predictions
           for layer in gates.inventory.layers for head in layer.heads()}
    for head in masked:
        raw[head] = 0.0
    normalized = share_by_layer(raw)
    notes = [f"{a}:{layer}: relevance sums to 0 in this layer, shares are NaN"
             for (a, layer) in {h.site for h, v in normalized.items() if v != v}]
    return ImportanceResult(scores=dict(normalized if normalize else raw), raw=raw, normalized=normalized,
                            per_token=True, normalize=normalize, masked=masked, tokens=tokens,
                            n_examples=n_examples, loss=explained_sum, loss_name=LOSS_NAME, notes=notes)


def lrp_on_worker(worker: Any, data_cfg: Any, normalize: bool, mask: Sequence[Head] = ()) -> ImportanceResult:
    """Worker-side step of ``importance`` with ``method: lrp`` (``EvalWorker.run``), on ``data_cfg``'s adapter."""
    return lrp_relevance(worker.adapter(data_cfg), normalize=normalize, mask=mask)


def lrp_problem_on_worker(worker: Any, data_cfg: Any) -> str | None:
    """Why relevance propagation cannot read the attention of this worker's model (None when it can), asked before
    anything is written: the family's attention path entered and left, as :func:`lrp_rules` enters it."""
    adapter = worker.adapter(data_cfg)
    model = adapter.model
    try:
        with family_of_model(model).attention_weights(model, adapter.gates.sites, lambda _key, _weights: None):
            pass
    except HeadsweepError as exc:
        return f"importance.method lrp: {exc}; use importance.method gradient"
    return None
