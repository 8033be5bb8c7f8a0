"""What a stock-exported model buys where it is served: prefill and decoding speed, and key/value-cache bytes.

The stock model is what ``headsweep export`` writes for a uniform mask of a Llama-style LM: a copy of the model
with the mask's heads removed, saved with the pruned ``num_attention_heads``, ``num_key_value_heads`` and
``head_dim`` in ``config.json``, and loaded back by ``AutoModelForCausalLM.from_pretrained`` (no headsweep code in
its forward). It is timed against the full model, also as ``from_pretrained`` gives it, interleaved
(:func:`~headsweep.workers.analyses.efficiency.time_side_by_side`), prefill from the fastest of the timed repeats (on a
shared machine other processes only slow a run down):

* **prefill**: one forward pass over ``batch x prompt`` tokens with the cache on and the logits of the last
  position only (``logits_to_keep=1``, as ``generate`` runs its first step); tokens/s = batch x prompt / seconds;
* **decode**: greedy ``generate`` of exactly ``new_tokens`` tokens after the prompt (``min_new_tokens`` =
  ``max_new_tokens``, the dynamic cache), and of one token (its prefill and first token), back to back in each
  round; decode tokens/s = batch x (new_tokens - 1) / (the median over the rounds of the difference of the two),
  the steps that read the cache;
* **KV-cache bytes per token**: ``2 x layers x num_key_value_heads x head_dim x`` the dtype's bytes, what each
  cached position holds.

The prediction both are judged against (:func:`predicted_speedups`) counts work from the configs: prefill is
compute-bound, so its cost is FLOPs (2 per multiply-add): the matrix products of every layer for each prompt token
(``2 x`` the layer's projection and feed-forward weights), attention scores and values (``2 n d T (T + 1)`` per
sequence of ``T`` tokens and layer, ``n`` query heads of size ``d``), the LM head for the last position.
Decoding one token at a small batch is bound by memory traffic: every matrix weight is read once per step (the LM
head's included; the embedding table is a lookup), and the key/value cache of the sequence so far (``T`` positions
of the bytes per token, ``T`` the mean context over the generated tokens) once per sequence. The removed share of
attention weights, FLOPs and cache bytes therefore predicts ``cost(full) / cost(stock)``.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.workers.analyses.efficiency import time_side_by_side
from headsweep.workers.core.family import Workload
from headsweep.workers.core.heads import Head


@dataclass(frozen=True)
class ServingShape:
    """The sizes the prediction needs: the config's, the head counts from the first layer's projections (a model
    pruned by headsweep keeps the full model's config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mlp_matrices: int = 3  # gate, up, down (Llama, Mistral, Qwen)

    @classmethod
    def of(cls, model: nn.Module) -> ServingShape:
        config: Any = model.config
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn"))
        return cls(config.num_hidden_layers, config.hidden_size, attention.q_proj.out_features // d,
                   attention.k_proj.out_features // d, d, config.intermediate_size, config.vocab_size)

    def layer_weights(self) -> int:
        """Matrix weights of one layer: q, k, v, o and the feed-forward."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + self.mlp_matrices * self.hidden * self.intermediate

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size

    def prefill_flops(self, batch: int, prompt: int) -> float:
        per_sequence = self.layers * (2 * prompt * self.layer_weights()
                                      + 2 * self.heads * self.head_dim * prompt * (prompt + 1)) \
            + 2 * self.hidden * self.vocab
        return batch * per_sequence

    def decode_bytes(self, batch: int, context: float, element_size: int) -> float:
        weights = self.layers * self.layer_weights() + self.hidden * self.vocab
        return element_size * weights + batch * context * self.kv_bytes_per_token(element_size)


def predicted_speedups(full: ServingShape, stock: ServingShape, batch: int, prompt: int, new_tokens: int,
                       element_size: int) -> dict[str, float]:
    """``cost(full) / cost(stock)`` for prefill (FLOPs) and decoding (bytes read per step), module docstring."""
    context = prompt + (new_tokens - 1) / 2
    return {"prefill": full.prefill_flops(batch, prompt) / stock.prefill_flops(batch, prompt),
            "decode": full.decode_bytes(batch, context, element_size) / stock.decode_bytes(batch, context,
                                                                                           element_size)}


def export_stock(model: nn.Module, mask: Sequence[Head], folder: str | Path) -> dict[str, int]:
    """Save ``model`` without ``mask``'s heads as the stock architecture into ``folder`` (a copy is pruned; the
    model is left as it is); returns the sizes written. Refuses, as ``headsweep export --stock`` does, a mask
    that has no stock config."""
    from headsweep.workers.families.hf_shared.stock import stock_config
    from headsweep.workers.families.registry import model_family

    family = model_family("hf_causal_lm")
    sizes = family.stock_sizes(model, list(mask))
    pruned = copy.deepcopy(model)
    family.prune(pruned, list(mask))
    stock_config(pruned, sizes)
    pruned.save_pretrained(folder)
    return sizes


def load_stock(folder: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, bool]:
    """``AutoModelForCausalLM.from_pretrained(folder)`` (sdpa attention), and whether it loaded every weight with
    its shape (nothing missing, unexpected or resized: what ``loads_stock`` reports)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa",
                                                       output_loading_info=True)
    clean = not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.to(device).eval(), clean


def prompts(vocab: int, batch: int, length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Random token ids (no padding), the same for every model."""
    g = torch.Generator().manual_seed(seed + 1000 * batch + length)
    return torch.randint(8, min(vocab, 8192), (batch, length), generator=g).to(device)


def prefill_workload(ids: torch.Tensor) -> Workload:
    return Workload(ids.shape[0], ids.numel(),
                    lambda model: model(input_ids=ids, use_cache=True, logits_to_keep=1))


def decode_workload(ids: torch.Tensor, new_tokens: int) -> Workload:
    def run(model: nn.Module) -> object:
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    return Workload(ids.shape[0], ids.shape[0] * new_tokens, run)


@torch.inference_mode()
def serving_rows(models: dict[str, nn.Module], prefill_batches: Sequence[int], decode_batches: Sequence[int],
                 prompt: int, new_tokens: int, warmup: int, repeats: int, device: torch.device) -> list[dict]:
    """Per model: prefill tokens/s at each of ``prefill_batches``, decode tokens/s at each of ``decode_batches``
    (``new_tokens`` >= 2), KV-cache bytes per token; and each figure's speed-up over ``models["full"]``."""
    vocab = min(int(m.config.vocab_size) for m in models.values())
    rows: list[dict] = []
    for b in prefill_batches:
        seconds = _fastest(time_side_by_side(models, prefill_workload(prompts(vocab, b, prompt, device)), warmup,
                                             repeats, device))
        rows += [_row(name, "prefill", b, prompt, b * prompt / seconds[name], model) for name, model in models.items()]
    for b in decode_batches:
        steps = _decode_steps(models, prompts(vocab, b, prompt, device), new_tokens, warmup, repeats, device)
        for name, model in models.items():
            rows.append(_row(name, "decode", b, prompt, b * (new_tokens - 1) / steps[name], model,
                             new_tokens=new_tokens))
    full = {(r["phase"], r["batch_size"]): r["tokens_per_s"] for r in rows if r["variant"] == "full"}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / full[(r["phase"], r["batch_size"])]
    return rows


def _decode_steps(models: dict[str, nn.Module], ids: torch.Tensor, new_tokens: int, warmup: int, repeats: int,
                  device: torch.device) -> dict[str, float]:
    """Seconds of the ``new_tokens - 1`` cached decoding steps of each model: per round, ``generate`` of
    ``new_tokens`` less ``generate`` of one, run back to back (so that a change of machine load between the two
    does not enter the difference); the median over the rounds."""
    one, whole = decode_workload(ids, 1), decode_workload(ids, new_tokens)
    for model in models.values():
        for _ in range(warmup):
            one.run(model)
            whole.run(model)
    steps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            seconds = []
            for workload in (one, whole):
                _sync(device)
                start = time.perf_counter()
                workload.run(model)
                _sync(device)
                seconds.append(time.perf_counter() - start)
            steps[name].append(seconds[1] - seconds[0])
    # A difference at or below zero: the steps took less than the timing's noise (tiny models); no figure.
    return {name: float(np.median(s)) if np.median(s) > 0 else float("nan") for name, s in steps.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(seconds: dict[str, list[float]]) -> dict[str, float]:
    return {name: float(np.min(s)) for name, s in seconds.items()}


def _row(variant: str, phase: str, batch: int, prompt: int, tokens_per_s: float, model: nn.Module,
         new_tokens: int | None = None) -> dict:
    shape = ServingShape.of(model)
    element = next(model.parameters()).element_size()
    return {"variant": variant, "phase": phase, "batch_size": batch, "prompt_tokens": prompt,
            "new_tokens": new_tokens, "tokens_per_s": tokens_per_s,
            "n_params": sum(p.numel() for p in model.parameters()), "n_heads": shape.layers * shape.heads,
            "kv_bytes_per_token": shape.kv_bytes_per_token(element)}


def stock_serving(full: nn.Module, mask: Sequence[Head], prefill_batches: Sequence[int],
                  decode_batches: Sequence[int], prompt: int, new_tokens: int, warmup: int, repeats: int,
                  device: torch.device) -> list[dict]:
    """``full`` (a model without gates, or a gated one inside ``as_stock``) and its stock export without ``mask``
    loaded by ``from_pretrained``, side by side (:func:`serving_rows`), each row with the speed-up the model
    predicts (``predicted_speedup``, 1 for the full model). The export goes to a temporary folder, deleted
    afterwards."""
    dtype = next(full.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="headsweep-stock-") as tmp:
        export_stock(full, mask, Path(tmp) / "stock")
        stock, _ = load_stock(Path(tmp) / "stock", dtype, device)
    rows = serving_rows({"full": full, "stock": stock}, prefill_batches, decode_batches, prompt, new_tokens, warmup,
                        repeats, device)
    shapes = {"full": ServingShape.of(full), "stock": ServingShape.of(stock)}
    element = next(stock.parameters()).element_size()
    for row in rows:
        predicted = predicted_speedups(shapes["full"], shapes[row["variant"]], row["batch_size"], prompt, new_tokens,
                                       element)
        row["predicted_speedup"] = predicted[row["phase"]]
    return rows


def serving_on_worker(worker, mask: Sequence[Head], settings) -> tuple[list[dict], str | None]:
    """Worker-side step of the ``efficiency`` experiment for a mask with a stock architecture: the serving rows
    (:func:`stock_serving`, with the device), or no rows and the reason the mask has none (the family's
    ``stock_sizes`` refusal)."""
    from headsweep.errors import HeadsweepError
    from headsweep.workers.families.registry import model_family
    from headsweep.workers.pruning.removal import as_stock

    adapter = worker.adapter()
    try:
        model_family(worker.kind).stock_sizes(adapter.model, list(mask))
    except HeadsweepError as exc:
        return [], str(exc)
    with as_stock(adapter.model, adapter.gates) as full:
        rows = stock_serving(full, mask, settings.prefill_batch_sizes, settings.decode_batch_sizes,
                             settings.prompt_tokens, settings.new_tokens, settings.warmup, settings.repeats,
                             adapter.device)
    if adapter.device.type == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(adapter.device)})"
    else:
        device = f"cpu ({torch.get_num_threads()} thread(s))"
    return [{**row, "device": device} for row in rows], None
