"""Modules a pruned decoder attention becomes: key/value projections for uneven groups, and the attention of a
layer that lost every head. Shared by the hand-written layouts (:mod:`.pruning`) and the fused ones
(:mod:`.fused_pruning`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Attribute of a pruned attention module: for each kept query head, the position of its key/value head.
KV_INDEX_ATTR = "headsweep_kv_index"


class GroupedKVProjection(nn.Linear):
    """``k_proj`` / ``v_proj`` of a pruned layer whose key/value groups have different sizes.

    Its parameters are the kept key/value heads' rows only (``out_features`` = kept key/value heads x
    ``head_dim``, the state dict keys unchanged); its output repeats each key/value head once per kept query
    head reading it (``kv_index``), so the attention runs with one query head per key/value head.
    """

    def __init__(self, linear: nn.Linear, kv_index: tuple[int, ...], head_dim: int):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.weight = linear.weight
        self.bias = linear.bias
        self.head_dim = head_dim
        self.register_buffer("kv_index", torch.tensor(kv_index, dtype=torch.long, device=linear.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        heads = y.view(*y.shape[:-1], -1, self.head_dim).index_select(-2, self.kv_index)
        return heads.flatten(-2)


class EmptyAttention(nn.Module):
    """A decoder self-attention module that has lost every head: it adds the output projection's bias.

    The emptied projections stay as children (the state dict keeps its keys); with a cache, one zero key/value
    head per position is recorded (never read), so that the cache's sequence length stays right. ``adds_residual``:
    the attention's forward takes the residual stream as its second argument and returns it plus the projection
    (Bloom), so the emptied module returns the residual plus the bias.
    """

    def __init__(self, module: nn.Module, out_proj: nn.Module, head_dim: int, adds_residual: bool = False):
        super().__init__()
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, buffer in module.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        self.config = getattr(module, "config", None)
        self.layer_idx = getattr(module, "layer_idx", None)
        self.head_dim = head_dim
        # Still recognised as an attention layout with 0 heads (GPT-2's needs num_heads): the layers after it keep
        # their numbers in find_sites.
        self.num_heads = 0
        self.is_causal = True
        self.adds_residual = adds_residual
        self.out_proj_name = next(n for n, c in module.named_children() if c is out_proj)
        setattr(self, KV_INDEX_ATTR, ())

    def forward(self, hidden_states: torch.Tensor, *args, past_key_values=None, **kwargs) -> tuple[torch.Tensor, None]:
        if past_key_values is None:
            past_key_values = kwargs.get("layer_past")  # GPTBigCode's name for it
        if past_key_values is not None and self.layer_idx is not None:
            cache = getattr(past_key_values, "self_attention_cache", past_key_values)
            # One head, not zero: transformers 5 reports a layer whose cache holds no elements as length 0.
            kv = hidden_states.new_zeros(hidden_states.shape[0], 1, hidden_states.shape[1], self.head_dim)
            cache.update(kv, kv, self.layer_idx)
        # What the output projection makes of an empty input (Conv1D cannot take one): its bias, or zeros.
        out = hidden_states.new_zeros(hidden_states.shape)
        if self.adds_residual:
            out = args[0] if args else kwargs["residual"]
        bias = getattr(getattr(self, self.out_proj_name), "bias", None)
        return (out if bias is None else out + bias), None


def replace_module(model: nn.Module, module_name: str, new: nn.Module) -> None:
    """Put ``new`` where ``module_name`` sits in ``model``."""
    parent, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
