"""Where a transformers attention module keeps its heads: the one place that knows the layouts.

Site recognition (:mod:`.sites`) and both transformers families' prefix reuse and physical pruning
(``hf_classifier``, ``hf_causal_lm``: ``reuse.py``, ``pruning.py``) all read a module through
:func:`attention_layout`. Head counts and sizes
are read from the modules themselves, never from user input.

* ``bert``: BERT, RoBERTa, ELECTRA, MiniLM (``BertAttention`` and relatives): ``.self`` holds the
  heads (``query``, ``key``, ``value``, ``num_attention_heads``, ``attention_head_size``) and
  computes the per-head contexts; ``.output.dense`` is W_O, applied after it.
* ``distilbert``: ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin`` and ``n_heads`` on the module
  itself, whose forward already ends with W_O.
* ``llama``: decoder-only models (Llama, Mistral, Qwen2, Qwen3, Phi-3, ...): ``q_proj``,
  ``k_proj``, ``v_proj`` (or a fused ``qkv_proj``), ``o_proj``, ``head_dim``; query heads counted
  from ``o_proj``'s input, key/value heads from ``k_proj``'s output (grouped-query attention).
* ``gpt2``: GPT-2 and GPTBigCode: a fused ``c_attn`` and ``c_proj``, ``num_heads``, ``head_dim``
  (GPTBigCode: ``kv_heads``, 1 with multi-query attention). GPT-2's projections are ``Conv1D``
  layers whose weight is transposed against ``nn.Linear`` (``(in, out)``): head h is still input
  features ``h*d .. (h+1)*d-1`` of ``c_proj``, which is where the gates act.

Every other layout (GPT-NeoX, Bloom, Falcon, GPT-J, OPT, Phi, DeepSeek's latent attention, ModernBERT, ...) is a
row of data in :mod:`.site_table`, read by one recogniser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_shared.site_table import (
    HEAD_COUNT_ATTRS,
    KV_COUNT_ATTRS,
    SiteSpec,
    declared_count,
    spec_of,
)

if TYPE_CHECKING:
    from headsweep.workers.core.gates import AttentionSite

LAYOUTS = ("bert", "distilbert", "llama", "gpt2")


@dataclass(frozen=True)
class AttentionLayout:
    """The parts of one attention module.

    ``core`` is the submodule whose forward computes the per-head contexts (what prefix reuse
    replaces); ``core_projects`` says whether that forward already applies W_O (DistilBERT) or
    W_O runs after it (BERT).
    """

    name: str  # one of LAYOUTS, or a site_table row's layout
    module: nn.Module
    core: nn.Module
    core_projects: bool
    query: nn.Module  # a fused query/key/value projection (gpt2, Phi-3) stands in for all three
    key: nn.Module
    value: nn.Module
    out_proj: nn.Module  # nn.Linear, or transformers' Conv1D (GPT-2)
    num_heads: int
    head_dim: int
    num_kv_heads: int

    def set_num_heads(self, n: int) -> None:
        """Record that the module now has ``n`` heads, where its forward reads the count."""
        if self.name == "bert":
            self.core.num_attention_heads = n
            self.core.all_head_size = n * self.head_dim
        elif self.name == "distilbert":
            self.module.n_heads = n
        else:
            raise ValueError(f"{self.name} attention keeps its head count in the model config, not per module")

    def replace_core(self, model: nn.Module, module_name: str, new: nn.Module) -> None:
        """Put ``new`` where ``core`` sits in ``model`` (``module_name`` is the attention module's name)."""
        if self.core is not self.module:
            self.module.self = new  # BERT: the inner self-attention
            return
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def _bert(module: nn.Module) -> AttentionLayout | None:
    inner = getattr(module, "self", None)
    output = getattr(module, "output", None)
    if inner is None or output is None or not isinstance(getattr(output, "dense", None), nn.Linear):
        return None
    if not hasattr(inner, "num_attention_heads") or not hasattr(inner, "attention_head_size"):
        return None
    if getattr(module, "is_cross_attention", False):
        return None
    n = int(inner.num_attention_heads)
    return AttentionLayout("bert", module, inner, False, getattr(inner, "query", None), getattr(inner, "key", None),
                           getattr(inner, "value", None), output.dense, n, int(inner.attention_head_size), n)


def _distilbert(module: nn.Module) -> AttentionLayout | None:
    out = getattr(module, "out_lin", None)
    if not isinstance(out, nn.Linear) or not hasattr(module, "n_heads"):
        return None
    n = int(module.n_heads)
    # After physical pruning `dim` is still the model width, but out_lin takes only the kept heads.
    head_dim = out.in_features // n if n else 0
    return AttentionLayout("distilbert", module, module, True, getattr(module, "q_lin", None),
                           getattr(module, "k_lin", None), getattr(module, "v_lin", None), out, n, head_dim, n)


def projection_inputs(proj: nn.Module) -> int | None:
    """Input features of a projection: ``nn.Linear``'s ``in_features``, or a ``Conv1D``'s ``nx`` (its
    weight is ``(in, out)``); None for anything else."""
    if isinstance(proj, nn.Linear):
        return int(proj.in_features)
    weight = getattr(proj, "weight", None)
    if hasattr(proj, "nf") and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return None


def _llama(module: nn.Module) -> AttentionLayout | None:
    out = getattr(module, "o_proj", None)
    config = getattr(module, "config", None)
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(out, nn.Linear) or config is None or not isinstance(head_dim, int) or head_dim <= 0:
        return None
    if getattr(module, "is_cross_attention", False):
        return None
    # Counted from the modules (what physical pruning changes), not from the config.
    n = out.in_features // head_dim
    key = getattr(module, "k_proj", None)
    fused = getattr(module, "qkv_proj", None)
    if isinstance(key, nn.Linear):
        kv = key.out_features // head_dim
    else:
        kv = int(getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", n))
    query, value = getattr(module, "q_proj", None), getattr(module, "v_proj", None)
    return AttentionLayout("llama", module, module, True, fused if query is None else query,
                           fused if key is None else key, fused if value is None else value, out, n, head_dim, kv)


def _gpt2(module: nn.Module) -> AttentionLayout | None:
    out = getattr(module, "c_proj", None)
    fused = getattr(module, "c_attn", None)
    head_dim = getattr(module, "head_dim", None)
    if out is None or fused is None or not isinstance(head_dim, int) or head_dim <= 0:
        return None
    if getattr(module, "is_cross_attention", False) or not hasattr(module, "num_heads"):
        return None
    width = projection_inputs(out)
    if width is None:
        return None
    n = width // head_dim
    kv = int(getattr(module, "kv_heads", None) or n)
    return AttentionLayout("gpt2", module, module, True, fused, fused, fused, out, n, head_dim, kv)


def _described(module: nn.Module) -> AttentionLayout | None:
    """A module one of :data:`.site_table.SITE_SPECS` describes; a described module whose numbers do not fit its
    row is refused in one line (never guessed)."""
    spec = spec_of(module)
    if spec is None or spec.time_first:  # time-first modules (FSMT) are encoder-decoder sites, gated there
        return None
    if spec.cross_attention and getattr(module, spec.cross_attention, False):
        return None
    out = getattr(module, spec.out_proj, None)
    width = projection_inputs(out) if isinstance(out, nn.Module) else None
    head_dim = declared_count(module, spec.head_size)
    name = type(module).__name__
    if width is None or head_dim is None:
        what = f"no output projection {spec.out_proj!r}" if width is None else \
            f"no head size ({' / '.join(spec.head_size)})"
        raise HeadsweepError(f"{name} has {what}: it does not fit the {spec.layout} attention layout headsweep "
                             "describes, so its heads cannot be gated")
    n, rest = divmod(width, head_dim)
    stated = declared_count(module, HEAD_COUNT_ATTRS) or declared_count(getattr(module, "config", None),
                                                                         ("num_attention_heads",))
    pruned = getattr(module, "headsweep_kv_index", None) is not None
    if rest or (stated is not None and stated != n and not pruned):
        raise HeadsweepError(f"{name}: its {spec.out_proj} takes {width} features, not a whole number of its "
                             f"{stated or '?'} heads of {head_dim}: an attention layout headsweep does not know, "
                             "refused rather than guessed")
    kv = declared_count(module, KV_COUNT_ATTRS) or declared_count(getattr(module, "config", None), KV_COUNT_ATTRS)
    if kv is None or pruned:
        kv = n
    fused = getattr(module, spec.fused, None) if spec.fused else None
    parts = [fused if fused is not None else getattr(module, a, None) if a else None
             for a in (spec.query, spec.key, spec.value)]
    return AttentionLayout(spec.layout, module, module, True, parts[0], parts[1], parts[2], out, n, head_dim,
                           min(kv, n) if n else 0)


def _emptied(module: nn.Module) -> AttentionLayout | None:
    """An attention module physically pruned of every head (``hf_causal_lm``'s ``EmptyAttention``, which names its
    output projection): a layout with 0 heads, so that the layer is known and keeps its number."""
    name = getattr(module, "out_proj_name", None)
    out = getattr(module, name, None) if isinstance(name, str) else None
    if getattr(module, "headsweep_kv_index", None) != () or not isinstance(out, nn.Module):
        return None
    return AttentionLayout("empty", module, module, True, out, out, out, out, 0, int(module.head_dim), 0)


def attention_layout(module: nn.Module) -> AttentionLayout | None:
    """The layout of ``module`` if it is a self-attention module of a known layout, else None."""
    for recognise in (_bert, _distilbert, _llama, _gpt2, _described, _emptied):
        found = recognise(module)
        if found is not None:
            return found
    return None


def layout_spec(layout: AttentionLayout) -> SiteSpec | None:
    """The :data:`.site_table.SITE_SPECS` row of a described layout (None for the hand-written ones)."""
    return spec_of(layout.module) if layout.name not in LAYOUTS else None


def only_layouts(sites: Sequence[AttentionSite], names: set[str]) -> bool:
    """Whether there are sites and every one's module has a layout among ``names``.

    Both transformers families recognise the same modules, so a bare model's layouts say whose it is.
    """
    return bool(sites) and {getattr(attention_layout(s.module), "name", None) for s in sites} <= names
