"""Per-example fills, set per batch: resample ablation and activation patching (``sweep.ablation: resample | patch``).

Under both methods a gated-off head's slice ``z_h`` of the output projection's input (``hook_z``) takes the value
it has on **another input** at the same positions: a donor example (resample) or the pair's other prompt (patch).
Every adapter does the same per-batch step before a batch's masked passes (:meth:`Donors.batch`):

1. the donor inputs of the batch's examples, built by the adapter exactly as the batch is built (the same width
   and padding), run once through the **ungated** model (no gates, no fill), with a pre-hook on every site's output
   projection recording its input;
2. those inputs, per site ``(B, T, H, d)`` batch first, become the gates' per-example
   :class:`~headsweep.workers.core.head_fill.HeadFill` while the batch's masked passes run (a pass that packs
   ``k`` masks repeats it mask-major; prefix reuse's ``gated_projection`` reads the same fill);
3. the fill the gates held before comes back afterwards.

**Resample: donors of the same token length.** Example ``i``'s donor is drawn by a seeded derangement (no example is
its own donor; ``ablation.seed``) among the examples of the same token length as ``i``. The same length means the same
padding in any batch, so the donor's activations line up with the example's position by position, and the donor
batch (the donors of a batch's examples, padded as that batch) has the batch's very shape. The donor is in general
in another batch of the adapter's length-sorted batching: its inputs are taken from the whole evaluation set, not
from the batch. An example without another of its length cannot be resampled, and a run with one is refused
(:func:`~headsweep.workers.ablation.resample.same_length_donors`). Causal-LM perplexity windows all have the same
length, so any derangement works.

**Repeats.** ``ablation.resamples: K`` draws K derangements (draw ``k`` seeded by ``(seed, k)``); the adapter
evaluates every mask under each, and each example's statistics are the mean over the K draws
(:meth:`Donors.mean_over_draws`). Each example still has one row of statistics per mask, so the paired tests stay
valid: the unit of the t-test and of the bootstrap is still the example, and the donor draws are part of what is
measured for it (averaging K draws only lowers that example's variance). A 0/1 outcome averaged over K > 1 draws is
no longer 0/1 (McNemar's exact test needs 0/1 outcomes; the t-test and bootstrap do not).

**Patch.** The donor of example ``i`` is the other prompt of pair ``i`` (``noising``: the corrupted prompt's
activations patched into the clean run; ``denoising``: the clean prompt's into the corrupted run); the adapter's
paired data make both prompts the same token length, so they line up as resample's donors do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.family import LossBatch, LossBatches
from headsweep.workers.core.gates import AttentionSite, HeadGates
from headsweep.workers.core.head_fill import HeadFill
from headsweep.workers.core.heads import SiteKey


def record_contexts(gates: HeadGates, run: Callable[[], Any],
                    attention: Sequence[str] | None = None) -> dict[SiteKey, torch.Tensor]:
    """Every site's output-projection input during ``run()`` (one forward pass of the model ``gates`` are on), as
    ``(B, T, H, d)`` batch first, without gradients; the pass runs ungated (no gates, no fill: the model as it is),
    and whatever gates and fill were set are set again after it. ``attention``: only the sites of these attention
    types (a pass that runs part of the model: fairseq translation's donor pass runs the encoder alone)."""
    sites = [site for site in gates.sites if attention is None or site.attention in attention]
    recorded: dict[SiteKey, list[torch.Tensor]] = {site.key: [] for site in sites}

    def record(site: AttentionSite) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            if site.running():  # not another application of a shared module (ALBERT)
                recorded[site.key].append(args[0])

        return hook

    handles = [site.out_proj.register_forward_pre_hook(record(site)) for site in sites]
    try:
        with gates.ungated(), torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for site in sites:
        calls = recorded[site.key]
        if len(calls) != 1 or calls[0].dim() != 3:
            raise HeadsweepError(f"{site.module_name}: the donor pass called its output projection {len(calls)} "
                                 "times, not once on (batch, time, features): per-example ablation cannot record it")
        x = calls[0] if site.batch_dim == 0 else calls[0].transpose(0, 1)
        out[site.key] = x.reshape(*x.shape[:2], site.num_heads, site.head_dim)
    return out


#: One mask's evaluation: its outputs (hypotheses), per-example statistics, and per-example losses (None: not asked).
Scored = tuple[list[Any], np.ndarray, np.ndarray | None]


class Donors:
    """An adapter's per-example fills: whose inputs fill each example's gated-off heads, and the per-batch step.

    ``donors[k, i]``: in draw ``k``, the example (position in the evaluation set) whose donor-side inputs fill
    example ``i`` (resample: another example; patch: ``i`` itself, its other prompt), given by ``draw()`` on first
    use (:meth:`check`: now). ``draw`` None: the run's method is not per example, and :meth:`batch` does nothing.
    ``attention``: the attention types the donor pass records (None: every site); heads of other types have no
    donor values (the adapter refuses to gate them).
    """

    def __init__(self, gates: HeadGates, draw: Callable[[], np.ndarray] | None = None, keep_first: bool = False,
                 attention: Sequence[str] | None = None):
        self.gates = gates
        self.keep_first = keep_first
        self.attention = None if attention is None else tuple(attention)
        self.draw = 0
        self._draw = draw
        self._donors: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self._draw is not None

    @property
    def donors(self) -> np.ndarray | None:
        """``(draws, n)`` donor positions (drawn now if not yet), or None when the method is not per example."""
        if self._draw is not None and self._donors is None:
            self._donors = self._draw()
        return self._donors

    def check(self) -> None:
        """Draw the donors now: data they cannot be drawn from are refused here (one line)."""
        _ = self.donors

    @property
    def n_draws(self) -> int:
        donors = self.donors
        return 1 if donors is None else int(donors.shape[0])

    def draws(self) -> Iterator[int]:
        """Each draw in turn (the current one is what :meth:`batch` installs); one when not per example."""
        try:
            for k in range(self.n_draws):
                self.draw = k
                yield k
        finally:
            self.draw = 0

    def mean_over_draws(self, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """``compute()`` under each draw, averaged: the per-example values of K resample draws (module docstring)."""
        if self.n_draws == 1:
            return compute()
        total = None
        for _ in self.draws():
            value = np.asarray(compute(), dtype=np.float64)
            total = value if total is None else total + value
        assert total is not None
        return total / self.n_draws

    def outputs_over_draws(self, masks: Sequence[Sequence[Any]], compute: Callable[[], list[Scored]]) -> list[Scored]:
        """``compute()`` (per mask of ``masks``: its outputs, per-example statistics and per-example losses or None)
        under each draw: per mask, the first draw's outputs and the statistics and losses averaged over the draws
        (the translation families' K resample draws, module docstring). Masks that gate nothing come out the same
        under every draw: one draw does for a grid of them."""
        totals: list[Scored] = []
        n = 0
        for k in self.draws() if any(masks) else iter([0]):
            n += 1
            for m, (outputs, stats, loss) in enumerate(compute()):
                if k == 0:
                    totals.append((outputs, stats, loss))
                    continue
                first, stats_sum, loss_sum = totals[m]
                totals[m] = (first, stats_sum + stats, None if loss is None or loss_sum is None else loss_sum + loss)
        return [(outputs, stats / n, None if loss is None else loss / n) for outputs, stats, loss in totals]

    def donors_of(self, rows: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
        """The donors (positions in the evaluation set) of examples ``rows`` in the current draw."""
        donors = self.donors
        assert donors is not None
        index = rows.cpu().numpy() if torch.is_tensor(rows) else np.asarray(rows, dtype=np.int64)
        return donors[self.draw, index]

    def batch(self, rows: Sequence[int] | torch.Tensor | np.ndarray, run_donors: Callable[[np.ndarray], Any],
              needed: bool = True):
        """Context manager around one batch's masked passes: the fill of examples ``rows`` (the batch's positions
        in the evaluation set, in batch order) installed inside, the previous fill back after.

        ``run_donors(donors)`` runs the model once on the donor-side inputs of ``donors`` (positions in the
        evaluation set, one per row of the batch), built and padded exactly as the batch is. ``needed`` False (no
        mask of the batch gates a head) skips the donor pass.
        """
        if not self.active or not needed:
            return nullcontext()
        return self._installed(rows, run_donors)

    @contextmanager
    def _installed(self, rows, run_donors: Callable[[np.ndarray], Any]) -> Iterator[None]:
        donors = self.donors_of(rows)
        values = record_contexts(self.gates, lambda: run_donors(donors), self.attention)
        saved = self.gates.fill
        self.gates.set_fill(HeadFill(values, per_example=True, keep_first=self.keep_first))
        try:
            yield
        finally:
            self.gates.set_fill(saved)


def with_donors(batches: LossBatches, donors: Donors, rows: Sequence[torch.Tensor],
                run_donors: Callable[[np.ndarray], Any]) -> LossBatches:
    """``batches`` (``rows[b]``: the examples of batch ``b``) with each loss computed under the per-example fill of
    its examples, averaged over the draws: gradient importance's gate gradient is then attribution patching of the
    run's resample or patch ablation (``dL/dxi_h = dL/dz'_h . (z_h - c_h)``, ``c_h`` the donor's), and the L0
    gates close onto the donors' activations. ``outputs`` (relevance propagation) runs as it is."""
    if not donors.active:
        return batches

    def under_fill(batch: LossBatch, idx: torch.Tensor) -> LossBatch:
        def loss() -> torch.Tensor:
            total = None
            for _ in donors.draws():
                with donors.batch(idx, run_donors):
                    value = batch.loss()
                total = value if total is None else total + value
            assert total is not None
            return total / donors.n_draws

        # The fill is set for the forward pass alone: a backward pass that recomputed layers would miss it.
        return dataclasses.replace(batch, loss=loss, recompute=False)

    return dataclasses.replace(batches, batches=[under_fill(b, idx) for b, idx in zip(batches.batches, rows,
                                                                                     strict=True)])


def donors_for(spec: AblationSpec, gates: HeadGates, lengths: Sequence[int], paired: bool = False,
               what: str = "examples", where: str = "the evaluation data", more: str = "more data",
               attention: Sequence[str] | None = None) -> Donors:
    """The :class:`Donors` of an adapter under the run's ablation ``spec`` (``RuntimeOptions.ablation``), as its
    method draws them (``AblationMethod.draw_donors``): resample's same-length derangements over ``lengths`` (each
    example's token length; drawn now, so that data they cannot pair are refused when the adapter loads, which the
    driver has every worker do before the run writes anything, for the evaluation data and for the data importance
    and the L0 gates read), patch's pairs (``paired``: the adapter holds paired data, example ``i``'s donor its other
    prompt; without pairs, drawing them refuses: the driver refuses such a run first), nothing for the other methods.
    ``what``, ``where`` and ``more`` word the refusal
    (:func:`~headsweep.workers.ablation.resample.same_length_donors`); ``attention``: the attention types the donor
    pass records (:class:`Donors`)."""
    draw = method_of(spec).draw_donors(spec, list(lengths), paired, what, where, more)
    if draw is None:
        return Donors(gates)
    return Donors(gates, draw, spec.keep_first, attention)


def refuse_unfillable(donors: Donors, spec: AblationSpec, family: str, masks: Sequence[Sequence[Any]]) -> None:
    """Under a per-example method whose donor pass records only some attention types (``donors.attention``: the
    encoder-decoder families' ``enc_self``), every head of ``masks`` is one a donor can fill; the driver refuses
    configs that would gate others, so this catches only what it could not see, in the method's one line
    (``attention_refusal``) naming the first such head of model family ``family``."""
    if not donors.active or donors.attention is None:
        return
    other = next((h for mask in masks for h in mask if h.attention not in donors.attention), None)
    if other is not None:
        allowed = donors.attention
        raise HeadsweepError(method_of(spec).attention_refusal(family, allowed, f"a mask of this run gates {other}",
                                                               f"gate only {', '.join(allowed)} heads"))


def refuse_per_example(spec: AblationSpec, what: str, why: str) -> None:
    """An adapter that cannot fill heads per example (``what``, e.g. "multiple-choice questions", ``why`` the
    reason) refuses resample with one line, and patch with its ``unpaired_refusal`` (it holds no pairs); called
    where the adapter on the evaluation data is described (an adapter loaded for its loss alone never refuses)."""
    method_of(spec).refuse_per_example(what, why)
