"""Head gates: one mechanism for every model family.

Head h of an attention module contributes ``W_O[:, h*d:(h+1)*d] @ ctx_h`` to the module's
output. A forward pre-hook on the output projection multiplies each head's slice of the
projection's input by a gate ``xi_h``: ``xi_h = 0`` ablates the head exactly (the output bias
stays), ``xi_h = 1`` leaves it untouched, and a gate tensor that requires grad gives
``dL/dxi_h`` for importance scores. Gating the projection's *input* rather than slicing its
output is what makes the ablation equal to zeroing the head's columns of ``W_O``.

A gate is either one value per head, shape ``(H,)``, shared by the whole batch, or one row per
example, shape ``(B, H)``, so one forward pass can carry several masks (examples repeated once
per mask), or one value per token, shape ``(*lead, H)`` where ``lead`` is the projection
input's shape without its last axis (``(B, T, H)`` for batch-first models, ``(T, B, H)`` for
time-first ones), so ``dL/dxi`` is available per token (importance takes its absolute value
per token before summing).

What a gated-off head leaves behind is zero unless the gates hold a :class:`~headsweep.workers.core.head_fill.HeadFill`
(``set_fill``: mean, resample, optimal ablation and activation patching); the gate then mixes the head's slice
with the fill (:func:`~headsweep.workers.core.head_fill.apply_gates`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.head_fill import HeadFill, apply_gates
from headsweep.workers.core.heads import Head, HeadInventory, LayerShape, SiteKey, heads_by_site
from headsweep.workers.core.shared_calls import SharedCall


@dataclass
class AttentionSite:
    """Where one attention module's heads can be gated.

    ``batch_dim`` is the batch axis of the output projection's input: 0 for batch-first
    models (transformers), 1 for time-first models (fairseq). ``shared``: the site is one call of a module the
    model runs several times per forward pass (ALBERT); every hook on ``module`` or ``out_proj`` then acts only
    while that call runs (:meth:`running`).
    """

    attention: str
    layer: int
    num_heads: int
    head_dim: int
    out_proj: nn.Linear
    module: nn.Module
    module_name: str
    batch_dim: int = 0
    hook_handles: list = field(default_factory=list, repr=False)
    shared: SharedCall | None = None

    @property
    def key(self) -> SiteKey:
        return (self.attention, self.layer)

    def running(self) -> bool:
        """Whether a hook on this site's modules, called now, is this site's (always, unless the module is shared)."""
        return self.shared is None or self.shared.running()

    def check_projection(self) -> None:
        if self.out_proj.in_features != self.num_heads * self.head_dim:
            raise HeadsweepError(
                f"{self.module_name}: output projection takes {self.out_proj.in_features} features, "
                f"not num_heads x head_dim = {self.num_heads} x {self.head_dim}"
            )


def site_inventory(sites: Sequence[AttentionSite]) -> HeadInventory:
    """Every head of the given attention sites."""
    return HeadInventory([LayerShape(s.attention, s.layer, s.num_heads) for s in sites])


def group_by_site(sites: Sequence[AttentionSite], heads: Iterable[Head]) -> dict[SiteKey, list[int]]:
    """Heads grouped by ``(attention, layer)``, each checked against the sites' own head counts."""
    return heads_by_site(heads, site_inventory(sites))


class HeadGates:
    """Gates on every attention site of a model, installed as forward pre-hooks.

    With no gate set for a site, its hook returns immediately, so an ungated model computes
    exactly what the unhooked model computes.
    """

    def __init__(self, sites: Sequence[AttentionSite]):
        if not sites:
            raise HeadsweepError("no attention modules found in the model: nothing to gate")
        self.sites = list(sites)
        self._site_by_key = {s.key: s for s in self.sites}
        self._gates: dict[SiteKey, torch.Tensor] = {}
        self.fill: HeadFill | None = None  # what gated-off heads leave behind; None: zero
        for site in self.sites:
            site.check_projection()
            site.hook_handles.append(site.out_proj.register_forward_pre_hook(self._make_hook(site)))
        self.inventory = site_inventory(self.sites)

    def _make_hook(self, site: AttentionSite):
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            gate = self._gates.get(site.key)
            if gate is None or not site.running():
                return None
            x = args[0]
            heads = x.reshape(*x.shape[:-1], site.num_heads, site.head_dim)
            if gate.dim() == 1:
                shaped = gate.view(*([1] * (heads.dim() - 2)), site.num_heads, 1)
            elif gate.dim() > 2 and gate.dim() == heads.dim() - 1:
                # Per token. Checked here because the token axis is only known once the input
                # arrives, and a broadcastable wrong shape would gate the wrong tokens silently.
                if gate.shape != heads.shape[:-1]:
                    raise ValueError(
                        f"{site.module_name}: per-token gate has shape {tuple(gate.shape)}, the output "
                        f"projection's input needs {tuple(heads.shape[:-1])}"
                    )
                shaped = gate.unsqueeze(-1)
            else:
                view = [1] * (heads.dim() - 2) + [site.num_heads, 1]
                view[site.batch_dim] = gate.shape[0]
                shaped = gate.view(view)
            if self.fill is None:
                return (heads * shaped.to(heads.dtype)).reshape(x.shape), *args[1:]
            gated = apply_gates(heads, shaped.to(heads.dtype), self.fill.at(site.key, heads, site.batch_dim),
                                self.fill.keep_first, site.batch_dim)
            return gated.reshape(x.shape), *args[1:]

        return hook

    def remove(self) -> None:
        """Take every hook off the model."""
        for site in self.sites:
            for handle in site.hook_handles:
                handle.remove()
            site.hook_handles.clear()
        self._gates.clear()

    def restore_stock(self, site: AttentionSite, module: nn.Module) -> None:
        """Undo on ``module`` (``site.module``, or its copy) what gating changed besides the hooks.

        Nothing here; a family whose gates change a module's settings (fairseq turns its fused
        attention path off) overrides this, so that an ungated copy runs as the stock library does.
        """

    def set_fill(self, fill: HeadFill | None) -> None:
        """What gated-off heads leave behind from now on (None: zero); kept across ``clear()``, unlike gates."""
        self.fill = fill

    # -- setting gates -------------------------------------------------------------------
    def clear(self) -> None:
        """No gates: the model computes exactly what it computes unhooked."""
        self._gates.clear()

    def set_mask(self, masked: Iterable[Head], device: torch.device | str | None = None) -> None:
        """Gate 0 for every head in ``masked``, 1 for the rest; one mask for the whole batch."""
        self.clear()
        for key, heads in heads_by_site(masked, self.inventory).items():
            site = self._site_by_key[key]
            self._gates[key] = gate_rows([heads], site.num_heads, device or site.out_proj.weight.device)[0]

    def set_masks_per_example(
        self, masks: Sequence[Iterable[Head]], rows_per_mask: int, device: torch.device | str | None = None
    ) -> None:
        """One mask per block of ``rows_per_mask`` consecutive examples (mask-major layout)."""
        self.clear()
        for key, table in self.gate_tables(masks, device).items():
            self._gates[key] = table.repeat_interleave(rows_per_mask, dim=0)

    @contextmanager
    def packed(self, masks: Sequence[Iterable[Head]], rows_per_mask: int) -> Iterator[None]:
        """While active, ``masks`` gate one forward pass: the one mask for the whole batch, or one per block of
        ``rows_per_mask`` rows (the batch repeated once per mask, mask-major); no gates once it ends."""
        if len(masks) == 1:
            self.set_mask(masks[0])
        else:
            self.set_masks_per_example(masks, rows_per_mask=rows_per_mask)
        try:
            yield
        finally:
            self.clear()

    def gate_tables(self, masks: Sequence[Iterable[Head]], device: torch.device | str | None = None
                    ) -> dict[SiteKey, torch.Tensor]:
        """For every site some mask touches: one gate row per mask, shape ``(len(masks), H)``."""
        grouped = [heads_by_site(m, self.inventory) for m in masks]
        tables = {}
        for key in dict.fromkeys(k for g in grouped for k in g):
            site = self._site_by_key[key]
            tables[key] = gate_rows([g.get(key, ()) for g in grouped], site.num_heads,
                                    device or site.out_proj.weight.device)
        return tables

    def set_values(self, values: dict[SiteKey, torch.Tensor]) -> None:
        """Set raw gate values per site, e.g. tensors that require grad for importance.

        Each value has shape ``(H,)`` (whole batch), ``(B, H)`` (per example) or the projection
        input's shape with its last axis replaced by ``H`` (per token: ``(B, T, H)`` batch-first,
        ``(T, B, H)`` time-first).
        """
        self.clear()
        for key, value in values.items():
            site = self._site_by_key[key]
            if value.shape[-1] != site.num_heads:
                raise ValueError(f"gate for {key} has {value.shape[-1]} heads, site has {site.num_heads}")
            self._gates[key] = value

    @contextmanager
    def ungated(self) -> Iterator[None]:
        """Context manager: no gates and no fill inside (the model as it is), the gates and fill set before back
        after (a donor's pass in the middle of a gated computation: resample ablation, activation patching)."""
        gates, fill = dict(self._gates), self.fill
        self._gates.clear()
        self.fill = None
        try:
            yield
        finally:
            self._gates.clear()
            self._gates.update(gates)
            self.fill = fill

    @contextmanager
    def masked(self, masked: Iterable[Head]) -> Iterator[None]:
        """Context manager: ``masked`` heads gated off inside, no gates after."""
        self.set_mask(masked)
        try:
            yield
        finally:
            self.clear()


def gate_rows(masked: Sequence[Iterable[int]], num_heads: int, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gates of one module for several masks: shape ``(len(masked), num_heads)``, 0 at each mask's heads, else 1.

    ``dtype`` None is torch's default dtype.
    """
    gates = torch.ones(len(masked), num_heads, dtype=dtype, device=device)
    for row, heads in enumerate(masked):
        gates[row, list(heads)] = 0.0
    return gates
