"""Attention sites described as data: one row per attention layout that the hand-written recognisers of
:mod:`.layout` (BERT family, DistilBERT, Llama-style ``o_proj`` with ``head_dim``, GPT-2 ``c_proj``) do not cover.

A row names the attention module classes it describes (a regular expression matched against the class's name and
its base classes' names: transformers' modular classes inherit their attention), where the output projection is,
which module attribute holds the head size, and what a pruner must know (fused query/key/value layout, ALiBi slopes,
MLA's separate value head size, learned sinks). The head count is always the output projection's input width over
the head size, and must agree with the count the module states: a module whose numbers do not fit is refused,
never guessed.

Two more tables say why a model has no heads to gate: its layers are state-space or recurrent mixers
(:data:`NO_HEADS`), or it has attention modules of a kind headsweep does not gate (:data:`REFUSED_ATTENTION`: linear
attention, whose output is normalised across heads before its projection). A module the model runs at several
depths (ALBERT) is described here like any other; :mod:`.shared_layers` makes one site per application.

Each row is proved by ``python -m bench.coverage``: every head's gate equals zeroing that head's input columns of
the output projection, on a tiny model built from the architecture's own config class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from torch import nn

#: Module attributes that state a head count (checked against the count the projection's width implies).
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
#: Module attributes that state a key/value head count.
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "kv_heads")


@dataclass(frozen=True)
class SiteSpec:
    """One attention layout, as data.

    ``fused`` names the fused query/key/value projection and ``fused_layout`` how its output rows are ordered:
    ``per_head`` (GPT-NeoX, Bloom: each head's query, key and value rows together), ``grouped`` (Falcon's new
    decoder architecture: each key/value group's queries, then its key and value), ``stacked`` (all queries, all
    keys, all values: ModernBERT's ``Wqkv``, Phi-3's ``qkv_proj``). ``features`` lists what else a pruner would have
    to slice or keep (``alibi``: slopes per head; ``mla``: heads of ``v_head_dim`` over a shared latent;
    ``sinks``: a learned logit per head).
    """

    layout: str
    classes: str
    out_proj: str
    head_size: tuple[str, ...]
    query: str | None = "q_proj"
    key: str | None = "k_proj"
    value: str | None = "v_proj"
    fused: str | None = None
    fused_layout: str | None = None
    features: tuple[str, ...] = ()
    cross_attention: str | None = None  # module attribute that is true on cross-attention modules
    example: str = ""  # a model type with this layout (docs and the coverage table)
    # The classes' Python module starts with this (a class name as bare as FSMT's ``Attention`` is no layout alone).
    package: str = "transformers."
    # The output projection's input is (time, batch, features), as fairseq's attention runs (FSMT): gated with the
    # batch on axis 1.
    time_first: bool = False

    def matches(self, module: nn.Module) -> bool:
        return any(_pattern(self.classes).fullmatch(c.__name__) and c.__module__.startswith(self.package)
                   for c in type(module).__mro__[:-1])


@cache
def _pattern(text: str) -> re.Pattern:
    return re.compile(text)


SITE_SPECS: tuple[SiteSpec, ...] = (
    SiteSpec("gpt_neox", r"GPTNeoX(Japanese)?Attention", "dense", ("head_size",), None, None, None,
             fused="query_key_value", fused_layout="per_head", example="gpt_neox (Pythia)"),
    SiteSpec("bloom", r"BloomAttention", "dense", ("head_dim",), None, None, None, fused="query_key_value",
             fused_layout="per_head", features=("alibi",), example="bloom"),
    SiteSpec("falcon", r"FalconAttention", "dense", ("head_dim",), None, None, None, fused="query_key_value",
             fused_layout="grouped", example="falcon"),
    SiteSpec("gptj", r"(GPTJ|CodeGen)Attention", "out_proj", ("head_dim",), example="gptj, codegen"),
    SiteSpec("opt", r"(OPT|BioGpt|XGLM|GPTNeoSelf|Mpt|Dbrx|Lfm2(Moe)?)Attention", "out_proj", ("head_dim",),
             cross_attention="is_cross_attention", example="opt, biogpt, xglm, gpt_neo"),
    SiteSpec("phi", r"(Phi|Persimmon)Attention", "dense", ("head_dim",), example="phi, persimmon"),
    SiteSpec("mla", r"(DeepseekV[23]|DeepseekV32|LongcatFlash|KimiLinear|Glm4MoeLite|GlmMoeDsa|Axk[12])\w*"
             r"Attention", "o_proj", ("v_head_dim",),
             query=None, key=None, value=None, features=("mla",), example="deepseek_v3"),
    SiteSpec("modernbert", r"ModernBert(Decoder)?Attention", "Wo", ("head_dim",), None, None, None, fused="Wqkv",
             fused_layout="stacked", example="modernbert"),
    SiteSpec("bart", r"(Bart|MBart|Marian|M2M100|NllbMoe|Pegasus|PLBart|Blenderbot(Small)?|Mvp|BigBirdPegasus"
             r"Decoder)Attention", "out_proj", ("head_dim",),
             cross_attention="is_cross_attention", example="bart, marian, m2m_100"),
    SiteSpec("t5", r"(T5|MT5|UMT5|SwitchTransformers)Attention", "o", ("key_value_proj_dim",), "q", "k", "v",
             example="t5, mt5, umt5"),
    # T5Gemma: Gemma's attention (grouped key/value heads, softcapped logits) in an encoder-decoder; the decoder's
    # cross-attention is its own class (``cross_attn``).
    SiteSpec("t5gemma", r"T5Gemma(Self|Cross)Attention", "o_proj", ("head_dim",), example="t5gemma"),
    # One module applied at several depths: a site per application (hf_shared/shared_layers.py numbers them).
    SiteSpec("albert", r"AlbertAttention", "dense", ("attention_head_size",), "query", "key", "value",
             example="albert"),
    # PegasusX's encoder attends to local blocks and global tokens and runs out_proj once on each (both batch-first,
    # heads concatenated): a gate at its input gates both.
    SiteSpec("pegasus_x", r"PegasusX(GlobalLocal)?Attention", "out_proj", ("head_dim",), example="pegasus_x"),
    SiteSpec("fsmt", r"Attention", "out_proj", ("head_dim",), package="transformers.models.fsmt.",
             time_first=True, example="fsmt (fairseq's WMT19 models)"),
)

#: Layers that mix tokens without attention heads, by class name: an architecture of only these is refused.
NO_HEADS: tuple[tuple[str, str], ...] = (
    (r"\w*Mamba2?\w*Mixer|\w*MambaLayer|\w*Mamba2?Block|(Bamba|NemotronH|GraniteMoeHybrid|FalconH1|Zamba2?)\w*Mixer",
     "state-space (Mamba) layers"),
    (r"Rwkv\w*(Attention|Feedforward|Block)", "recurrent (RWKV) layers"),
    (r"xLSTM\w*", "recurrent (xLSTM) layers"),
    (r"\w*(GatedDeltaNet|ShortConv|LinearAttention|Lightning\w*Attention)\w*", "linear-attention or convolution "
     "layers"),
)

#: Attention modules headsweep does not gate, and why (checked before :data:`SITE_SPECS`).
REFUSED_ATTENTION: tuple[tuple[str, str], ...] = (
    (r"\w*(Lightning|Linear)\w*Attention", "linear attention, whose heads are normalised together before the output "
     "projection"),
)


def spec_of(module: nn.Module) -> SiteSpec | None:
    """The row describing ``module``, or None."""
    for spec in SITE_SPECS:
        if spec.matches(module):
            return spec
    return None


def refused_attention(module: nn.Module) -> str | None:
    """Why ``module`` is an attention module headsweep does not gate, or None."""
    names = [c.__name__ for c in type(module).__mro__[:-1]]
    for pattern, why in REFUSED_ATTENTION:
        if any(_pattern(pattern).fullmatch(n) for n in names):
            return why
    return None


def mixer_kind(module: nn.Module) -> str | None:
    """What kind of head-less token mixer ``module`` is (state-space, recurrent, ...), or None."""
    name = type(module).__name__
    for pattern, kind in NO_HEADS:
        if _pattern(pattern).fullmatch(name):
            return kind
    return None


def declared_count(module: nn.Module, attrs: tuple[str, ...]) -> int | None:
    """The first positive integer among ``module``'s ``attrs``, else None."""
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
