"""Optimal ablation's constants (``sweep.ablation: optimal``; Li and Janson 2024, ``alestolfo/optimalablation``).

Per head ``h``, the constant ``c_h`` (the head's slice of the output projection's input, the shape of a mean) that
minimises the task loss on ``ablation.reference`` when the head is replaced by it, the model frozen:

    c_h = argmin_c  L(reference; z_h := c)

* **start**: the head's mean over the reference (:func:`headsweep.workers.ablation.means.reference_means`, the
  same pass mean ablation takes), as the optimal-ablation code starts; the loss at the start is the mean-ablation
  loss, and the constant returned is the best one seen, so the optimal constant's reference loss is never above
  the mean's;
* **optimiser**: Adam (``ablation.lr``, default 0.01, betas 0.9 / 0.999) on full-batch gradients: every step
  differentiates the loss over the whole reference (the family's ``loss_batches``, each ``LossBatch.loss()`` summed
  over its examples; the total divided by the examples), only ``c_h`` requiring grad (``torch.autograd.grad``: no
  parameter of the model accumulates a gradient);
* **stopping**: at most ``ablation.steps`` updates (default 100), and earlier once the best loss has improved by
  less than a relative ``TOLERANCE`` (1e-4) over the last ``PATIENCE`` (10) steps;
* **deterministic**: full batches, no sampling, the seed (``ablation.seed``) set before each head's training, so a
  worker that Ray restarts, or another worker, trains the same constant.

Cost per head: at most ``steps + 1`` forward and backward passes over the reference. A single-head grid trains one
constant per head; masks of several heads (all_but_one, prune levels, custom, pairs) replace each removed head by its
own single-head constant: constants are not trained jointly per mask.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.means import _loss_batches, describe_reference, reference_means, site_name
from headsweep.workers.ablation.method import AblationMethod, reference_setting
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.head_fill import HeadFill
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.core.setting_ranges import SEED, ranged
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    import torch

    from headsweep.workers.core.family import EvalAdapter

# Early stop: the best loss improved by less than this share of itself over the last PATIENCE steps.
TOLERANCE = 1e-4
PATIENCE = 10


@dataclass(frozen=True)
class OptimalSettings:
    """``ablation.reference``: the data the constants are trained on (required; a data section typed like ``data``,
    kept apart from the evaluation set unless ``ablation.allow_eval_data``). ``ablation.seed`` seeds torch before
    each head's training; ``ablation.steps`` and ``ablation.lr``: Adam's most updates per head and learning rate."""

    reference: dict | None = reference_setting()
    allow_eval_data: bool = False
    seed: int = ranged(0, within=SEED)
    # 0 steps would store optimal ablation with its untrained starting constants
    steps: int = ranged(100, at_least=1)
    lr: float = ranged(0.01, above=0)


class UntrainedFill(HeadFill):
    """The fill of an optimal-ablation worker before the driver installed the trained constants (or after Ray
    restarted it and before they came back): any gated-off head refuses to run, rather than evaluate zero ablation
    under the name optimal."""

    def at(self, key: SiteKey, heads: torch.Tensor, batch_dim: int) -> torch.Tensor | None:
        raise HeadsweepError(f"optimal ablation's constants are not installed on this worker ({site_name(key)} was "
                             "gated off before they were): rerun the same command to resume")


def _mean_loss(adapter: EvalAdapter, constant: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The reference loss per example and its gradient in ``constant``, one batch's graph at a time."""
    import torch

    batches = _loss_batches(adapter, "optimal ablation")
    total = sum(b.n_examples for b in batches)
    loss_sum, grad = 0.0, torch.zeros_like(constant)
    for batch in batches:
        loss = batch.loss() / total
        (g,) = torch.autograd.grad(loss, constant, allow_unused=True)
        loss_sum += float(loss.detach())
        if g is not None:  # a batch whose only replaced position is one keep_first keeps
            grad += g
    return loss_sum, grad


def train_head(adapter: EvalAdapter, spec: AblationSpec, means: HeadFill, head: Head
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Head ``head``'s optimal constant ``(d,)`` on ``adapter``'s data (module docstring), started at its mean in
    ``means``; and what training did (start and final loss, updates, seconds)."""
    import torch

    start = time.perf_counter()
    settings: OptimalSettings = OPTIMAL.settings_in(spec)
    key = (head.attention, head.layer)
    init = means.values[key]
    gates = adapter.gates
    saved = gates.fill
    torch.manual_seed(settings.seed)
    constant = init[head.head].detach().clone().requires_grad_(True)
    optimiser = torch.optim.Adam([constant], lr=settings.lr)
    losses: list[float] = []
    best, best_loss = constant.detach().clone(), float("inf")
    # fairseq runs unmasked attention in a fused kernel; gated it does not, but the mean pass turns it off too.
    unfused = getattr(gates, "unfused", None)
    try:
        gates.set_mask([head])
        with torch.enable_grad(), (unfused() if callable(unfused) else nullcontext()):
            for step in range(settings.steps + 1):
                values = torch.cat([init[:head.head], constant.unsqueeze(0), init[head.head + 1:]])
                gates.set_fill(HeadFill({key: values}, keep_first=spec.keep_first))
                loss, grad = _mean_loss(adapter, constant)
                if not np.isfinite(loss):
                    raise HeadsweepError(f"optimal ablation of {head}: the reference loss is {loss} at step {step}; "
                                         "lower ablation.lr")
                losses.append(loss)
                if loss < best_loss:
                    best, best_loss = constant.detach().clone(), loss
                if step == settings.steps:
                    break
                if step >= PATIENCE:
                    before = min(losses[:-PATIENCE])
                    if before - best_loss <= TOLERANCE * abs(before):
                        break
                optimiser.zero_grad(set_to_none=True)
                constant.grad = grad
                optimiser.step()
    finally:
        gates.clear()
        gates.set_fill(saved)
    return best, {"loss_mean": losses[0], "loss_optimal": best_loss, "updates": len(losses) - 1,
                  "seconds": time.perf_counter() - start}


def train_on_worker(worker: Any, heads: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Worker-side step (``EvalWorker.run``): the optimal constants of ``heads`` (``(attention, layer, head)``) on the
    run's ``ablation.reference``; the means they start from are taken once per worker and kept.

    Returns ``{"constants": {(attention, layer, head): array (d,)}, "tokens": {attention:layer: n}, "log": [...]}``.
    """
    spec: AblationSpec = worker.runtime.ablation
    adapter = worker.adapter(spec.reference)
    means = getattr(worker, "_optimal_means", None)
    if means is None:
        means = reference_means(adapter, AblationSpec("mean", keep_first=spec.keep_first), "ablation.reference data")
        worker._optimal_means = means
    out: dict[str, Any] = {"constants": {}, "log": [],
                           "tokens": {site_name(k): n for k, n in means.tokens.items()}}
    for attention, layer, index in heads:
        head = Head(attention, layer, index)
        constant, record = train_head(adapter, spec, means.fill, head)
        out["constants"][(attention, layer, index)] = constant.detach().cpu().numpy()
        out["log"].append({"head": str(head), **record})
    return out


def train_units(worker: Any, units: list[WorkUnit]) -> list[tuple[str, dict[str, Any]]]:
    """Worker-side step of the driver's stream (``WorkerPool.stream``): each unit's head's constant, as
    ``(eval_id, {"constant": array (d,), "tokens": {attention:layer: n}, "log": {...}})``."""
    heads = [(h.attention, h.layer, h.head) for unit in units for h in unit.masked]
    trained = train_on_worker(worker, heads)
    return [(unit.eval_id, {"constant": trained["constants"][head], "tokens": trained["tokens"], "log": record})
            for unit, head, record in zip(units, heads, trained["log"], strict=True)]


def heads_on_worker(worker: Any) -> list[tuple[str, int, int]]:
    """Worker-side step: every head of the model, ``(attention, layer, head)`` in model order."""
    sites = worker.adapter().gates.sites
    return sorted(((s.key[0], s.key[1], h) for s in sites for h in range(s.num_heads)),
                  key=lambda t: Head(*t))


def install_on_worker(worker: Any, values: dict[str, np.ndarray]) -> None:
    """Worker-side step: the trained (or stored) constants become the fill of every adapter the worker holds."""
    worker._fill.set_constants(worker, values)


class Optimal(AblationMethod):
    """The method's declarations: constants trained by the driver on the workers
    (:mod:`headsweep.sweep.ablation.training`), on ``ablation.reference`` (required, not the evaluation set),
    installed on every worker; until then a gated-off head refuses to run (:class:`UntrainedFill`)."""

    name = "optimal"
    fill = "constant"
    settings = OptimalSettings
    reference = "training"
    trained = True
    fold = "constants"

    def worker_fill(self, spec: AblationSpec) -> HeadFill | None:
        return UntrainedFill(keep_first=spec.keep_first)

    def training_summary(self, spec: AblationSpec) -> str:
        settings: OptimalSettings = self.settings_in(spec)
        return f"Adam lr={settings.lr:g}, at most {settings.steps} steps each"

    def facts(self, spec: AblationSpec, means: Any) -> dict[str, Any]:
        settings: OptimalSettings = self.settings_in(spec)
        return {**super().facts(spec, means), "reference": describe_reference(spec.reference),
                "start": "the head's mean over the reference",
                "optimiser": f"Adam lr={settings.lr:g}, full-batch gradients over the reference",
                "steps": settings.steps, "seed": settings.seed,
                "stopping": f"at most {settings.steps} updates, or the best loss improved by less than a relative "
                            f"{TOLERANCE:g} over {PATIENCE} steps; the best constant seen kept",
                "masks": "each removed head replaced by its own single-head constant (not trained per mask)"}


OPTIMAL = Optimal()
