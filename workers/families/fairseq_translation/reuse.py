"""Encoder reuse for fairseq translation models.

A mask that gates no ``enc_self`` head leaves the encoder as it is: its beam search and its
teacher-forced scoring read the baseline encoder output, computed once per sentence batch and
kept (within a memory budget) for every later mask. A mask whose first gated encoder layer is
l runs fairseq's own encoder forward with layers 0..l-2 skipped, layer l-1 returning its
cached output and layer l's self-attention returning the output projection of its cached
per-head contexts with the masked heads gated off (:mod:`headsweep.workers.memory.replay`); later encoder
layers run as usual, with per-example gates. Masks of one call that share a first layer share
one encoder pass (the sentences repeated once per mask, mask-major, as in the packed search).

The encoder output of a packed search is assembled mask by mask: fairseq's own
``reorder_encoder_out`` repeats the baseline for every mask, then the rows of masks that gate
encoder heads are replaced by their own encoder output.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.memory.replay import (
    RecordedBaselines,
    ReuseUnsupported,
    gated_projection,
    pass_through,
    replaced_forwards,
    returning,
)


@dataclass
class EncoderStates:
    """One sentence batch's baseline encoder: its output dict, layer outputs and per-head contexts."""

    out: dict
    hidden: list[torch.Tensor]  # output of encoder layer i (time-first), i < L-1
    contexts: list[torch.Tensor]  # input of encoder layer i's self-attention output projection

    @property
    def nbytes(self) -> int:
        tensors = [t for v in self.out.values() for t in v if torch.is_tensor(t)] + self.hidden + self.contexts
        return sum(t.numel() * t.element_size() for t in tensors)


def unfused(gates: HeadGates):
    """Every encoder layer off fairseq's fused attention path (it computes no per-head contexts to
    record, and the layers after a replayed one must repeat the recorded baseline's arithmetic)."""
    return gates.unfused() if hasattr(gates, "unfused") else nullcontext()


def first_encoder_layer(mask: Sequence[Head]) -> int | None:
    """The lowest encoder layer with a masked ``enc_self`` head (None: the encoder is the baseline's)."""
    return min((h.layer for h in mask if h.attention == "enc_self"), default=None)


class EncoderReuse(RecordedBaselines[EncoderStates]):
    """Baseline encoder states per sentence batch (``states(key, net_input)``), and encoder outputs for packed
    masks built from them."""

    def __init__(self, model: nn.Module, gates: HeadGates, budget_bytes: int):
        super().__init__(budget_bytes)
        encoder = getattr(model, "encoder", None)
        layers = getattr(encoder, "layers", None)
        for needed in ("forward_torchscript", "reorder_encoder_out"):
            if not hasattr(encoder, needed):
                raise ReuseUnsupported(f"the encoder ({type(encoder).__name__}) has no {needed}")
        sites = {s.layer: s for s in gates.sites if s.attention == "enc_self"}
        if not isinstance(layers, nn.ModuleList) or sorted(sites) != list(range(len(layers))):
            raise ReuseUnsupported("the encoder's layers are not one list with one enc_self site each")
        for i, layer in enumerate(layers):
            if getattr(layer, "self_attn", None) is not sites[i].module:
                raise ReuseUnsupported(f"encoder layer {i} has no self_attn holding its gated attention")
        self.encoder, self.gates, self.layers = encoder, gates, list(layers)
        self.sites = [sites[i] for i in range(len(layers))]

    def record(self, net_input: dict) -> EncoderStates:
        """Run the ungated encoder once, keeping each layer's output and each projection's input."""
        n = len(self.layers)
        hidden: list = [None] * n
        contexts: list = [None] * n

        def keep_output(i):
            return lambda _m, _a, out: hidden.__setitem__(i, out[0] if isinstance(out, tuple) else out)

        handles = [layer.register_forward_hook(keep_output(i)) for i, layer in enumerate(self.layers)]
        handles += [s.out_proj.register_forward_pre_hook(lambda _m, args, i=i: contexts.__setitem__(i, args[0]))
                    for i, s in enumerate(self.sites)]
        self.gates.clear()
        try:
            with unfused(self.gates):
                out = self.encoder.forward_torchscript(net_input)
        finally:
            for h in handles:
                h.remove()
        if any(c is None for c in contexts):
            raise ReuseUnsupported("an encoder self-attention output projection was not called as a module")
        return EncoderStates(out, hidden[:-1], contexts)

    def encode(self, key: int, net_input: dict, masks: Sequence[Sequence[Head]]) -> dict:
        """The encoder output for the batch's sentences under each mask, mask-major (k*B rows).

        Leaves no gates set; the caller routes its gates again afterwards.
        """
        states = self.states(key, net_input)
        rows = net_input["src_tokens"].shape[0]
        k = len(masks)
        order = torch.arange(rows, device=net_input["src_tokens"].device).repeat(k)
        out = self.encoder.reorder_encoder_out(states.out, order)
        groups: dict[int, list[int]] = {}
        for m, mask in enumerate(masks):
            layer = first_encoder_layer(mask)
            if layer is not None:
                groups.setdefault(layer, []).append(m)
        if not groups:
            return out
        x = out["encoder_out"][0].clone()
        for layer, members in groups.items():
            part = self._run_from(states, net_input, layer, [masks[m] for m in members])
            for j, m in enumerate(members):
                x[:, m * rows : (m + 1) * rows] = part[:, j * rows : (j + 1) * rows]
        out["encoder_out"] = [x]
        return out

    def _run_from(self, states: EncoderStates, net_input: dict, layer: int,
                  masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Encoder output (time-first, k*B columns) of masks whose first gated encoder layer is ``layer``."""
        k = len(masks)
        rows = net_input["src_tokens"].shape[0]
        enc = [[h for h in m if h.attention == "enc_self"] for m in masks]
        at_layer = [[h.head for h in m if h.layer == layer] for m in enc]
        later = [[h for h in m if h.layer > layer] for m in enc]
        site = self.sites[layer]
        attention = gated_projection(states.contexts[layer], site.out_proj, site.num_heads, at_layer, batch_dim=1,
                                     fill=self.gates.fill, site=site.key)
        replacements: dict[nn.Module, object] = {site.module: returning((attention, None))}
        if layer > 0:
            for j in range(layer - 1):
                replacements[self.layers[j]] = pass_through
            replacements[self.layers[layer - 1]] = returning(states.hidden[layer - 1].repeat(1, k, 1))
        stacked = {key: v.repeat(k, *([1] * (v.dim() - 1))) for key, v in net_input.items() if torch.is_tensor(v)}
        self.gates.clear()
        if any(later):
            self.gates.set_masks_per_example(later, rows_per_mask=rows)
        try:
            with replaced_forwards(replacements), unfused(self.gates):
                return self.encoder.forward_torchscript(stacked)["encoder_out"][0]
        finally:
            self.gates.clear()
