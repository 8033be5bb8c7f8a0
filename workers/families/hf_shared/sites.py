"""Find the attention modules of a transformers model and their output projections.

The layouts recognised are described once, in :mod:`headsweep.workers.families.hf_shared.layout` (hand-written:
BERT family, DistilBERT, Llama-style decoders, GPT-2 and GPTBigCode) and as data in
:mod:`headsweep.workers.families.hf_shared.site_table` (GPT-NeoX, Bloom, Falcon, GPT-J, OPT, ...).

A site's layer is its place in the model's layer stack (the first number in its module name:
``model.layers.3.self_attn`` is layer 3; for ALBERT, whose one layer module runs at every depth, the application's
place in the order the model runs them: :mod:`.shared_layers`), so a hybrid model's attention layers keep their
numbers and the layers between them (state-space, recurrent) have no heads. :func:`check_sites` refuses, in one
line, a model with no heads to gate (naming the kind of layers it has instead) and one with attention modules no
layout describes: those are never guessed.
"""

from __future__ import annotations

import re

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.families.hf_shared.layout import attention_layout, projection_inputs
from headsweep.workers.families.hf_shared.shared_layers import application_sites
from headsweep.workers.families.hf_shared.site_table import mixer_kind, refused_attention

# Class names of modules that attend and would hold heads: one of these outside every site is an unknown layout.
ATTENTION_CLASS = re.compile(r"\w*(Attention|Attn)")
LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class TransformersSite(AttentionSite):
    """An attention site whose output projection may be transformers' ``Conv1D`` (GPT-2) as well as
    ``nn.Linear``: the gate acts on the projection's input either way, only the width is read otherwise."""

    def check_projection(self) -> None:
        width = projection_inputs(self.out_proj)
        if width != self.num_heads * self.head_dim:
            raise HeadsweepError(
                f"{self.module_name}: output projection takes {width} features, "
                f"not num_heads x head_dim = {self.num_heads} x {self.head_dim}"
            )


def layer_number(module_name: str) -> int | None:
    """The first number in a module's dotted name: its index in the layer stack (None: no number)."""
    found = LAYER_NUMBER.search(module_name)
    return int(found.group(1)) if found else None


def find_sites(model: nn.Module) -> list[AttentionSite]:
    """Every self-attention module of an encoder-only or decoder-only transformers model.

    Layers are numbered by the module's place in the layer stack (see the module docstring); a model whose attention
    modules carry no number is numbered in module order; a model that runs a layer module at several depths
    (ALBERT) by application, in the order it runs them (:mod:`.shared_layers`).
    """
    applied, sites = application_sites(model)
    inside: list[str] = list(applied)  # names of recognised modules: their submodules are parts of them
    count = 0
    for name, module in model.named_modules():
        if name in applied or any(name.startswith(f"{outer}.") for outer in inside):
            continue
        found = attention_layout(module)
        if found is None:
            continue
        inside.append(name)
        count += 1
        number = layer_number(name)
        if found.num_heads == 0:  # every head of this layer was physically removed: nothing to gate
            continue
        site_class = AttentionSite if isinstance(found.out_proj, nn.Linear) else TransformersSite
        sites.append(
            site_class(
                attention="self",
                layer=count - 1 if number is None else number,
                num_heads=found.num_heads,
                head_dim=found.head_dim,
                out_proj=found.out_proj,
                module=module,
                module_name=name,
                batch_dim=0,
            )
        )
    return sites


def check_sites(model: nn.Module, sites: list[AttentionSite], family: str, supported: str) -> None:
    """Refuse in one line a model whose heads headsweep cannot all gate: one with attention modules that no layout
    describes (or that it does not gate: linear attention), one whose modules give two sites the same layer, and one
    with no sites (naming the head-less layers it has: state-space, recurrent). ``supported`` says what
    ``model.kind family`` takes."""
    arch = type(model).__name__
    claimed = [s.module_name for s in sites]
    unknown: dict[str, str] = {}
    mixers: set[str] = set()
    for name, module in model.named_modules():
        if not name or any(name == c or name.startswith(f"{c}.") or c.startswith(f"{name}.") for c in claimed):
            continue
        if attention_layout(module) is not None:  # a known layout without heads left (pruned away): no site
            claimed.append(name)
            continue
        kind = mixer_kind(module)
        if kind:
            mixers.add(kind)
            continue
        why = refused_attention(module)
        if why:
            unknown.setdefault(type(module).__name__, why)
        elif ATTENTION_CLASS.fullmatch(type(module).__name__) and any(
                isinstance(m, nn.Linear) or projection_inputs(m) for m in module.children()):
            unknown.setdefault(type(module).__name__, "an attention layout headsweep has no description of")
    if unknown:
        cls, why = next(iter(unknown.items()))
        raise HeadsweepError(f"{arch} has attention modules {cls} ({why}): refused rather than gated by a guess; "
                             f"model.kind {family} takes {supported}")
    layers = [s.layer for s in sites]
    if len(set(layers)) != len(layers):
        twice = sorted({n for n in layers if layers.count(n) > 1})
        raise HeadsweepError(f"{arch} has more than one attention module in layer {twice[0]}: model.kind {family} "
                             "gates one self-attention module per layer")
    if not sites:
        what = (f": its layers are {' and '.join(sorted(mixers))}, without attention heads" if mixers else "")
        raise HeadsweepError(f"no attention modules recognised in {arch}{what} (model.kind {family} takes "
                             f"{supported})")


def headless_layers(model: nn.Module, sites: list[AttentionSite]) -> list[int]:
    """Layers of a hybrid model's stack without an attention site (state-space or recurrent layers), counted up to
    the config's ``num_hidden_layers`` (else to the last site)."""
    have = {s.layer for s in sites}
    total = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(total, int):
        total = max(have, default=-1) + 1
    return [n for n in range(total) if n not in have]
