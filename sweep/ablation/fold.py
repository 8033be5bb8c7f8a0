"""Physical removal under mean and optimal ablation: ``W_O[:, h] @ c_h`` folded into the bias.

Head ``h`` contributes ``W_O[:, h] z_h`` to its output projection ``y = W_O z + b``. Mean and optimal ablation put a
constant ``c_h`` in place of ``z_h``, so the ablated model is the model with the head's input columns of ``W_O``
removed and ``b + W_O[:, h] c_h`` as the bias: removing the head's weights after the fold gives exactly the ablated
model, with no hook. ``headsweep export`` folds the constants of the run the mask comes from (``--from-run``; the
values it stored in ``ablation_values``), summed in float64 and rounded once to the bias's dtype.

What cannot be folded is refused in one line: a projection without a bias (Llama's and Qwen2's ``o_proj`` in
transformers), a per-position mean or ``keep_first`` (a bias is the same at every position), resample and patch
(each example's fill is another input's activations), and a mean or optimal export with no run to take the
constants from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.ablation.registry import DEFAULT_METHOD, ablation_method, folding_methods
from headsweep.workers.core.heads import Head, SiteKey


def run_method(store: ResultStore | None, from_run: str | None, cfg: Config) -> tuple[str, dict]:
    """The ablation the exported mask was found under (the run's, else the config's) and the run's config."""
    if from_run and store is not None:
        rows = store.read("runs", from_run, columns=["config", "ablation"]).to_pylist()
        if rows:
            stored = json.loads(rows[-1]["config"])
            return rows[-1]["ablation"] or DEFAULT_METHOD, stored
    return cfg.sweep.ablation, json.loads(cfg.to_json())


def constants_to_fold(cfg: Config, store: ResultStore | None, from_run: str | None, checkpoint: str | None
                      ) -> tuple[str, dict[str, np.ndarray]]:
    """The method and, for mean and optimal, the constants (``attention:layer`` -> ``(H, d)``) the export folds;
    empty for zero ablation. Refuses what no change of weights reproduces (module docstring)."""
    from headsweep.sweep.ablation.values import stored_values

    method, stored_cfg = run_method(store, from_run, cfg)
    declared = ablation_method(method)
    if declared.fold == "nothing":
        return method, {}
    source = f"run {from_run}" if from_run else "this config"
    if declared.fold == "refused":
        raise HeadsweepError(f"{source} ablates heads with sweep.ablation {method} ({declared.fold_refusal}), which no "
                             f"change of weights reproduces: export a mask found under {folding_methods()} ablation")
    if not from_run or store is None:
        raise HeadsweepError(f"export under sweep.ablation {method} folds the constants a run stored into the output "
                             "projections' biases: name that run with --from-run (and --level or --eval-id)")
    section = stored_cfg.get("ablation") or {}
    if section.get("positions", "all") != "all" or section.get("keep_first"):
        raise HeadsweepError(f"run {from_run} used {method} ablation per position or with keep_first, which a bias "
                             "(the same at every position) cannot reproduce: export a mask of a run with "
                             "ablation.positions: all and without keep_first")
    values = stored_values(store, from_run, checkpoint)
    if not values:
        raise HeadsweepError(f"run {from_run} stored no {method}-ablation values for this model"
                             + (f" (checkpoint {checkpoint})" if checkpoint else "") + ": it never started "
                             "evaluating; resume it, or export a mask of another run")
    return method, values


def fold(sites: Sequence[Any], heads: Sequence[Head], values: dict[str, np.ndarray], method: str,
         model_name: str) -> None:
    """Add ``W_O[:, h] @ c_h`` to the bias of each removed head's output projection (before the head is pruned)."""
    import torch
    from torch import nn

    by_key: dict[SiteKey, Any] = {s.key: s for s in sites}
    for key in dict.fromkeys(h.site for h in heads):
        projection = by_key[key].out_proj
        if projection.bias is None:
            raise HeadsweepError(f"{model_name}: the output projection of {by_key[key].module_name} has no bias (as "
                                 f"Llama's and Qwen2's o_proj), so {method} ablation's constants cannot be folded "
                                 "into it: export under zero ablation (a zero or --mask run), or keep the heads gated")
        if not isinstance(projection, nn.Linear) and type(projection).__name__ != "Conv1D":
            raise HeadsweepError(f"{model_name}: the output projection of {by_key[key].module_name} is a "
                                 f"{type(projection).__name__}, whose "
                                 f"weight layout export does not know: {method} ablation cannot be folded")
    with torch.no_grad():
        for key in dict.fromkeys(h.site for h in heads):
            site = by_key[key]
            projection = site.out_proj
            constants = torch.from_numpy(np.asarray(values[f"{key[0]}:{key[1]}"], dtype=np.float64))
            bias = projection.bias.double()
            for head in (h for h in heads if h.site == key):
                span = slice(head.head * site.head_dim, (head.head + 1) * site.head_dim)
                weight = projection.weight.double()
                # nn.Linear keeps W_O as (out, in); GPT-2's Conv1D as (in, out)
                bias = bias + (weight[:, span] @ constants[head.head] if isinstance(projection, nn.Linear)
                               else constants[head.head] @ weight[span, :])
            projection.bias.copy_(bias.to(projection.bias.dtype))
