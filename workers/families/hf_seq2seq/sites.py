"""Attention sites of a transformers encoder-decoder model: ``enc_self``, ``enc_dec`` and ``dec_self`` heads.

The attention modules are the rows of :mod:`headsweep.workers.families.hf_shared.site_table` (``bart``: BART, mBART,
Marian, M2M100 / NLLB, Pegasus, ...; ``t5``: T5, mT5, UMT5; ``t5gemma``; ``fsmt``: fairseq's WMT19 models); the gate
sits at the input of each module's output projection (``out_proj``, T5's ``o``, T5Gemma's ``o_proj``), split into
heads of the size the module states. FSMT's attention runs time-first as fairseq's own does (the projection's input
is (time, batch, features)): its sites carry ``batch_dim=1``, so per-example gate rows land on the batch axis as in
``fairseq_translation``.

Which of the three attention types a module is comes from where it sits: under the ``encoder`` or the ``decoder``
stack, and, in the decoder, whether it attends to the encoder (``encoder_attn``, T5's ``EncDecAttention``). Its
layer is the first number after the stack's name (``model.decoder.layers.3.encoder_attn``,
``decoder.block.3.layer.1.EncDecAttention``: 3), as the ``fairseq_translation`` family numbers its layers.
An attention module no row describes is refused, never guessed.
"""

from __future__ import annotations

import re

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.families.hf_shared.layout import projection_inputs
from headsweep.workers.families.hf_shared.site_table import HEAD_COUNT_ATTRS, declared_count, refused_attention, spec_of
from headsweep.workers.families.hf_shared.sites import ATTENTION_CLASS

SUPPORTED = ("transformers encoder-decoder models with BART-style (BART, mBART, Marian, M2M100 / NLLB, Pegasus), "
             "T5-style (T5, mT5, UMT5), T5Gemma or FSMT (fairseq WMT19) attention")
# Module names of cross-attention (decoder to encoder) in the layouts the site table describes.
CROSS_NAMES = ("encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention")
NUMBER = re.compile(r"\d+")


def _place(name: str) -> tuple[str, int] | None:
    """``(stack, layer)`` of a module's dotted name: the first ``encoder`` / ``decoder`` part and the first number
    after it; None outside both stacks."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in ("encoder", "decoder"):
            number = next((int(p) for p in parts[i + 1:] if NUMBER.fullmatch(p)), None)
            return (part, number) if number is not None else None
    return None


def attention_type(name: str, module: nn.Module, stack: str) -> str:
    """``enc_self``, ``enc_dec`` or ``dec_self`` for an attention module named ``name`` in ``stack``."""
    if stack == "encoder":
        return "enc_self"
    cross = name.rsplit(".", 1)[-1] in CROSS_NAMES or bool(getattr(module, "is_cross_attention", False))
    return "enc_dec" if cross else "dec_self"


def _site(name: str, module: nn.Module) -> AttentionSite | None:
    spec = spec_of(module)
    place = _place(name)
    if spec is None or place is None:
        return None
    out = getattr(module, spec.out_proj, None)
    width = projection_inputs(out) if isinstance(out, nn.Module) else None
    head_dim = declared_count(module, spec.head_size)
    stated = declared_count(module, HEAD_COUNT_ATTRS)
    if not isinstance(out, nn.Linear) or width is None or head_dim is None or width % head_dim or (
            stated is not None and stated * head_dim != width):
        raise HeadsweepError(f"{name} ({type(module).__name__}) does not fit the {spec.layout} attention layout "
                             f"headsweep describes (output projection {spec.out_proj!r} of {width} inputs, head size "
                             f"{head_dim}, {stated} heads): refused rather than gated by a guess")
    stack, layer = place
    return AttentionSite(attention=attention_type(name, module, stack), layer=layer, num_heads=width // head_dim,
                         head_dim=head_dim, out_proj=out, module=module, module_name=name,
                         batch_dim=1 if spec.time_first else 0)


def _described_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module the site table describes, in model order, with those physically pruned of every head
    (0 heads: nothing to gate, but a known module)."""
    sites: list[AttentionSite] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{s.module_name}.") for s in sites):
            continue
        site = _site(name, module)
        if site is not None:
            sites.append(site)
    return sites


def find_seq2seq_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of an encoder-decoder model the site table describes and that has heads, in model
    order (empty if none)."""
    return [s for s in _described_sites(model) if s.num_heads]


def seq2seq_sites_or_error(model: nn.Module) -> list[AttentionSite]:
    """:func:`find_seq2seq_sites`, refusing in one line a model with attention modules no layout describes, two
    modules claiming the same head names, or no sites at all."""
    arch = type(model).__name__
    described = _described_sites(model)
    sites = [s for s in described if s.num_heads]
    claimed = [s.module_name for s in described]
    for name, module in model.named_modules():
        if not name or any(name == c or name.startswith(f"{c}.") or c.startswith(f"{name}.") for c in claimed):
            continue
        why = refused_attention(module)
        if why is None and ATTENTION_CLASS.fullmatch(type(module).__name__) and any(
                isinstance(m, nn.Linear) for m in module.children()):
            why = "an attention layout headsweep has no description of"
        if why:
            raise HeadsweepError(f"{arch} has attention modules {type(module).__name__} at {name} ({why}): refused "
                                 f"rather than gated by a guess; model.kind hf_seq2seq takes {SUPPORTED}")
    keys = [s.key for s in sites]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise HeadsweepError(f"{arch} has more than one {twice[0]} attention module in layer {twice[1]}: model.kind "
                             "hf_seq2seq gates one module per attention type and layer")
    if not any(s.attention == "enc_dec" for s in sites) or not any(s.attention == "enc_self" for s in sites):
        raise HeadsweepError(f"no encoder-decoder attention recognised in {arch} (model.kind hf_seq2seq takes "
                             f"{SUPPORTED})")
    return sites
