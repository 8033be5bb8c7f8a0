"""Where a transformers attention module keeps its heads: the one place that knows the layouts.

Site recognition (:mod:`.sites`), prefix reuse (:mod:`.reuse`) and physical pruning
(:mod:`.pruning`) all read a module through :func:`attention_layout`. Head counts and sizes
are read from the modules themselves, never from user input.

* ``bert``: BERT, RoBERTa, ELECTRA, MiniLM (``BertAttention`` and relatives): ``.self`` holds the
  heads (``query``, ``key``, ``value``, ``num_attention_heads``, ``attention_head_size``) and
  computes the per-head contexts; ``.output.dense`` is W_O, applied after it.
* ``distilbert``: ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin`` and ``n_heads`` on the module
  itself, whose forward already ends with W_O.
* ``llama``: decoder-only models (Llama, Mistral, Qwen, ...): ``q_proj``, ``k_proj``,
  ``v_proj``, ``o_proj``, ``head_dim``, head counts in ``config`` (grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

LAYOUTS = ("bert", "distilbert", "llama")


@dataclass(frozen=True)
class AttentionLayout:
    """The parts of one attention module.

    ``core`` is the submodule whose forward computes the per-head contexts (what prefix reuse
    replaces); ``core_projects`` says whether that forward already applies W_O (DistilBERT) or
    W_O runs after it (BERT).
    """

    name: str  # one of LAYOUTS
    module: nn.Module
    core: nn.Module
    core_projects: bool
    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    out_proj: nn.Linear
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


def _llama(module: nn.Module) -> AttentionLayout | None:
    out = getattr(module, "o_proj", None)
    config = getattr(module, "config", None)
    if not isinstance(out, nn.Linear) or config is None or not hasattr(module, "head_dim"):
        return None
    n = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or n)
    return AttentionLayout("llama", module, module, True, getattr(module, "q_proj", None),
                           getattr(module, "k_proj", None), getattr(module, "v_proj", None), out, n,
                           int(module.head_dim), kv)


def attention_layout(module: nn.Module) -> AttentionLayout | None:
    """The layout of ``module`` if it is a self-attention module of a known layout, else None."""
    for recognise in (_bert, _distilbert, _llama):
        found = recognise(module)
        if found is not None:
            return found
    return None
