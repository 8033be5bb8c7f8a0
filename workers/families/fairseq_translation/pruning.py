"""Physical head pruning for fairseq encoder-decoder Transformers, and pruned checkpoints.

fairseq's ``MultiheadAttention`` already runs with fewer heads than its input size allows,
once ``skip_embed_dim_check`` is set (fairseq's own ``_adaptive_prune_heads`` relies on it):
that flag keeps the module off ``F.multi_head_attention_forward``, whose shape checks need
``num_heads * head_dim == embed_dim``, and its own path sizes every view by ``num_heads``,
``head_dim`` and ``embed_dim`` (which becomes ``num_heads * head_dim``, the width of the
context). Incremental decoding caches keys and values as ``(batch, num_heads, time,
head_dim)``, so the cache shrinks with the heads. A module that loses every head becomes a
:class:`HeadlessMultiheadAttention`, which returns the output projection's bias without
computing attention (fairseq's own views cannot be sized from an empty tensor).

A pruned checkpoint is fairseq's checkpoint dict with the pruned weights and the removed
heads under ``headsweep_pruned_heads`` (names like ``enc_dec:1:2``, original numbers);
:func:`pruned_task` lets fairseq's own loader rebuild it
(``headsweep.workers.families.fairseq_translation.checkpoint``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from fairseq.modules.multihead_attention import MultiheadAttention
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import group_by_site
from headsweep.workers.core.head_slicing import HeadSlice, keep_columns, keep_rows, plan_slice
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.fairseq_translation.sites import find_fairseq_sites

PRUNED_KEY = "headsweep_pruned_heads"


class HeadlessMultiheadAttention(MultiheadAttention):
    """A fairseq attention module with every head removed: its output is the output projection's bias."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        tgt_len, bsz, _ = query.size()
        # An empty context through out_proj: its bias (or zeros without one) at every position.
        return self.out_proj(query.new_zeros(tgt_len, bsz, 0)), None


def prune_fairseq_heads(model: nn.Module, heads: Iterable[Head]) -> dict[SiteKey, HeadSlice]:
    """Remove ``heads`` (``enc_self``, ``enc_dec``, ``dec_self``) from a fairseq model, in place."""
    sites = find_fairseq_sites(model)
    for site in sites:
        if site.num_heads * site.head_dim != site.out_proj.out_features:
            # Its heads are renumbered: a mask in the original numbers would remove the wrong ones.
            raise HeadsweepError(f"{site.module_name} was already pruned: prune the original model")
    grouped = group_by_site(sites, heads)
    slices: dict[SiteKey, HeadSlice] = {}
    for site in sites:
        if grouped.get(site.key):
            plan = plan_slice(site.num_heads, site.head_dim, grouped[site.key])
            _apply(site.module, plan)
            slices[site.key] = plan
    return slices


def _apply(module: MultiheadAttention, plan: HeadSlice) -> None:
    rows = plan.query_rows
    for proj in (module.q_proj, module.k_proj, module.v_proj):
        keep_rows(proj, rows)
    keep_columns(module.out_proj, rows)
    for name in ("bias_k", "bias_v"):
        bias = getattr(module, name)
        if bias is not None:
            setattr(module, name, nn.Parameter(bias.detach()[..., rows.to(bias.device)].clone()))
    module.num_heads = len(plan.kept)
    module.embed_dim = len(plan.kept) * plan.head_dim
    module.skip_embed_dim_check = True
    if not plan.kept:
        module.__class__ = HeadlessMultiheadAttention


def save_pruned_checkpoint(state: dict, model: nn.Module, removed: Sequence[Head], path: str | Path) -> Path:
    """Write ``state`` (a checkpoint dict as read from disk) with ``model``'s pruned weights.

    The optimizer state is dropped (its shapes are those of the full model); the options stay
    as they were, so the file loads with ``weights_only=True`` whenever the original did.
    """
    from fairseq import checkpoint_utils

    out = {k: v for k, v in state.items() if k != "last_optimizer_state"}
    out["model"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out[PRUNED_KEY] = [str(h) for h in removed]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint_utils.torch_persistent_save(out, str(path))
    return path


def copy_dictionaries(data_bin: str | Path, languages: Sequence[str], out_dir: str | Path) -> None:
    """Copy the model's ``dict.<lang>.txt`` files next to an exported checkpoint."""
    for lang in languages:
        shutil.copyfile(Path(data_bin) / f"dict.{lang}.txt", Path(out_dir) / f"dict.{lang}.txt")


def pruned_task(state: dict):
    """For a pruned checkpoint, a fairseq task whose ``build_model`` removes the recorded heads; else None.

    Passed as ``task`` to ``checkpoint_utils.load_model_ensemble_and_task``, it lets fairseq's
    own loader build the model, prune it to the saved shapes and load the weights strictly.
    """
    names = state.get(PRUNED_KEY)
    if not names:
        return None
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    heads = [Head.parse(name) for name in names]
    cfg = state["cfg"] if state.get("cfg") is not None else convert_namespace_to_omegaconf(state["args"])
    task = tasks.setup_task(cfg.task, from_checkpoint=True)
    build = task.build_model

    def build_pruned(model_cfg, from_checkpoint: bool = False):
        model = build(model_cfg, from_checkpoint=from_checkpoint)
        prune_fairseq_heads(model, heads)
        return model

    task.build_model = build_pruned
    return task

