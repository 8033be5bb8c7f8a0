"""Prefix reuse for causal LMs: each mask's forward pass over a window batch starts at its first gated layer.

For every window batch the baseline runs once with recording hooks: the output of every decoder layer and the
input of every attention output projection (the per-head contexts), plus the baseline's per-token NLL (which
*is* the empty mask's result). A mask whose first gated layer is l then runs the model's own forward with

* the input embeddings returning zeros of the right shape and dtype (their values go nowhere now; the model
  still builds its position ids, rotary tables and causal mask from them, as it always does),
* layers 0..l-2 passed through and layer l-1 returning its cached output,
* layer l's attention module returning the output projection of its cached contexts with the masked heads
  gated off (:func:`headsweep.workers.memory.replay.gated_projection`): no query/key/value or attention-score work,
* layers after l, the final norm and the LM head computed as usual, with per-example gates for any heads
  masked there, and only the logits the windows score (the adapter's ``logits_to_keep``).

Masks with the same first layer share one forward pass (the window batch repeated once per mask).

Layouts (:mod:`headsweep.workers.families.hf_shared.layout`): Llama-style attention (Llama, Mistral, Qwen2,
Qwen3, ...), GPT-2 / GPTBigCode and GPT-NeoX, whose decoder layers form one ``nn.ModuleList``, return a tensor, and
whose attention module returns ``(output projection's output, weights)``. Recording checks all of that on the model
itself, and the first masked pass is compared bit for bit with the whole gated model (:meth:`PrefixReuse.verify`);
anything else raises :class:`~headsweep.workers.memory.replay.ReuseUnsupported` and the plain path runs instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from headsweep.workers.core.gates import AttentionSite, HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_shared.layout import attention_layout
from headsweep.workers.families.hf_shared.reuse import repeat_rows, start_at_layer
from headsweep.workers.memory.replay import (
    RecordedBaselines,
    ReuseUnsupported,
    by_first_gated_layer,
    first_gated_layer,
    gated_projection,
    layer_stack,
    replaced_forwards,
    returning,
)

#: Attention layouts whose module returns ``(output projection's output, weights)`` inside a layer stack that
#: returns a tensor: GPT-NeoX (Pythia) too, its attention ending with ``dense``.
REUSE_LAYOUTS = ("llama", "gpt2", "gpt_neox")

#: ``(input_ids, scored) -> per-position NLL``: the adapter's forward pass (and loss) over a window batch.
TokenNLL = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearWeights:
    """An output projection's weight and bias in ``nn.Linear``'s orientation ``(out, in)``, what
    :func:`~headsweep.workers.memory.replay.gated_projection` reads.

    GPT-2's ``c_proj`` is a ``Conv1D`` computing ``addmm(bias, x, W)`` with ``W`` stored ``(in, out)``; handing
    ``W.t()`` (a view) to ``F.linear`` multiplies the same matrices, so the projection is the same floats (the
    tests and :meth:`PrefixReuse.verify` check it bit for bit).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class DecoderLayout:
    """Where a causal LM's decoder layers, attention modules and output projections are."""

    sites: list[AttentionSite]
    layers: list[nn.Module]  # the decoder layer stack; site.layer indexes it
    projections: list[nn.Module | LinearWeights]  # per site: nn.Linear, or a Conv1D's weights turned round
    embeddings: nn.Module | None  # the input embeddings (token ids -> vectors)

    def site_at(self, layer: int) -> tuple[int, AttentionSite]:
        """The position in ``sites`` and the site of decoder layer ``layer``."""
        for i, site in enumerate(self.sites):
            if site.layer == layer:
                return i, site
        raise ReuseUnsupported(f"layer {layer} has no attention heads to gate")


def _projection(site: AttentionSite) -> nn.Module | LinearWeights:
    out = site.out_proj
    if isinstance(out, nn.Linear):
        return out
    from transformers.pytorch_utils import Conv1D

    if isinstance(out, Conv1D) and out.weight.dim() == 2:
        return LinearWeights(out.weight.t(), out.bias)
    raise ReuseUnsupported(f"{site.module_name}: output projection {type(out).__name__} is neither nn.Linear nor "
                           "GPT-2's Conv1D")


def decoder_layout(model: nn.Module, sites: Sequence[AttentionSite]) -> DecoderLayout:
    """The layout prefix reuse needs, or :class:`ReuseUnsupported` naming what does not fit."""
    if model.training:
        raise ReuseUnsupported("the model is in training mode (dropout would differ between passes)")
    stack, indices = layer_stack(model, sites)
    for site, index in zip(sites, indices, strict=True):
        if index != site.layer:
            raise ReuseUnsupported(f"{site.module_name} is in decoder layer {index}, not layer {site.layer} of the "
                                   "stack (one attention module per layer, in order)")
        layout = attention_layout(site.module)
        if layout is None or layout.name not in REUSE_LAYOUTS or layout.out_proj is not site.out_proj:
            raise ReuseUnsupported(f"{site.module_name} ({type(site.module).__name__}) is neither a Llama-style "
                                   "(o_proj), a GPT-2 / GPTBigCode (c_proj) nor a GPT-NeoX (dense) attention "
                                   "module")
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    return DecoderLayout(list(sites), list(stack), [_projection(s) for s in sites],
                         embeddings if isinstance(embeddings, nn.Module) else None)


@dataclass
class BaselineStates:
    """One window batch's baseline: per-position NLL, the layer outputs and per-head contexts masks start from."""

    token_nll: torch.Tensor  # (B, W - 1): the adapter's token NLL of the ungated model
    hidden: dict[int, torch.Tensor]  # output of layer i, kept for every i = site.layer - 1 >= 0
    contexts: list[torch.Tensor]  # per site: the input of its output projection
    embedding_shape: tuple[int, ...] | None  # the input embeddings' output shape; None: do not skip them
    embedding_dtype: torch.dtype | None = None  # and its dtype (rotary tables are built in it)

    @property
    def nbytes(self) -> int:
        tensors = [self.token_nll, *self.hidden.values(), *self.contexts]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixReuse(RecordedBaselines[BaselineStates]):
    """Baseline states per window batch (``states(key, inputs, scored)``), and masked forward passes that start
    from them."""

    def __init__(self, model: nn.Module, gates: HeadGates, layout: DecoderLayout, token_nll: TokenNLL,
                 budget_bytes: int):
        super().__init__(budget_bytes)
        self.model, self.gates, self.layout, self.token_nll = model, gates, layout, token_nll
        self.verified = False

    def record(self, inputs: torch.Tensor, scored: torch.Tensor, mask: Sequence[Head] = ()) -> BaselineStates:
        """Run the model once, keeping each needed layer output and each projection's input, and check on the way
        that the model computes what replaying it assumes.

        ``mask`` empty (the baseline): the ungated model. Otherwise the pass is the whole model with ``mask``
        gated, its NLL the gated model's: the layers below the mask's first gated layer are the baseline's and the
        projection inputs are read before any gate, so a replay of ``mask`` from these states must reproduce that
        NLL exactly (:meth:`verify_first_row`); states past that layer fit no other mask."""
        lay = self.layout
        keep = {s.layer - 1 for s in lay.sites if s.layer > 0}
        layer_out: dict[int, list] = {i: [] for i in range(len(lay.layers))}  # (is a tensor, kept output)
        called: list[int] = []  # the order the layers ran in
        contexts: list[list] = [[] for _ in lay.sites]
        projected: list = [None] * len(lay.sites)
        returns_projection: list[list[bool]] = [[] for _ in lay.sites]
        embedded: list = []

        def layer_hook(i):
            def hook(_m, _a, out):
                called.append(i)
                layer_out[i].append((torch.is_tensor(out), out if i in keep else None))
            return hook

        def attention_hook(i):
            def hook(_m, _a, out):
                ok = isinstance(out, tuple) and len(out) == 2 and projected[i] is not None and out[0] is projected[i]
                returns_projection[i].append(ok)
                projected[i] = None
            return hook

        handles = [layer.register_forward_hook(layer_hook(i)) for i, layer in enumerate(lay.layers)]
        for i, site in enumerate(lay.sites):
            # Prepended: the projection's input as the attention computed it, before the head gates' own pre-hook.
            handles.append(site.out_proj.register_forward_pre_hook(lambda _m, args, i=i: contexts[i].append(args[0]),
                                                                    prepend=True))
            handles.append(site.out_proj.register_forward_hook(lambda _m, _a, out, i=i: projected.__setitem__(i, out)))
            handles.append(site.module.register_forward_hook(attention_hook(i)))
        if lay.embeddings is not None:
            handles.append(lay.embeddings.register_forward_hook(
                lambda _m, _a, out: embedded.append((tuple(out.shape), out.dtype) if torch.is_tensor(out) else None)))
        self.gates.set_mask(mask)  # an empty mask: no gates
        try:
            token_nll = self.token_nll(inputs, scored)
        finally:
            self.gates.clear()
            for h in handles:
                h.remove()
        for i, outs in layer_out.items():
            if len(outs) != 1 or not outs[0][0]:
                raise ReuseUnsupported(f"decoder layer {i} ran {len(outs)} times or did not return one tensor")
        if called != sorted(called):
            raise ReuseUnsupported("the decoder layers did not run in the order of their layer list")
        for i, site in enumerate(lay.sites):
            if len(contexts[i]) != 1 or returns_projection[i] != [True]:
                raise ReuseUnsupported(f"{site.module_name} does not call its output projection once and return "
                                       "(its result, attention weights) unchanged")
        shape, dtype = embedded[0] if len(embedded) == 1 and embedded[0] is not None else (None, None)
        if shape is None or shape[:2] != tuple(inputs.shape):
            shape, dtype = None, None
        return BaselineStates(token_nll, {i: layer_out[i][0][1] for i in sorted(keep)},
                              [c[0] for c in contexts], shape, dtype)

    def run(self, inputs: torch.Tensor, scored: torch.Tensor, states: BaselineStates, layer: int,
            masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Per-position NLL of the batch under each mask (all first gated at ``layer``), mask-major: (k*B, W-1)."""
        lay = self.layout
        k, rows = len(masks), inputs.shape[0]
        index, site = lay.site_at(layer)
        at_layer = [[h.head for h in m if h.layer == layer] for m in masks]
        later = [[h for h in m if h.layer > layer] for m in masks]
        if any(h.layer < layer for m in masks for h in m):
            raise ValueError(f"a mask gates a head below its first gated layer {layer}")
        attention = gated_projection(states.contexts[index], lay.projections[index], site.num_heads, at_layer,
                                     batch_dim=0, fill=self.gates.fill, site=site.key)
        replacements: dict[nn.Module, Callable] = {site.module: returning((attention, None))}
        # Only the shape and dtype of the embeddings are read now (positions, rotary tables, masks).
        replacements.update(start_at_layer(lay.layers, layer, states.hidden, k, lay.embeddings,
                                           states.embedding_shape, states.embedding_dtype))
        if any(later):
            self.gates.set_masks_per_example(later, rows_per_mask=rows)
        try:
            with replaced_forwards(replacements):
                return self.token_nll(repeat_rows(inputs, k), repeat_rows(scored, k))
        finally:
            self.gates.clear()

    def groups(self, masks: Sequence[Sequence[Head]]) -> list[list[int]]:
        """The positions of ``masks`` that may share a pass: one first gated layer each (the empty mask apart)."""
        return list(by_first_gated_layer(masks, self.gates.inventory).values())

    def start(self, key: int, inputs: torch.Tensor, scored: torch.Tensor) -> Callable[[list[Sequence[Head]]],
                                                                                   torch.Tensor]:
        """Batch ``key``'s forward pass on the reuse path (a :data:`~headsweep.workers.core.mask_grid.Pass`): masks
        of one :meth:`groups` group started at their first gated layer from the batch's baseline states, the empty
        mask the baseline itself; per-row values, mask-major.

        The states are recorded now, ungated (before the batch's per-example fill), and the first batch verifies
        the replay once on the deepest layer (the most replayed) before ``describe()`` reports reuse, on its first
        window alone (:meth:`verify_first_row`).
        ``inputs``: the batch's input ids; ``scored``: what it scores (the adapter's second argument to its
        forward pass)."""
        states = self.states(key, inputs, scored)
        if not self.verified:
            self.verify_first_row(inputs, scored, states)

        def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
            layer = first_gated_layer(chunk[0])
            if layer is None:
                return states.token_nll.repeat(len(chunk), 1)
            return self.run(inputs, scored, states, layer, chunk)

        return forward

    def verify_first_row(self, inputs: torch.Tensor, scored: torch.Tensor, states: BaselineStates) -> None:
        """:meth:`verify` on the deepest layer's first head. A batch of more than two windows is checked on its first
        window alone: one whole gated pass over that window, recording on the way the states its replay starts from
        (:meth:`record` with the mask), rather than a whole gated pass over the batch, which a grid of one batch
        spends on nothing else. The states are not cut from the batch's: a window's floats may depend on the
        batch's size (the kernels chosen), so only a replay and a whole pass of one shape are compared."""
        site = self.gates.sites[-1]
        mask = [Head(site.attention, site.layer, 0)]
        if inputs.shape[0] > 2:
            inputs, scored = inputs[:1], scored[:1]
            states = self.record(inputs, scored, mask)
            self.verify(inputs, scored, states, mask, whole=states.token_nll)
        else:
            self.verify(inputs, scored, states, mask)

    def verify(self, inputs: torch.Tensor, scored: torch.Tensor, states: BaselineStates,
               mask: Sequence[Head], whole: torch.Tensor | None = None) -> None:
        """Check once that a masked pass replayed from the cached states is the whole gated model's pass (``whole``,
        computed here when not given), bit for bit (one mask, the same shapes: the same kernels);
        :class:`ReuseUnsupported` if not.

        Recording checks the layout's shape; this checks what it cannot see (a layer reading more than its input,
        state carried between layers, a cached tensor changed in place).
        """
        layer = first_gated_layer(mask)
        replayed = self.run(inputs, scored, states, layer, [mask])
        if whole is None:
            with self.gates.masked(mask):
                whole = self.token_nll(inputs, scored)
        same = (replayed == whole) | (replayed.isnan() & whole.isnan())
        if replayed.shape != whole.shape or not bool(same.all()):
            raise ReuseUnsupported(f"replaying the model from cached states (mask {[str(h) for h in mask]}) does not "
                                   "reproduce the whole model's result exactly")
        self.verified = True
