"""Prefix reuse for BERT-style classifiers: each mask's forward pass starts at its first gated layer.

For every evaluation batch the baseline runs once with recording hooks: the output of every
layer and the input of every attention output projection (the per-head contexts). A mask
whose first gated layer is l then runs the model's own forward with

* layers 0..l-2 skipped and layer l-1 returning its cached output (embeddings skipped too),
* layer l's attention core returning the output projection of its cached contexts with the
  masked heads gated off (:func:`headsweep.workers.memory.replay.gated_projection`): no query/key/value or
  attention-score work,
* layers after l computed as usual, with per-example gates for any heads masked there.

Masks that share a first layer share one forward pass (the batch repeated once per mask).
Baseline states are kept between calls within a memory budget (:class:`headsweep.workers.memory.replay.BaselineCache`).

Layouts handled (:mod:`headsweep.workers.families.hf_shared.layout`): BERT, RoBERTa, ELECTRA,
MiniLM and DistilBERT, whose layers form one ``nn.ModuleList`` and return a tensor. Anything
else (ALBERT, whose one layer runs at every depth, among them) is evaluated with the plain path;
:func:`classifier_layout` says why.
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
    pass_through,
    replaced_forwards,
    returning,
)


@dataclass
class ClassifierLayout:
    """Where a classifier's layers and attention cores are, one entry per attention site."""

    sites: list[AttentionSite]
    layers: list[nn.Module]
    cores: list[nn.Module]  # returns (attention output or contexts, weights)
    identities: list[nn.Module | None]  # W_O to skip when the core already returns projected output
    embeddings: nn.Module | None


@dataclass
class BaselineStates:
    """One evaluation batch's baseline: logits, layer outputs and per-head contexts."""

    logits: torch.Tensor
    hidden: list[torch.Tensor]  # output of layer i (the input of layer i+1), i < L-1
    contexts: list[torch.Tensor]  # input of layer i's output projection
    embedding_shape: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.logits, *self.hidden, *self.contexts])


def classifier_layout(model: nn.Module, sites: Sequence[AttentionSite]) -> ClassifierLayout:
    """The layout prefix reuse needs, or :class:`ReuseUnsupported` naming what does not fit."""
    shared = next((s for s in sites if s.shared is not None), None)
    if shared is not None:
        # Skipping the layers below a mask's first gated one would skip calls of the shared module too, and with
        # them the call counts that tell its applications apart.
        raise ReuseUnsupported(f"{shared.module_name} runs at several depths (a layer shared across depths, ALBERT): "
                               "its applications have no layers of their own to start at")
    stack, indices = layer_stack(model, sites)
    if indices != list(range(len(stack))):
        raise ReuseUnsupported("the layer stack does not hold exactly one attention module per layer, in order")
    cores, identities = [], []
    for site in sites:
        layout = attention_layout(site.module)
        if layout is None or layout.name not in ("bert", "distilbert") or layout.out_proj is not site.out_proj:
            raise ReuseUnsupported(
                f"{site.module_name} ({type(site.module).__name__}) is neither a BERT-style attention "
                "(self + output.dense) nor a DistilBERT one (out_lin)"
            )
        cores.append(layout.core)
        identities.append(None if layout.core_projects else site.out_proj)
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    return ClassifierLayout(list(sites), list(stack), cores, identities,
                            embeddings if isinstance(embeddings, nn.Module) else None)


class PrefixReuse(RecordedBaselines[BaselineStates]):
    """Baseline states per evaluation batch (``states(key, inputs)``), and masked forward passes that start from
    them."""

    def __init__(self, model: nn.Module, gates: HeadGates, layout: ClassifierLayout, budget_bytes: int):
        super().__init__(budget_bytes)
        self.model, self.gates, self.layout = model, gates, layout

    def record(self, inputs: dict) -> BaselineStates:
        """Run the ungated model once, keeping each layer's output and each projection's input."""
        lay = self.layout
        n = len(lay.layers)
        hidden: list = [None] * n
        contexts: list = [None] * n
        shape: list = [None]
        handles = []
        for i, layer in enumerate(lay.layers):
            handles.append(layer.register_forward_hook(lambda _m, _a, out, i=i: hidden.__setitem__(i, out)))
        for i, site in enumerate(lay.sites):
            handles.append(site.out_proj.register_forward_pre_hook(
                lambda _m, args, i=i: contexts.__setitem__(i, args[0])))
        if lay.embeddings is not None:
            handles.append(lay.embeddings.register_forward_hook(
                lambda _m, _a, out: shape.__setitem__(0, tuple(out.shape) if torch.is_tensor(out) else None)))
        self.gates.clear()
        try:
            logits = self.model(**inputs).logits
        finally:
            for h in handles:
                h.remove()
        if not all(torch.is_tensor(h) for h in hidden):
            raise ReuseUnsupported("a layer returns a tuple, not a tensor (older transformers layout)")
        if any(c is None for c in contexts):
            raise ReuseUnsupported("an attention output projection was not called as a module")
        return BaselineStates(logits, hidden[:-1], contexts, shape[0])

    def groups(self, masks: Sequence[Sequence[Head]]) -> list[list[int]]:
        """The positions of ``masks`` that may share a pass: one first gated layer each (the empty mask apart)."""
        return list(by_first_gated_layer(masks, self.gates.inventory).values())

    def start(self, key: int, inputs: dict) -> Callable[[list[Sequence[Head]]], torch.Tensor]:
        """Batch ``key``'s forward pass on the reuse path (a :data:`~headsweep.workers.core.mask_grid.Pass`): masks
        of one :meth:`groups` group started at their first gated layer from the batch's baseline states (recorded
        now, ungated), the empty mask the baseline itself; logits per row, mask-major."""
        states = self.states(key, inputs)

        def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
            layer = first_gated_layer(chunk[0])
            if layer is None:
                return states.logits.repeat(len(chunk), 1)
            return self.run(inputs, states, layer, chunk)

        return forward

    def run(self, inputs: dict, states: BaselineStates, layer: int, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Logits of the batch under each mask (all first gated at ``layer``), mask-major: (k*B, labels)."""
        lay = self.layout
        k = len(masks)
        rows = states.logits.shape[0]
        site = lay.sites[layer]
        at_layer = [[h.head for h in m if h.layer == layer] for m in masks]
        later = [[h for h in m if h.layer > layer] for m in masks]
        attention = gated_projection(states.contexts[layer], site.out_proj, site.num_heads, at_layer, batch_dim=0,
                                     fill=self.gates.fill, site=site.key)
        replacements: dict[nn.Module, object] = {lay.cores[layer]: returning((attention, None))}
        if lay.identities[layer] is not None:
            replacements[lay.identities[layer]] = pass_through
        # Only mask creation reads the embeddings' shape now; their values go nowhere.
        replacements.update(start_at_layer(lay.layers, layer, states.hidden, k, lay.embeddings,
                                           states.embedding_shape))
        stacked = {key: repeat_rows(v, k) for key, v in inputs.items()}
        if any(later):
            self.gates.set_masks_per_example(later, rows_per_mask=rows)
        try:
            with replaced_forwards(replacements):
                return self.model(**stacked).logits
        finally:
            self.gates.clear()

