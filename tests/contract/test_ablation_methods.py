"""What a gated-off head leaves behind, on every family of the contract suite: the gate's fill
(:class:`~headsweep.workers.core.head_fill.HeadFill`, installed with ``HeadGates.set_fill``) against independent routes
written here and in tests/ablation_routes.py, with no headsweep gate or fill code on them.

* constant fill (one vector ``c_h`` per head: mean and optimal ablation) == weight surgery (the head's ``W_O``
  input columns zeroed and ``W_O[:, h] @ c_h`` folded into the bias, no hooks), for every head, through the
  family's own evaluation (beam search and teacher-forced loss for fairseq: all three attention types);
* per-position and per-example fills, and ``keep_first``, == a forward pre-hook that writes the values over the
  head's slice position by position (translation, fairseq and hf_seq2seq: per-example fills on ``enc_self`` only:
  decoder attention runs incrementally in beam search, so translation refuses per-position fills, ``keep_first``
  and per-example methods on decoder attention);
* reuse and packed masks == the plain path under every fill kind, as test_family_contract.py demands it of zero
  ablation. Per-example fills go through the adapters too: a runtime whose batch holds the whole evaluation set
  gives every pass the same ``(B, T)`` rows, so one fill fits each batch without a per-batch hook;
* the gate gradient under a constant fill is attribution patching: ``dL/dxi_h = sum (z_h - c_h) . dL/dz'_h``
  with ``dL/dz'`` taken by autograd on the model with a plain hook.

Qwen2 (attention biases; its ``o_proj`` has none, so the surgery creates one) runs the same checks besides the
suite's cases.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from ablation_routes import Substitution, folded_fill, substituted

from headsweep.workers.core.family import EvalAdapter, LossBatch, MaskOutput
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.head_fill import HeadFill
from headsweep.workers.core.heads import Head, SiteKey

from .cases import LM_WINDOW, Built, FamilyCase, _exported_hf, _lm_builder
from .test_family_contract import PACKED, PLAIN, assert_same, load_adapter, moved, rows_seen, ungated

pytestmark = pytest.mark.usefixtures("one_thread")

# Larger than every case's evaluation set (40 sentences, 16 translations, 6 LM windows): one batch per pass.
WHOLE_SET = 64

Mask = tuple[Head, ...]


def is_translation(case: FamilyCase) -> bool:
    return case.id.startswith("translation")


def fills_per_example(built: Built) -> bool:
    """Whether the family fills some attention type from another input (resample; ``resample_attention`` None:
    every type; the encoder-decoder families' ``("enc_self",)``: that one; an empty tuple: none)."""
    from headsweep.workers.families.registry import model_family

    return model_family(built.model["kind"]).resample_attention != ()


# -- the fills ---------------------------------------------------------------------------------------------------

@dataclass
class Fills:
    """A probe adapter (plain path, the whole set in one batch) and fills made from its recorded contexts."""

    probe: EvalAdapter
    batch: LossBatch
    contexts: dict[SiteKey, torch.Tensor]  # per site: the projection's input as (B, T, H, d), batch first
    constant: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # (H, d)
    per_position: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # (P + 1, H, d)
    per_example: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # (B, T, H, d)
    # The same with position 0 moved off the donor's (an LM's windows all start with BOS, whose contexts are the
    # same in every example: a keep_first that did nothing would go unseen)
    per_example_first_moved: dict[SiteKey, torch.Tensor] = field(default_factory=dict)

    def sites(self, kind: str) -> list[AttentionSite]:
        values = self.values(kind)
        return [s for s in self.probe.gates.sites if s.key in values]

    def values(self, kind: str) -> dict[SiteKey, torch.Tensor]:
        if kind == "per_example_keep_first":
            return self.per_example_first_moved
        return {"constant": self.constant, "per_position": self.per_position,
                "per_example": self.per_example}[kind.removesuffix("_keep_first")]

    def fill(self, kind: str) -> HeadFill:
        base = kind.removesuffix("_keep_first")
        return HeadFill(self.values(kind), per_position=base == "per_position", per_example=base == "per_example",
                        keep_first=kind.endswith("_keep_first"))


def record_contexts(adapter: EvalAdapter, batch: LossBatch) -> dict[SiteKey, torch.Tensor]:
    """Every site's projection input on ``batch`` (ungated), batch first as (B, T, H, d)."""
    seen: dict[SiteKey, torch.Tensor] = {}
    handles = []
    for site in adapter.gates.sites:
        def keep(_m, args, site=site):
            x = args[0] if site.batch_dim == 0 else args[0].transpose(0, 1)
            seen[site.key] = x.detach().reshape(*x.shape[:-1], site.num_heads, site.head_dim).clone()
        handles.append(site.out_proj.register_forward_pre_hook(keep))
    adapter.gates.clear()
    try:
        with torch.no_grad():
            batch.outputs()
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == {s.key for s in adapter.gates.sites}, "a projection was not called as a module"
    return seen


def make_fills(case: FamilyCase, built: Built) -> Fills:
    """Fills of the scale of the heads' own outputs: a constant near each head's mean (mean ablation's value, moved
    so that it is no particular statistic), per-position values near the batch's means with positions from
    ``P = T // 2`` on taking the constant (pooled), and per example another example's contexts (resample's donor:
    the previous one)."""
    probe = load_adapter(case, built, **{**PLAIN, "batch_size": WHOLE_SET})
    batches = probe.loss_batches(None, torch.float32).batches
    assert len(batches) == 1, "the whole evaluation set should be one batch"
    batch = batches[0]
    contexts = record_contexts(probe, batch)
    fills = Fills(probe, batch, contexts)
    gen = torch.Generator().manual_seed(30)
    for key, ctx in contexts.items():
        real = batch.tokens[key].bool()
        assert tuple(real.shape) == tuple(ctx.shape[:2]), (key, real.shape, ctx.shape)
        tokens = ctx[real]  # (N, H, d)
        spread = tokens.std(dim=0, keepdim=True).mean(dim=-1, keepdim=True)[0]  # (H, 1)
        fills.constant[key] = tokens.mean(dim=0) + 0.5 * spread * torch.randn(tokens.shape[1:], generator=gen)
        donor = ctx.roll(1, dims=0)
        # other: a donor's contexts are not the example's own (distinct examples), or resampling could not fail
        assert not torch.equal(donor, ctx), f"{key}: every example has the same contexts"
        if is_translation(case):
            # per position: refused for translation; per example: enc_self only (decoder attention runs
            # incrementally in beam search)
            if key[0] == "enc_self":
                fills.per_example[key] = donor
            continue
        fills.per_example[key] = donor
        steps = ctx.shape[1]
        pooled = max(1, steps // 2)
        # moved off the mean too: with a BOS token every window's position 0 is the same, and its mean changes nothing
        by_position = ctx[:, :pooled].mean(dim=0) + 0.5 * spread * torch.randn(ctx[0, :pooled].shape, generator=gen)
        fills.per_position[key] = torch.cat([by_position, fills.constant[key][None]])
        moved_first = donor.clone()
        moved_first[:, 0] += 0.5 * spread * torch.randn(moved_first[:, 0].shape, generator=gen)
        fills.per_example_first_moved[key] = moved_first
    return fills


@pytest.fixture(scope="module")
def fills(case: FamilyCase, built: Built) -> Fills:
    return make_fills(case, built)


# -- 1. constant fill == weight surgery ---------------------------------------------------------------------------

@dataclass
class Routes:
    """The gated plain path and, on a second load, the stock model for weight surgery."""

    gated: EvalAdapter
    surgery: EvalAdapter


def make_routes(case: FamilyCase, built: Built) -> Routes:
    surgery = ungated(load_adapter(case, built, **{**PLAIN, "batch_size": WHOLE_SET}))
    if case.same_path:
        case.same_path(surgery.model)
    return Routes(load_adapter(case, built, **{**PLAIN, "batch_size": WHOLE_SET}), surgery)


@pytest.fixture(scope="module")
def routes(case: FamilyCase, built: Built) -> Routes:
    return make_routes(case, built)


def check_constant_fill_equals_weight_surgery(case: FamilyCase, routes: Routes, fills: Fills) -> None:
    gated, surgery = routes.gated, routes.surgery
    masks = [(h,) for h in gated.gates.inventory.heads]
    gated.gates.set_fill(HeadFill(fills.constant))
    try:
        filled = gated.evaluate([list(m) for m in masks])
    finally:
        gated.gates.set_fill(None)
    zeroed = gated.evaluate([list(m) for m in masks])
    (base,) = surgery.evaluate([[]])
    sites = {s.key: s for s in surgery.gates.sites}
    for (head,), got, zero in zip(masks, filled, zeroed, strict=True):
        site = sites[head.site]
        with folded_fill(site.out_proj, site.head_dim, {head.head: fills.constant[head.site][head.head]}):
            (expected,) = surgery.evaluate([[]])
        # summation order: the gate route multiplies W_O by the input with c_h in the head's slice and adds b; the
        # surgery multiplies the other heads' columns and adds b + W_O[:, h] c_h (summed in float64, rounded once).
        # The same terms in another order and grouping: at that one projection the routes differ by at most
        # gamma_(n+1) * sum|terms| each plus half an ulp of the folded bias, one of the 6 * depth products per
        # route the bound allows for, carried through the layers above as any rounding is.
        assert_same(got, expected, exact=False, bound=case.bound, what=(head, "fill vs surgery"))
        # other: the route can fail: a fill the gate ignored would leave zero ablation's loss, beyond the bound
        assert moved(got, zero, case.bound), f"{head}: the fill changes nothing against zero ablation"
    (after,) = surgery.evaluate([[]])
    assert_same(after, base, exact=True, bound=case.bound, what="weights put back")  # exact: the same model


def test_constant_fill_equals_weight_surgery(case, routes, fills):
    """Every head under a constant fill against the stock model with the head's W_O columns zeroed and
    ``W_O[:, h] @ c_h`` folded into the output projection's bias."""
    check_constant_fill_equals_weight_surgery(case, routes, fills)


# -- 2. per-position and per-example fills, keep_first == a substitution hook ----------------------------------

KINDS = ["constant_keep_first", "per_position", "per_position_keep_first", "per_example", "per_example_keep_first"]


def some_heads(sites: list[AttentionSite]) -> list[Head]:
    """A few heads: the first of the first site, one of the middle site, the last of the last."""
    first, middle, last = sites[0], sites[len(sites) // 2], sites[-1]
    return list(dict.fromkeys([Head(first.attention, first.layer, 0),
                               Head(middle.attention, middle.layer, min(1, middle.num_heads - 1)),
                               Head(last.attention, last.layer, last.num_heads - 1)]))


@contextmanager
def gated_with(adapter: EvalAdapter, fill: HeadFill | None, mask: list[Head]) -> Iterator[None]:
    adapter.gates.set_fill(fill)
    adapter.gates.set_mask(mask)
    try:
        yield
    finally:
        adapter.gates.clear()
        adapter.gates.set_fill(None)


def head_value(values: torch.Tensor, kind: str, head: int) -> torch.Tensor:
    """One head's values out of a site's fill: (d,), (P + 1, d) or (B, T, d)."""
    if kind.startswith("constant"):
        return values[head]
    if kind.startswith("per_position"):
        return values[:, head]
    return values[:, :, head]


def check_fill_equals_substitution(kind: str, fills: Fills) -> None:
    probe, batch = fills.probe, fills.batch
    sites = {s.key: s for s in probe.gates.sites}
    fill = fills.fill(kind)
    keep_first = kind.endswith("_keep_first")
    for head in some_heads(fills.sites(kind)):
        site = sites[head.site]
        with torch.no_grad():
            with gated_with(probe, fill, [head]):
                got, _ = batch.outputs()
            with gated_with(probe, None, [head]):
                zeroed, _ = batch.outputs()
            value = head_value(fill.values[head.site], kind, head.head)
            with substituted(site.out_proj, site.head_dim, site.batch_dim,
                             [Substitution(head.head, value, keep_first)]) as calls:
                want, _ = batch.outputs()
            assert calls, f"{head}: the substitution hook never ran"
            # exact: the gate writes heads * 1 + 0 * fill = heads and heads * 0 + 1 * fill = fill (no rounding),
            # so the projection multiplies the same floats the hook wrote, in the same shapes
            assert torch.equal(got, want), f"{kind} {head}: gate fill and substitution differ by " \
                                           f"{(got - want).abs().max().item():.3g}"
            # other: the route can fail: a fill the gate ignored would give zero ablation's outputs
            assert not torch.equal(got, zeroed), f"{kind} {head}: the fill changes nothing against zero ablation"
            if keep_first:
                # other: keep_first can fail: writing position 0 too changes the outputs
                with substituted(site.out_proj, site.head_dim, site.batch_dim, [Substitution(head.head, value)]):
                    everywhere, _ = batch.outputs()
                assert not torch.equal(want, everywhere), f"{kind} {head}: position 0 changes nothing"


@pytest.mark.parametrize("kind", KINDS)
def test_fill_equals_substitution_hook(case, built, fills, kind):
    """Per-position and per-example fills and keep_first against a hook that writes the head's values over its
    slice of the output projection's input, position by position."""
    if is_translation(case) and kind != "per_example":
        pytest.skip("translation: per_position and keep_first are refused (decoder attention runs incrementally); "
                    "constant fills are checked against weight surgery")
    if kind == "per_example" and not fills_per_example(built):
        pytest.skip(f"{case.id}: resample is refused (the family fills no attention type from another input)")
    check_fill_equals_substitution(kind, fills)


# -- 3. reuse and packed masks == the plain path, under every fill ------------------------------------------------

FILL_KINDS = ["constant", "constant_keep_first", "per_position", "per_example"]


def fill_masks(fills: Fills, kind: str) -> list[Mask]:
    """The empty mask, single heads at the first and last site, a mask over two sites, one head of every site (each
    attention type of a translation model) and an all-but-one mask, over the sites the fill covers."""
    sites = fills.sites(kind)
    first, middle, last = sites[0], sites[len(sites) // 2], sites[-1]

    def head(site: AttentionSite, h: int) -> Head:
        return Head(site.attention, site.layer, h)

    return [(), (head(first, 0),), (head(last, last.num_heads - 1),),
            (head(first, 1), head(last, 0)),
            tuple(head(s, s.layer % s.num_heads) for s in sites),
            tuple(head(middle, h) for h in range(middle.num_heads) if h != 1)]


@dataclass
class Variants:
    """The adapters reuse and packing run on, beside the plain path (:class:`Routes`' gated adapter)."""

    reuse: EvalAdapter
    packed: EvalAdapter
    packed_reuse: EvalAdapter


def make_variants(case: FamilyCase, built: Built) -> Variants:
    def load(**runtime) -> EvalAdapter:
        return load_adapter(case, built, batch_size=WHOLE_SET, **runtime)

    return Variants(load(reuse=True, masks_per_batch=1), load(reuse=False, masks_per_batch=PACKED),
                    load(reuse=True, masks_per_batch=PACKED))


@pytest.fixture(scope="module")
def variants(case: FamilyCase, built: Built) -> Variants:
    return make_variants(case, built)


def evaluate_with(adapter: EvalAdapter, fill: HeadFill | None, masks: list[Mask]) -> list[MaskOutput]:
    adapter.gates.set_fill(fill)
    try:
        return adapter.evaluate([list(m) for m in masks])
    finally:
        adapter.gates.set_fill(None)


def check_reuse_and_packed_equal_plain(case: FamilyCase, kind: str, routes: Routes, variants: Variants,
                                       fills: Fills) -> None:
    masks = fill_masks(fills, kind)
    fill = fills.fill(kind)
    last = routes.gated.gates.sites[-1]
    with rows_seen(last) as plain_rows:
        plain = evaluate_with(routes.gated, fill, masks)
    zeroed = evaluate_with(routes.gated, None, masks)
    # other: the routes can fail: each non-empty mask's fill moves the loss away from zero ablation's
    for mask, got, zero in zip(masks[1:], plain[1:], zeroed[1:], strict=True):
        assert moved(got, zero, case.bound), f"{kind} {mask}: the fill changes nothing against zero ablation"
    for name in ("reuse", "packed", "packed_reuse"):
        adapter = getattr(variants, name)
        with rows_seen(adapter.gates.sites[-1]) as rows:
            outputs = evaluate_with(adapter, fill, masks)
        if name != "packed":
            note = adapter.describe().facts["reuse"]
            assert not note.startswith(("off", "plain path")), f"{kind} {name}: {note}"
        if name.startswith("packed"):
            assert rows and max(rows) > max(plain_rows), f"{kind} {name}: no pass carried more than one mask"
        for mask, got, want in zip(masks, outputs, plain, strict=True):
            # exact: reuse replays the plain path's arithmetic with the same apply_gates (case.exact_reuse); else
            # summation order: several masks in one pass, or cached states in other batch shapes
            exact = name == "reuse" and case.exact_reuse
            assert_same(got, want, exact=exact, bound=case.bound, what=(kind, name, mask))


@pytest.mark.parametrize("kind", FILL_KINDS)
def test_reuse_and_packed_equal_plain_under_fill(case, built, routes, variants, fills, kind):
    """Prefix/encoder reuse and packed masks against the plain path, one mask per pass, under each fill."""
    if is_translation(case) and kind not in ("constant", "per_example"):
        pytest.skip("translation refuses per_position and keep_first")
    if kind == "per_example" and not fills_per_example(built):
        pytest.skip(f"{case.id}: resample is refused (the family fills no attention type from another input)")
    check_reuse_and_packed_equal_plain(case, kind, routes, variants, fills)


# -- 4. the gate gradient under a constant fill is attribution patching -------------------------------------------

@contextmanager
def trainable(model: torch.nn.Module) -> Iterator[None]:
    """Parameters that require grad inside (so the projections' inputs carry gradients), as they were after."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def check_gate_gradient_is_attribution_patching(fills: Fills) -> None:
    probe, batch = fills.probe, fills.batch
    sites = probe.gates.sites
    gates = {s.key: torch.ones(s.num_heads, requires_grad=True) for s in sites}
    probe.gates.set_fill(HeadFill(fills.constant))
    probe.gates.set_values(gates)
    try:
        grads = torch.autograd.grad(batch.loss(), [gates[s.key] for s in sites])
    finally:
        probe.gates.clear()
        probe.gates.set_fill(None)

    # The hooked model: no gates, a plain pre-hook keeps each projection input and its gradient dL/dz'.
    inputs: dict[SiteKey, torch.Tensor] = {}
    handles = []
    for site in sites:
        def keep(_m, args, site=site):
            inputs[site.key] = args[0]
            args[0].retain_grad()
        handles.append(site.out_proj.register_forward_pre_hook(keep))
    try:
        with trainable(probe.model):
            batch.loss().backward()
    finally:
        for h in handles:
            h.remove()
        probe.model.zero_grad(set_to_none=True)

    gained = 0
    for site, grad in zip(sites, grads, strict=True):
        x = inputs[site.key]
        z = x.detach().double().reshape(*x.shape[:-1], site.num_heads, site.head_dim)
        g = x.grad.double().reshape(z.shape)
        c = fills.constant[site.key].double()
        lead = tuple(range(z.dim() - 2))
        want = ((z - c) * g).sum(dim=(*lead, -1))  # (H,), float64
        # summation order: autograd reduces dL/dxi as sum(g * z) - sum(g * c) over n = (tokens x d) float32 terms,
        # each sum within gamma_n ~ n * u of the sum of its |terms|, and one rounding of the difference; the
        # reference sums the same float32 products in float64. With eps = 2u: n * eps * (sum|g z| + sum|g c|) +
        # eps * |reference|.
        n = math.prod(z.shape[:-2]) * site.head_dim
        eps = torch.finfo(torch.float32).eps
        terms = (g * z).abs().sum(dim=(*lead, -1)) + (g * c).abs().sum(dim=(*lead, -1))
        bound = n * eps * terms + eps * want.abs()
        diff = (grad.double() - want).abs()
        assert bool((diff <= bound).all()), f"{site.key}: dL/dxi {grad.tolist()} vs (z - c) . dL/dz' " \
                                             f"{want.tolist()} (difference {diff.max().item():.3g})"
        # other: the check can fail: the zero-ablation identity z . dL/dz' misses the fill by more than the bound
        zero = (z * g).sum(dim=(*lead, -1))
        gained += int(((grad.double() - zero).abs() > bound).sum())
    assert gained >= sum(s.num_heads for s in sites) // 2, "the fill hardly enters the gate gradient"


def test_gate_gradient_is_attribution_patching(case, fills):
    """dL/dxi_h at xi = 1 under a constant fill equals (z_h - c_h) . dL/dz'_h, dL/dz' by autograd on a hooked
    model (the attribution-patching estimate of the ablation)."""
    check_gate_gradient_is_attribution_patching(fills)


# -- Qwen2: attention biases, no o_proj bias --------------------------------------------------------------------

def build_qwen2(folder: Path) -> Built:
    """The tiny Qwen2 LM, its tokenizer in a folder of its own (``model.tokenizer``): transformers 5 loads the
    word-level tokenizer saved beside a Qwen2 config as Qwen2's own class, which reads the corpus as one token
    repeated."""
    from tiny_models import build_lm_tokenizer

    built = _lm_builder("qwen2_14q2kv", "sdpa", "hidden_size", "num_attention_heads", "num_key_value_heads",
                        qkv_bias=True)(folder)
    build_lm_tokenizer().save_pretrained(folder / "tokenizer")
    built.model["tokenizer"] = str(folder / "tokenizer")
    return built


# two layers and the LM head; the longest inner product is the feed-forward size (2 x 56)
QWEN2 = FamilyCase("causal_lm-qwen2-sdpa", build_qwen2, {"depth": 2 + 1, "width": max(112, LM_WINDOW)},
                   _exported_hf, runtime={"batch_size": 4})


@dataclass
class Qwen2:
    case: FamilyCase
    routes: Routes
    fills: Fills
    variants: Variants


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Qwen2:
    built = QWEN2.build(tmp_path_factory.mktemp(QWEN2.id))
    return Qwen2(QWEN2, make_routes(QWEN2, built), make_fills(QWEN2, built), make_variants(QWEN2, built))


def test_qwen2_constant_fill_equals_weight_surgery(qwen2):
    """Qwen2's o_proj has no bias: the surgery gives it one, holding W_O[:, h] @ c_h."""
    assert qwen2.routes.surgery.gates.sites[0].out_proj.bias is None
    check_constant_fill_equals_weight_surgery(qwen2.case, qwen2.routes, qwen2.fills)


@pytest.mark.parametrize("kind", KINDS)
def test_qwen2_fill_equals_substitution_hook(qwen2, kind):
    check_fill_equals_substitution(kind, qwen2.fills)


@pytest.mark.parametrize("kind", FILL_KINDS)
def test_qwen2_reuse_and_packed_equal_plain_under_fill(qwen2, kind):
    check_reuse_and_packed_equal_plain(qwen2.case, kind, qwen2.routes, qwen2.variants, qwen2.fills)


def test_qwen2_gate_gradient_is_attribution_patching(qwen2):
    check_gate_gradient_is_attribution_patching(qwen2.fills)


def test_folded_fill_route():
    """The surgery route itself, in float64 (where folding rounds at the 1e-16 level): folding c into the bias
    equals writing c into the head's slice of the input, for nn.Linear with and without a bias and for GPT-2's
    Conv1D; the weights and the bias (or its absence) are back after."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    for proj in (torch.nn.Linear(8, 5), torch.nn.Linear(8, 5, bias=False), Conv1D(5, 8)):
        proj = proj.double()
        before = {k: v.clone() for k, v in proj.state_dict().items()}
        x = torch.randn(3, 8, dtype=torch.float64)
        c = torch.randn(4, dtype=torch.float64)
        written = x.clone()
        written[:, 4:] = c
        want = proj(written)
        with folded_fill(proj, 4, {1: c}):
            got = proj(x)
            assert bool(proj.bias.ne(0).any())
        # other: float64 rounding of 8-term sums of unit-sized numbers
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-12)
        assert not np.allclose(proj(x).detach().numpy(), want.detach().numpy())  # other: c is not x's slice
        after = proj.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
