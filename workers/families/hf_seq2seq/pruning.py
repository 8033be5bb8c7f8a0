"""Physical head pruning of transformers encoder-decoder models, the pruned folders they export, and which masks a
stock config can state.

Two layouts are pruned (rows of :mod:`headsweep.workers.families.hf_shared.site_table`):

* ``bart`` (BART, mBART, Marian, M2M100 / NLLB, Pegasus, ...): each attention module's ``q_proj``, ``k_proj`` and
  ``v_proj`` keep the kept heads' rows and ``out_proj`` their input columns; the forward splits heads with ``-1``,
  so ``num_heads`` is all it reads besides the weights.
* ``t5`` (T5, mT5, Switch Transformers): ``q``, ``k``, ``v`` and ``o`` likewise, ``n_heads`` / ``inner_dim`` set.
  T5's relative position bias is one embedding (a column per head) in the first layer of each stack, whose output
  the stack hands to every later layer of that stack; so a stack's layers may keep different heads only if the bias
  they share holds every head any of them keeps. The first layer's embedding keeps the columns of the heads some
  layer of its stack keeps (their union), in their old order, and every T5 attention module of a pruned model reads
  its own heads' columns of the shared bias (``headsweep_bias_index``). A mask that removes the same heads from
  every layer leaves exactly those heads' columns: the stock layout.

Each pruned module's class becomes a subclass of its own (``HeadsPruned<Class>``, same weights and state-dict
keys) whose forward is the stock one, except where a module has lost every head: it then adds only its output
projection's bias (T5: none), and a decoder self-attention still records one zero key/value head per position so
that the cache's length stays right (transformers 5 counts an empty layer as length 0).

FSMT (its attention reshapes the heads' output to the model's width) and UMT5 (a relative bias per layer, read
through another forward) are refused in one line: gate their heads without pruning.

The removed heads are recorded in ``config.pruned_heads`` keyed ``"<attention>:<layer>"`` (``enc_self:0``,
``enc_dec:1``, ``dec_self:1``; original numbers); :func:`load_pruned` rebuilds the stock architecture from
``config.json``, removes the same heads and loads the saved weights strictly.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite, group_by_site
from headsweep.workers.core.head_slicing import HeadSlice, keep_columns, keep_rows, plan_slice
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.hf_shared.pruning import PRUNED_HEADS_KEY, record_pruned
from headsweep.workers.families.hf_shared.pruning import load_pruned as load_transformers_pruned
from headsweep.workers.families.hf_shared.site_table import spec_of
from headsweep.workers.families.hf_shared.stock import TIED_HEAD_SIZE, check_stock_config

#: Attribute of a pruned T5 attention module: its heads' positions among the columns of its stack's shared bias.
BIAS_INDEX_ATTR = "headsweep_bias_index"
PRUNABLE_LAYOUTS = ("bart", "t5")


def prune_seq2seq_heads(model: nn.Module, heads: Iterable[Head]) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (``enc_self`` / ``enc_dec`` / ``dec_self``, original numbers) from a transformers
    encoder-decoder model in place, and record them in ``config.pruned_heads``; returns each pruned module's slice.
    Every module is checked and planned before the first one changes: a mask the model cannot take leaves it as it
    was."""
    from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error

    if getattr(getattr(model, "config", None), PRUNED_HEADS_KEY, None):
        raise HeadsweepError("this model was already pruned (config.pruned_heads is set): prune the original model")
    sites = seq2seq_sites_or_error(model)
    grouped = group_by_site(sites, list(heads))
    layout = _prunable_layout(model, sites)
    plans = {s.key: plan_slice(s.num_heads, s.head_dim, grouped.get(s.key, [])) for s in sites}
    bias_columns = _shared_bias_heads(sites, plans) if layout == "t5" else {}
    for site in sites:
        plan = plans[site.key]
        if plan.removed:
            _slice(site, plan, layout)
        if plan.removed or layout == "t5":  # every T5 module reads the shared bias by its own index
            _become_pruned(site.module)
        if layout == "t5":
            columns = bias_columns[site.attention]
            setattr(site.module, BIAS_INDEX_ATTR, torch.tensor([columns.index(h) for h in plan.kept],
                                                               dtype=torch.long))
            bias = getattr(site.module, "relative_attention_bias", None)
            if getattr(site.module, "has_relative_attention_bias", False) and isinstance(bias, nn.Embedding):
                _keep_embedding_columns(bias, columns)
    slices = {key: plan for key, plan in plans.items() if plan.removed}
    record_pruned(model, slices)
    return slices


def _prunable_layout(model: nn.Module, sites: Sequence[AttentionSite]) -> str:
    """The one layout of the model's attention modules if headsweep prunes it; a one-line refusal otherwise."""
    name = type(model).__name__
    specs = {getattr(spec_of(s.module), "layout", None) for s in sites}
    if len(specs) != 1 or not specs <= set(PRUNABLE_LAYOUTS):
        layout = next(iter(specs - set(PRUNABLE_LAYOUTS)), None)
        why = ("its attention reshapes the heads' output to the model's width, so it cannot run with fewer heads"
               if layout == "fsmt" else f"attention layout {layout!r} is not one headsweep prunes")
        raise HeadsweepError(f"{name}: physical pruning is not supported ({why}); gate its heads without pruning "
                             "(every experiment runs on the gates)")
    layout = specs.pop()
    if getattr(model.config, "use_prompt", False):
        raise HeadsweepError(f"{name}: physical pruning is not supported with prompts (config.use_prompt: its prompt "
                             "keys and values hold every head); gate its heads without pruning")
    for site in sites:
        module = site.module
        if layout == "t5" and not (all(hasattr(module, a) for a in ("n_heads", "inner_dim", "compute_bias"))
                                   and "position_bias" in inspect.signature(type(module).forward).parameters):
            raise HeadsweepError(f"{name}: physical pruning is not supported ({type(module).__name__} is not T5's "
                                 "attention with one relative bias per stack, handed from layer to layer); gate "
                                 "its heads without pruning")
        if getattr(module, "headsweep_pruned", False):
            raise HeadsweepError(f"{site.module_name} was already pruned: prune the original model")
    return layout


def _slice(site: AttentionSite, plan: HeadSlice, layout: str) -> None:
    module = site.module
    q, k, v, o = (("q_proj", "k_proj", "v_proj", "out_proj") if layout == "bart" else ("q", "k", "v", "o"))
    for part in (q, k, v):
        keep_rows(getattr(module, part), plan.query_rows)
    keep_columns(getattr(module, o), plan.query_rows)
    kept = len(plan.kept)
    if layout == "bart":
        module.num_heads = kept
        if isinstance(getattr(module, "embed_dim", None), int):  # MVP reshapes the heads' output to embed_dim
            module.embed_dim = kept * plan.head_dim
    else:
        module.n_heads = kept
        module.inner_dim = kept * plan.head_dim


def _shared_bias_heads(sites: Sequence[AttentionSite], plans: dict[SiteKey, HeadSlice]) -> dict[str, list[int]]:
    """For each shared bias (one per attention type: its stack's first layer computes it, the later layers read it),
    the original heads it keeps: every head a layer reading it keeps, ascending."""
    columns: dict[str, set[int]] = {}
    for site in sites:
        columns.setdefault(site.attention, set()).update(plans[site.key].kept)
    return {stack: sorted(heads) for stack, heads in columns.items()}


def _keep_embedding_columns(embedding: nn.Embedding, columns: list[int]) -> None:
    index = torch.tensor(columns, dtype=torch.long, device=embedding.weight.device)
    embedding.weight = nn.Parameter(embedding.weight.detach().index_select(1, index).clone().contiguous(),
                                    requires_grad=embedding.weight.requires_grad)
    embedding.embedding_dim = len(columns)


class _PrunedHeads:
    """Mixed into a pruned attention module's own class: the stock forward with fewer heads, a module without heads
    answered without attention, and (T5) its heads' columns taken from the stack's shared position bias."""

    headsweep_pruned = True

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if hasattr(self, BIAS_INDEX_ATTR):
            return self._t5_forward(hidden_states, *args, **kwargs)
        if self.num_heads == 0:
            return self._empty(hidden_states, kwargs.get("key_value_states"), kwargs.get("past_key_values")), None
        return super().forward(hidden_states, *args, **kwargs)

    def _t5_forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, past_key_values=None,
                    **kwargs):
        shared = position_bias if position_bias is not None else self._shared_bias(hidden_states, key_value_states,
                                                                                   past_key_values)
        if self.n_heads == 0:
            return self._empty(hidden_states, key_value_states, past_key_values), shared, None
        index = getattr(self, BIAS_INDEX_ATTR).to(shared.device)
        own = shared if shared.shape[1] == 1 else shared.index_select(1, index)
        out, _, weights = super().forward(hidden_states, mask, key_value_states, own, past_key_values, **kwargs)
        return out, shared, weights

    def _shared_bias(self, hidden_states, key_value_states, past_key_values) -> torch.Tensor:
        """What the stock first layer computes (T5's relative bias, over the columns its embedding kept), or a zero
        bias of one head that every layer's heads share (cross-attention, and stacks without a relative bias)."""
        query = hidden_states.shape[1]
        past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        past = past.clone() if isinstance(past, torch.Tensor) else past
        if key_value_states is not None or not self.has_relative_attention_bias:
            keys = key_value_states.shape[1] if key_value_states is not None else past + query
            return hidden_states.new_zeros(1, 1, query, keys)
        return self.compute_bias(query, past + query, device=hidden_states.device, past_seen_tokens=past)

    def _empty(self, hidden_states, key_value_states, past_key_values) -> torch.Tensor:
        """A module without heads: its output projection's bias (or zeros); a decoder self-attention with a cache
        records one zero key/value head per position (never read), so that the cache's length stays right."""
        if past_key_values is not None and key_value_states is None and self.layer_idx is not None:
            cache_ = getattr(past_key_values, "self_attention_cache", past_key_values)
            head_dim = getattr(self, "head_dim", None) or self.key_value_proj_dim
            kv = hidden_states.new_zeros(hidden_states.shape[0], 1, hidden_states.shape[1], head_dim)
            cache_.update(kv, kv, self.layer_idx)
        out_proj = getattr(self, "out_proj", None) or self.o
        out = hidden_states.new_zeros(*hidden_states.shape[:-1], out_proj.out_features)
        return out if out_proj.bias is None else out + out_proj.bias


@cache
def _pruned_class(cls: type) -> type:
    return type(f"HeadsPruned{cls.__name__}", (_PrunedHeads, cls), {"__module__": __name__})


def _become_pruned(module: nn.Module) -> None:
    if not isinstance(module, _PrunedHeads):
        module.__class__ = _pruned_class(type(module))


def stock_sizes(model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
    """The sizes a stock config of ``model`` without ``heads`` states, or a one-line refusal naming why there is
    none. T5-style configs state ``num_heads`` apart from ``d_kv``, one count for every attention module: a mask
    fits when every module keeps the same number of heads (at least one) and the layers of each self-attention
    stack keep the same heads (they share one relative position bias, a column per head). BART-style and FSMT
    configs derive the head size from ``d_model / heads``: refused. Checks only."""
    from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error

    name = type(model).__name__
    sites = seq2seq_sites_or_error(model)
    layouts = {getattr(spec_of(s.module), "layout", None) for s in sites}
    config = model.config
    if layouts != {"t5"} or not hasattr(config, "d_kv") or not hasattr(config, "num_heads"):
        raise HeadsweepError(TIED_HEAD_SIZE.format(name=name, how="d_model / attention heads"))
    if getattr(config, PRUNED_HEADS_KEY, None):
        raise HeadsweepError("this model was already pruned (config.pruned_heads is set): prune the original model")
    grouped = group_by_site(sites, list(heads))
    plans = {s.key: plan_slice(s.num_heads, s.head_dim, grouped.get(s.key, [])) for s in sites}
    counts = sorted({len(p.kept) for p in plans.values()})
    if counts == [0] or 0 in counts:
        raise HeadsweepError(f"the mask removes every head of an attention module: {name}'s config cannot state a "
                             "layer without attention; export without --stock (headsweep.load_pruned loads it)")
    if len(counts) > 1:
        raise HeadsweepError(f"the mask keeps {' or '.join(map(str, counts))} heads in different attention modules: "
                             f"{name}'s config states one num_heads for every module; remove the same number from "
                             "each, or export without --stock (headsweep.load_pruned loads it)")
    for attention in ("enc_self", "dec_self"):
        kept = {plans[s.key].kept for s in sites if s.attention == attention}
        if len(kept) > 1:
            raise HeadsweepError(f"the {attention} layers keep different heads: {name}'s layers of one stack share "
                                 "one relative position bias (a column per head), so a stock config needs the same "
                                 "heads kept in each; export without --stock (headsweep.load_pruned loads it)")
    sizes = {"num_heads": counts[0]}
    check_stock_config(model, sizes)
    return sizes


def load_pruned(model_dir: str | Path, attn_implementation: str | None = None, device: str = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """An encoder-decoder model exported by ``headsweep export`` (or any ``save_pretrained`` folder), in eval mode:
    the stock architecture with the heads of ``config.pruned_heads`` removed, the saved weights loaded strictly."""
    return load_transformers_pruned(model_dir, prune_seq2seq_heads, attn_implementation, device, dtype)
