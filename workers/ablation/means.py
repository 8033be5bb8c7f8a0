"""Mean ablation's values: each head's mean output over the reference data.

**The means** (``sweep.ablation: mean``). Per head, the mean of its slice of the output projection's input (the
head's context, TransformerLens's ``hook_z``) over the reference data (``ablation.reference``; default: the evaluation
data), taken through the family's own batches of that data (``EvalAdapter.loss_batches``: every family has them, the
same inputs gradient importance differentiates) with a forward pre-hook on every site's output projection:

* over every **real token** the site sees, as the batch's ``LossBatch.tokens[site]`` marks them: padding is never
  counted. For a causal LM that is every token of every window, scored or not; for a classifier every non-padding
  token; for fairseq translation the source tokens for ``enc_self`` and the teacher-forced target positions
  (``prev_output_tokens``) for ``enc_dec`` and ``dec_self``;
* with ``ablation.keep_first`` position 0 of every sequence is left out: it is never replaced, so it has no say in
  what replaces the others (a decoder-only model's BOS attention sink would dominate the mean otherwise);
* with ``ablation.positions: per_position`` one mean per absolute position ``0..P-1`` (``P`` the reference's longest
  sequence) plus the pooled mean as row ``P`` (:class:`~headsweep.workers.core.head_fill.HeadFill`), used for positions
  the reference never reaches and for position 0 under ``keep_first``. Positions count from the start of the input
  tensor, which is where a sequence starts only when batches pad on the right: inputs padded on the left (a
  tokenizer whose ``padding_side`` is ``left``) are refused with per_position and keep_first alike (the fill, too,
  is applied by tensor position).

The pass runs with no gates set (the model as it is), under ``torch.no_grad``; sums and counts are accumulated in
float64 and the means kept in float32, or the model's dtype where wider (float64 models keep float64 means). They
are deterministic: a worker that Ray restarts, or a resumed run, computes the same values.

Installed on the adapters by :mod:`headsweep.workers.ablation.worker_fill`.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.head_fill import HeadFill
from headsweep.workers.core.heads import SiteKey

if TYPE_CHECKING:
    import torch

    from headsweep.workers.core.family import EvalAdapter
    from headsweep.workers.core.gates import AttentionSite


def site_name(key: SiteKey) -> str:
    """``attention:layer``: how a site is named in ``fill_values`` and the stored values."""
    return f"{key[0]}:{key[1]}"


@dataclasses.dataclass
class MeanValues:
    """The means of one model on the reference data: the fill, and what was counted."""

    fill: HeadFill
    tokens: dict[SiteKey, int]  # real tokens counted per site
    positions: int  # P: the reference's longest sequence (rows of a per-position fill before the pooled one)
    dtype: str
    seconds: float


class _Sums:
    """Running float64 sums of one site's input over real tokens, per position (``(T, C)``, grown as needed)."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, x: torch.Tensor, real: torch.Tensor) -> None:
        import torch

        steps = x.shape[1]
        if self.sums is None:
            self.sums = x.new_zeros((steps, x.shape[2]), dtype=torch.float64)
            self.counts = x.new_zeros(steps, dtype=torch.float64)
        elif self.sums.shape[0] < steps:
            grow = steps - self.sums.shape[0]
            self.sums = torch.cat([self.sums, self.sums.new_zeros(grow, self.sums.shape[1])])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow)])
        # Indexing, not multiplying by the mask: a padding position may hold NaN (fully masked attention rows).
        rows, positions = real.nonzero(as_tuple=True)
        self.sums.index_add_(0, positions, x[rows, positions].to(torch.float64))
        self.counts.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float64))


def describe_reference(reference: Any) -> Any:
    """What ``runs.facts`` says of the reference: the evaluation data, or the section's set fields."""
    if reference is None:
        return "evaluation data (data)"
    if dataclasses.is_dataclass(reference):
        return {k: v for k, v in dataclasses.asdict(reference).items() if v is not None}
    return reference


def _value_dtype(model: Any) -> torch.dtype:
    import torch

    param = next(model.parameters(), None)
    return torch.float32 if param is None else torch.promote_types(param.dtype, torch.float32)


def _loss_batches(adapter: EvalAdapter, what: str):
    import torch

    if not hasattr(adapter, "loss_batches"):
        raise HeadsweepError(f"{type(adapter).__name__}: this model family gives no batches of its data "
                             f"(EvalAdapter.loss_batches), so {what} cannot read its heads' outputs")
    return adapter.loss_batches(None, torch.promote_types(_value_dtype(adapter.model), torch.float32)).batches


def check_right_padded(adapter: EvalAdapter, spec: AblationSpec, data: str) -> None:
    """Refuse ``ablation.positions: per_position`` and ``ablation.keep_first`` on inputs padded on the left: both
    count positions from the start of the input tensor, which is then padding, not the sequence's first token."""
    if not (spec.per_position or spec.keep_first):
        return
    for batch in _loss_batches(adapter, "ablation.positions / ablation.keep_first"):
        for key, real in batch.tokens.items():
            # Right padding: each row's real tokens are a prefix, so the mask never rises again after a 0.
            rises = (real[:, 1:].int() - real[:, :-1].int()) > 0
            if bool(rises.any()):
                setting = "ablation.positions: per_position" if spec.per_position else "ablation.keep_first"
                raise HeadsweepError(
                    f"{setting} counts positions from the start of each input, but the {data} is padded on the left "
                    f"(its {site_name(key)} inputs start with padding: the tokenizer's padding_side is left), so "
                    "position 0 would be padding: use ablation.positions: all without keep_first, or a tokenizer "
                    "that pads on the right")


def reference_means(adapter: EvalAdapter, spec: AblationSpec, data: str) -> MeanValues:
    """Per head, its mean output-projection input over ``adapter``'s data (module docstring): the fill of
    ``spec`` (per position or not, ``keep_first``). ``data`` names the data in error lines."""
    import torch

    start = time.perf_counter()
    check_right_padded(adapter, spec, data)
    gates = adapter.gates
    sites: list[AttentionSite] = list(gates.sites)
    sums = {site.key: _Sums() for site in sites}
    current: dict[SiteKey, torch.Tensor] = {}

    def make_hook(site: AttentionSite):
        def hook(_module, args: tuple) -> None:
            if not site.running():  # another application of a shared module (ALBERT)
                return
            x = args[0]
            x = x if site.batch_dim == 0 else x.transpose(0, 1)
            real = current[site.key]
            if x.dim() != 3 or tuple(x.shape[:2]) != tuple(real.shape):
                raise HeadsweepError(
                    f"{site.module_name}: its output projection's input has shape {tuple(args[0].shape)}, which does "
                    f"not line up with the batch's tokens {tuple(real.shape)}: mean ablation cannot read this model")
            real = real.to(device=x.device, dtype=torch.bool)
            if spec.keep_first:
                real = real.clone()
                real[:, 0] = False
            sums[site.key].add(x.detach(), real)

        return hook

    # Prepended: the head's own output, before any gate hook (none is set while the means are taken).
    handles = [site.out_proj.register_forward_pre_hook(make_hook(site), prepend=True) for site in sites]
    saved = gates.fill
    gates.clear()
    gates.set_fill(None)
    # fairseq runs unmasked attention in a fused kernel that never calls out_proj as a module: off it here.
    unfused = getattr(gates, "unfused", None)
    try:
        batches = _loss_batches(adapter, "mean ablation")
        with torch.no_grad(), (unfused() if callable(unfused) else nullcontext()):
            for batch in batches:
                current.clear()
                current.update(batch.tokens)
                batch.loss()
    finally:
        for handle in handles:
            handle.remove()
        gates.set_fill(saved)
    dtype = _value_dtype(adapter.model)
    values: dict[SiteKey, torch.Tensor] = {}
    tokens: dict[SiteKey, int] = {}
    longest = 0
    for site in sites:
        acc = sums[site.key]
        if acc.sums is None:
            raise HeadsweepError(f"{site.module_name}: its output projection never ran as a module on the {data}, so "
                                 "mean ablation cannot read its heads' outputs")
        counts = acc.counts.cpu()
        total = int(counts.sum())
        if total == 0:
            what = "position a fill replaces (only position 0, which keep_first keeps)" if spec.keep_first else "token"
            raise HeadsweepError(f"mean ablation has nothing to average: the {data} has no real {what} at "
                                 f"{site_name(site.key)}; give ablation.reference data with tokens")
        pooled = acc.sums.sum(dim=0).cpu() / total
        reached = int(torch.nonzero(counts).max()) + 1
        longest = max(longest, reached)
        if spec.per_position:
            per = acc.sums[:reached].cpu() / counts[:reached].clamp(min=1).unsqueeze(1)
            per[counts[:reached] == 0] = pooled  # keep_first's position 0: never applied
            rows = torch.cat([per, pooled.unsqueeze(0)])
        else:
            rows = pooled.unsqueeze(0)
        shape = (site.num_heads, site.head_dim)
        values[site.key] = (rows.view(rows.shape[0], *shape) if spec.per_position else rows.view(*shape)).to(dtype)
        tokens[site.key] = total
    fill = HeadFill({k: v.to(adapter.device) for k, v in values.items()}, per_position=spec.per_position,
                    keep_first=spec.keep_first)
    return MeanValues(fill, tokens, longest, str(dtype).removeprefix("torch."), time.perf_counter() - start)
