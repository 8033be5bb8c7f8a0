"""Benchmark: stock-exported pruned models where they are served: prefill and decode speed, KV-cache bytes.

For the real_size shapes Qwen2.5-0.5B and Llama-3.2-1B (``bench/gpu_check.py``'s published configurations with
seeded random weights, float32, sdpa attention), a uniform ``kv_groups`` mask removes 25% and 50% of the key/value
groups of every layer (the groups chosen per layer as ``prune.uniform: kv_groups`` levels choose them, by seeded
random importance: the weights are random, so any choice costs the same). The masked model is written as
``headsweep export --stock`` writes it and loaded back by ``AutoModelForCausalLM.from_pretrained``
(``loads_stock``: every weight loaded with its shape), then timed against the full model, also loaded by
``from_pretrained`` (``headsweep.workers.analyses.stock_serving``, interleaved repeats after a warm-up): prefill
tokens/s at batch 1 and 16 (``--prompt`` tokens, the last position's logits), decode tokens/s at batch 1 (greedy
``generate`` of exactly ``--new-tokens`` tokens with the KV cache, less the time of ``generate`` of one token: the
steps that read the cache), KV-cache bytes per token. Each figure is the fastest of the timed repeats (other
processes only slow a run down).

Where the model's config class refuses the pruned sizes (transformers 5's ``LlamaConfig`` requires ``hidden_size``
to be a multiple of ``num_attention_heads`` even with ``head_dim`` set: Llama-3.2-1B at 25% of its groups removed
keeps 24 query heads, and 2,048 / 24 is no integer), there is no stock model: ``loads_stock=false``, the refusal
is printed, and the pruned model ``headsweep.load_pruned`` loads is timed instead. Qwen2.5-0.5B has two key/value
groups per layer, so 25% is not a whole number of groups (a ``prune.uniform`` level would round it up to 50%): it is
skipped with a line saying so.

``equal``: the stock model's logits on two prompts equal the full model's with the mask's heads' ``o_proj`` columns
zeroed (weight surgery, the independent route) within the summation-order bound ``6 (L + 1) I eps max|ref| + eps``
(tests/tolerances.py: L layers and the LM head, I the feed-forward width, float32's eps), and the mask moves the
logits by more than that bound (so the comparison can fail).

The prediction (``workers/analyses/stock_serving.py``): prefill by FLOPs (matrix products, attention scores and
values, the LM head for the last position), decoding by bytes read per step (every matrix weight once, the LM
head's included, plus the KV cache of the sequence so far). ``goal``: decode speed-up >= 0.8 x the predicted one.

Prints per shape and share ``RESULT stock_export shape=<name> removed=<x> prefill_speedup=<x at batch 16>
decode_speedup=<x> kv_bytes_ratio=<stock/full> loads_stock=<true|false> equal=<true|false>`` and after it
``requested``, ``prefill1_speedup`` (batch 1), ``predicted_prefill``, ``predicted_decode`` and ``goal``.

Usage: python -m bench.stock_export [--shape NAME] [--prompt 16] [--new-tokens 8] [--repeats 3] [--threads N]
[--smoke] (``--smoke``: gpu_check's tiny versions of both shapes, seconds, figures meaningless).
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from bench.common import log, result
from bench.gpu_check import LLAMA32_1B, QWEN25_05B, build_folder, tiny
from headsweep.errors import HeadsweepError
from headsweep.sweep.pruning.uniform import layers_in_scope, uniform_level_masks
from headsweep.workers.analyses.stock_serving import (
    ServingShape,
    export_stock,
    load_stock,
    predicted_speedups,
    serving_rows,
)
from headsweep.workers.core.gates import site_inventory
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.model.sites import find_sites, kv_groups

SHARES = (0.25, 0.5)
GOAL = 0.8  # decode speed-up >= GOAL x the predicted one


def mask_for(model, share: float, seed: int = 0) -> list[Head]:
    """The ``kv_groups`` uniform level ``share`` of ``model``, by seeded random importance."""
    sites = find_sites(model)
    inventory = site_inventory(sites)
    layers = layers_in_scope(inventory, kv_groups(sites), None)
    rng = random.Random(seed)
    scores = {h: rng.random() for h in inventory.heads}
    return list(dict(uniform_level_masks(lambda _m: scores, layers, [share], "kv_groups"))[share])


def surgery_logits(model, mask: list[Head], ids: torch.Tensor) -> torch.Tensor:
    """The full model's logits with the mask's heads' ``o_proj`` input columns zeroed, then put back."""
    sites = {s.key: s for s in find_sites(model)}
    saved = []
    with torch.no_grad():
        for h in mask:
            site = sites[h.site]
            span = slice(h.head * site.head_dim, (h.head + 1) * site.head_dim)
            saved.append((site.out_proj.weight, span, site.out_proj.weight[:, span].clone()))
            site.out_proj.weight[:, span] = 0.0
        try:
            return model(input_ids=ids, use_cache=False).logits
        finally:
            for weight, span, columns in saved:
                weight[:, span] = columns


def bound(reference: torch.Tensor, layers: int, width: int) -> float:
    eps = torch.finfo(torch.float32).eps
    return 6 * (layers + 1) * width * eps * float(reference.abs().max()) + eps


def measure_share(full, shape_name: str, share: float, args, workdir: Path) -> None:
    """Export, load, check and time one share of key/value groups removed; prints its RESULT line."""
    import headsweep

    config = full.config
    mask = mask_for(full, share)
    removed = len(mask) / (config.num_hidden_layers * config.num_attention_heads)
    folder = workdir / f"{shape_name}-{share}"
    shutil.rmtree(folder, ignore_errors=True)
    try:
        sizes = export_stock(full, mask, folder)
        stock, loads = load_stock(folder, torch.float32, torch.device("cpu"))
        log(f"  {shape_name} {share:.0%} requested: stock config {sizes}")
    except HeadsweepError as exc:
        log(f"  {shape_name} {share:.0%} requested: no stock config ({exc}); timing the headsweep.load_pruned model")
        from headsweep.workers.families.hf_shared.pruning import save_pruned
        from headsweep.workers.pruning.removal import prune_heads

        shutil.rmtree(folder, ignore_errors=True)
        pruned = __import__("copy").deepcopy(full)
        prune_heads(pruned, mask)
        save_pruned(pruned, folder)
        del pruned
        stock, loads = headsweep.load_pruned(str(folder)), False
    ids = torch.randint(8, 2048, (2, args.prompt), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = stock(input_ids=ids, use_cache=False).logits
    reference = surgery_logits(full, mask, ids)
    diff = float((got - reference).abs().max())
    tol = bound(reference, config.num_hidden_layers, config.intermediate_size)
    moved = float((full(input_ids=ids, use_cache=False).logits - reference).abs().max())
    log(f"  logits: max |stock - surgery| {diff:.3g}, bound {tol:.3g}; the mask moves them by {moved:.3g}")
    start = time.perf_counter()
    rows = serving_rows({"full": full, "stock": stock}, [1, 16], [1], args.prompt, args.new_tokens, args.warmup,
                        args.repeats, torch.device("cpu"))
    log(f"  timed in {time.perf_counter() - start:.0f} s")
    for r in rows:
        log(f"    {r['variant']:5s} {r['phase']:7s} batch {r['batch_size']:2d}: {r['tokens_per_s']:9.1f} tokens/s "
            f"(x{r['speedup']:.3f}), {r['n_params']:,} parameters, KV {r['kv_bytes_per_token']:,} B/token")
    by = {(r["variant"], r["phase"], r["batch_size"]): r for r in rows}
    predicted = predicted_speedups(ServingShape.of(full), ServingShape.of(stock), 1, args.prompt, args.new_tokens, 4)
    predicted16 = predicted_speedups(ServingShape.of(full), ServingShape.of(stock), 16, args.prompt,
                                     args.new_tokens, 4)["prefill"]
    decode = by[("stock", "decode", 1)]["speedup"]
    kv_ratio = by[("stock", "decode", 1)]["kv_bytes_per_token"] / by[("full", "decode", 1)]["kv_bytes_per_token"]
    result("stock_export", shape=shape_name, removed=f"{removed:.3f}",
           prefill_speedup=f"{by[('stock', 'prefill', 16)]['speedup']:.3f}", decode_speedup=f"{decode:.3f}",
           kv_bytes_ratio=f"{kv_ratio:.3f}",
           loads_stock=str(loads).lower(), equal=str(diff <= tol < moved).lower(),
           requested=f"{share:.2f}", prefill1_speedup=f"{by[('stock', 'prefill', 1)]['speedup']:.3f}",
           predicted_prefill=f"{predicted16:.3f}", predicted_decode=f"{predicted['decode']:.3f}",
           goal=str(decode >= GOAL * predicted["decode"]).lower())
    shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = common.command_line(__doc__)
    parser.add_argument("--shape", choices=[QWEN25_05B.name, LLAMA32_1B.name], help="one shape (default: both)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated after the prompt (>= 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    shapes = [s for s in (QWEN25_05B, LLAMA32_1B) if not args.shape or s.name == args.shape]
    if common.enable_smoke(args):
        shapes = [tiny(s) for s in shapes]
        args.prompt, args.new_tokens, args.warmup, args.repeats = 8, 3, 0, 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    common.quiet_logging()
    log(f"stock_export: cpu, {torch.get_num_threads()} thread(s), float32, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens, {args.warmup} warm-up, {args.repeats} timed repeats")
    with tempfile.TemporaryDirectory(prefix="stock-export-") as tmp:
        workdir = Path(tmp)
        for shape in shapes:
            folder = workdir / shape.name
            build_folder(shape, folder, "cpu", torch.float32, 64, seed=0)
            full, _ = load_stock(folder, torch.float32, torch.device("cpu"))
            kv = full.config.num_key_value_heads
            log(f"{shape.name}: {sum(p.numel() for p in full.parameters()):,} parameters, "
                f"{full.config.num_attention_heads} query / {kv} key-value heads per layer")
            for share in SHARES:
                if abs(share * kv - round(share * kv)) > 1e-9 or round(share * kv) >= kv:
                    log(f"  {share:.0%} of {kv} key/value groups is not a whole number of groups short of all: "
                        "skipped")
                    continue
                measure_share(full, shape.name, share, args, workdir)
            del full
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
