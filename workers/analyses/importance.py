"""Gradient head importance (Michel et al. 2019, sec. 4.1).

``I_h = E_x |dL(x)/dxi_h|`` at ``xi = 1``: the expected absolute sensitivity of the training loss
to head h's gate, where ``dL/dxi_h = <ctx_h, dL/dctx_h>`` summed over ``d_head``. The reference
code (pmichel31415/are-16-heads-really-better-than-1) takes the absolute value per token and
divides the sum by the number of non-padding tokens; that is the default here
(``per_token=True``). transformers' bertology example instead takes the absolute value of the
gate gradient of a whole batch, so opposite-signed tokens and examples cancel first;
``per_token=False`` gives that variant, because users compare with both.

Per-token gradients come from per-token gates: every site gets a gate of ones of the
projection input's shape with its last axis replaced by H (``(B, T, H)`` batch-first,
``(T, B, H)`` time-first) that requires grad, so ``autograd`` returns ``dL/dxi_{t,h}`` for each
token exactly, with no hooks on activations.

The loss ``L(x)`` is the per-example training loss, summed over the batch (so a token's
gradient is that of its own example's loss and the per-token score does not depend on how
examples are batched). Each model family declares it through its adapter's ``loss_batches``
(``headsweep.workers.core.family.EvalAdapter``): cross-entropy for classifiers, teacher-forced
label-smoothed cross-entropy summed over the target tokens for fairseq translation. The model
runs in eval mode (no dropout).

Memory: loss batches that their adapter marks safe to recompute run with the model's blocks checkpointed, and
adapters cut their batches to the activation budget (:mod:`headsweep.workers.memory.backward_memory`); pieces of one
batch share a ``group``, whose gradients the batch-level variant sums before the absolute value, so neither
changes a score beyond summation order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import EvalAdapter, LossBatch, LossBatches
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.heads import Head, SiteKey, heads_by_site
from headsweep.workers.memory.backward_memory import blocks_of, checkpointed


@dataclass
class BatchGateGradients:
    """Per-token gate gradients of one batch.

    ``grads[site]`` has the site's per-token gate shape (``(B, T, H)`` or ``(T, B, H)``) and is
    zero at padding; ``tokens[site]`` is the matching boolean mask of real tokens (without the
    H axis); ``loss`` is the batch's summed training loss.
    """

    loss: float
    n_examples: int
    grads: dict[SiteKey, torch.Tensor]
    tokens: dict[SiteKey, torch.Tensor]


@dataclass
class ImportanceResult:
    """Head importance scores and how they were obtained.

    ``scores`` is ``normalized`` when asked for per-layer normalisation and ``raw`` otherwise.
    Masked heads are present in every dict with score 0.0 (their gate is 0, so the gradient at
    ``xi = 1`` was never computed); with per-layer normalisation they contribute nothing to the
    layer's norm. ``tokens[(attention, layer)]`` is the number of non-padding tokens the site's
    scores were averaged over (source tokens for ``enc_self``, target tokens for ``dec_self`` and
    ``enc_dec``). ``loss`` is the training loss summed over all examples, computed with the mask.
    """

    scores: dict[Head, float]
    raw: dict[Head, float]
    normalized: dict[Head, float]
    per_token: bool
    normalize: bool
    masked: tuple[Head, ...]
    tokens: dict[SiteKey, int]
    n_examples: int
    loss: float
    loss_name: str
    notes: list[str] = field(default_factory=list)

    @property
    def method(self) -> str:
        return "per_token" if self.per_token else "batch_level"


def gradient_importance(
    adapter: EvalAdapter,
    per_token: bool = True,
    normalize: bool = False,
    mask: Sequence[Head] = (),
    label_smoothing: float | None = None,
    checkpoint: bool = True,
) -> ImportanceResult:
    """Gradient head importance of every head of ``adapter``'s model on its data.

    ``adapter`` is an evaluation adapter (``model``, ``gates`` and ``loss_batches``, see
    :class:`~headsweep.workers.core.family.EvalAdapter`). Estimate on training or validation data, not
    on the test set.

    ``per_token=True`` (Michel et al.'s reference code): ``sum over tokens |dL/dxi_{t,h}|`` divided
    by the number of non-padding tokens. ``per_token=False`` (batch-level, as transformers'
    bertology example): ``sum over batches |sum over the batch's tokens dL/dxi_{t,h}|`` divided by
    the same count; it depends on how examples are batched. ``normalize`` divides each layer's
    scores (per attention type) by their L2 norm. ``mask`` lists heads already pruned: their gates
    stay 0 while the rest are estimated, and they are reported with score 0.0.
    ``label_smoothing`` (translation only) defaults to the family's training default (0.1). ``checkpoint``:
    recompute the blocks' activations in the backward pass of loss batches that allow it (False: keep them, as
    autograd does by default; the same scores, more memory).
    """
    gates = adapter.gates
    for head in mask:
        gates.inventory.check(head)
    masked = tuple(sorted(set(mask)))
    num_heads = {site.key: site.num_heads for site in gates.sites}
    totals = {key: torch.zeros(h, dtype=torch.float64) for key, h in num_heads.items()}
    counts = dict.fromkeys(num_heads, 0)
    loss_total, n_examples = 0.0, 0
    prepared = loss_batches_of(adapter, label_smoothing)
    blocks = blocks_of(adapter.model, gates.sites) if checkpoint else []
    # Batch-level: a batch cut into pieces (one group) has its summed gradient's absolute value taken once.
    group_sums: dict[SiteKey, torch.Tensor] = {}
    group: object = None

    def close_group() -> None:
        for key, summed in group_sums.items():
            totals[key] += summed.abs()
        group_sums.clear()

    for batch, gradients in zip(prepared.batches, batch_gate_gradients(adapter, masked, prepared.batches, blocks),
                                strict=True):
        if not per_token and (batch.group is None or batch.group != group):
            close_group()
            group = batch.group
        loss_total += gradients.loss
        n_examples += gradients.n_examples
        for key, grad in gradients.grads.items():
            lead = tuple(range(grad.dim() - 1))
            grad = grad.detach().to(torch.float64)
            if per_token:
                totals[key] += grad.abs().sum(lead).cpu()
            else:
                group_sums[key] = group_sums.get(key, 0) + grad.sum(lead).cpu()
            counts[key] += int(gradients.tokens[key].sum())
    close_group()

    raw: dict[Head, float] = {}
    notes = []
    for layer in gates.inventory.layers:
        key = (layer.attention, layer.layer)
        if counts[key] == 0:
            notes.append(f"{layer.attention}:{layer.layer}: no non-padding tokens, scores set to 0")
        for head in layer.heads():
            raw[head] = float(totals[key][head.head]) / counts[key] if counts[key] else 0.0
    for head in masked:
        raw[head] = 0.0
    normalized = normalize_by_layer(raw)
    return ImportanceResult(
        scores=dict(normalized if normalize else raw),
        raw=raw,
        normalized=normalized,
        per_token=per_token,
        normalize=normalize,
        masked=masked,
        tokens=counts,
        n_examples=n_examples,
        loss=loss_total,
        loss_name=prepared.loss_name,
        notes=notes,
    )


def gate_gradients(
    adapter: EvalAdapter, mask: Sequence[Head] = (), label_smoothing: float | None = None
) -> Iterator[BatchGateGradients]:
    """Per-token ``dL/dxi_{t,h}`` at ``xi = 1`` (``xi = 0`` for ``mask``), one batch at a time.

    Gradients at padding positions are set to zero. The model is put in eval mode and its
    parameters' ``requires_grad`` flags are switched off for the duration (and restored), so no
    parameter ``.grad`` is touched and no weight gradients are computed. Takes the same
    ``adapter`` and ``label_smoothing`` as :func:`gradient_importance`.
    """
    return batch_gate_gradients(adapter, mask, loss_batches_of(adapter, label_smoothing).batches)


def batch_gate_gradients(adapter: EvalAdapter, mask: Sequence[Head], batches: Sequence[LossBatch],
                         blocks: Sequence[torch.nn.Module] = ()) -> Iterator[BatchGateGradients]:
    """:func:`gate_gradients` of prepared ``batches``: per-token gradients of each ``batch.loss()`` (any
    scalar the batch computes, e.g. the explained logits of relevance propagation) at the gates. ``blocks``:
    the model's blocks to checkpoint for batches that allow recomputing (``LossBatch.recompute``)."""
    gates = adapter.gates
    model = adapter.model
    dtype = _gate_dtype(model)
    off = heads_by_site(mask, gates.inventory)
    was_training = model.training
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        model.eval()
        for p in params:
            p.requires_grad_(False)
        for batch in batches:
            values: dict[SiteKey, torch.Tensor] = {}
            lead_masks: dict[SiteKey, torch.Tensor] = {}
            for site in gates.sites:
                lead = _site_layout(site, batch.tokens[site.key])
                gate = torch.ones(*lead.shape, site.num_heads, dtype=dtype, device=site.out_proj.weight.device)
                if site.key in off:
                    gate[..., off[site.key]] = 0.0
                values[site.key] = gate.requires_grad_(True)
                lead_masks[site.key] = lead
            gates.set_values(values)
            # inference_mode(False): a caller inside inference mode would otherwise get no graph.
            recompute = checkpointed(blocks if batch.recompute else ())
            with torch.inference_mode(False), torch.enable_grad(), recompute:
                try:
                    loss = batch.loss()
                    keys = list(values)
                    grads = torch.autograd.grad(loss, [values[k] for k in keys], allow_unused=True)
                finally:
                    gates.clear()
            out = {}
            for key, grad in zip(keys, grads, strict=True):
                if grad is None:  # a site the loss does not depend on (e.g. nothing reads it)
                    grad = torch.zeros_like(values[key])
                out[key] = grad * lead_masks[key].unsqueeze(-1).to(grad.dtype)
            yield BatchGateGradients(float(loss.detach()), batch.n_examples, out, lead_masks)
    finally:
        gates.clear()
        for p in params:
            p.requires_grad_(True)
        model.train(was_training)


def normalize_by_layer(scores: Mapping[Head, float]) -> dict[Head, float]:
    """``I_{l,h} / sqrt(sum_h' I_{l,h'}^2)`` within each (attention type, layer); a layer whose
    scores are all 0 stays 0."""
    norms: dict[SiteKey, float] = {}
    for head, value in scores.items():
        norms[head.site] = norms.get(head.site, 0.0) + value * value
    return {head: value / math.sqrt(norms[head.site]) if norms[head.site] else 0.0 for head, value in scores.items()}


def rank_heads(scores: Mapping[Head, float]) -> list[Head]:
    """Heads by score, least important first; ties in inventory order (attention type, layer, head)."""
    bad = [str(h) for h, v in scores.items() if math.isnan(v)]
    if bad:
        raise ValueError(f"importance is NaN for {', '.join(bad[:5])}: cannot rank")
    return sorted(scores, key=lambda h: (scores[h], h))


# -- internals ---------------------------------------------------------------------------
def _gate_dtype(model: torch.nn.Module) -> torch.dtype:
    # At least float32: gradients accumulated in bfloat16/float16 gates lose most of their digits.
    param = next(model.parameters(), None)
    return torch.float32 if param is None else torch.promote_types(param.dtype, torch.float32)


def _site_layout(site: AttentionSite, tokens: torch.Tensor) -> torch.Tensor:
    """A (B, T) mask in the layout of the site's projection input (without its feature axis)."""
    return tokens.transpose(0, 1) if site.batch_dim == 1 else tokens


def loss_batches_of(adapter: EvalAdapter, label_smoothing: float | None) -> LossBatches:
    """The adapter's loss batches for gradient methods (at least float32), or one line saying why there are none."""
    if not hasattr(adapter, "loss_batches"):
        raise HeadsweepError(f"{type(adapter).__name__}: this model family declares no training loss "
                             "(EvalAdapter.loss_batches), so gradient importance cannot be estimated")
    prepared = adapter.loss_batches(label_smoothing, _gate_dtype(adapter.model))
    if not prepared.batches:
        raise HeadsweepError("no data to estimate head importance on (the adapter has no batches)")
    return prepared


def importance_on_worker(worker, data_cfg, per_token: bool, normalize: bool, mask: Sequence[Head] = ()):
    """Worker-side step of the ``importance`` experiment (``EvalWorker.run``): gradient importance of
    every head on ``data_cfg``, whose adapter the worker loads once beside the evaluation data."""
    return gradient_importance(worker.adapter(data_cfg), per_token=per_token, normalize=normalize, mask=mask)
