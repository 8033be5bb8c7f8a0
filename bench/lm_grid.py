"""Benchmark: the single-head grid of a small Llama-style LM with grouped-query attention, scored by
perplexity: headsweep's plain path vs compute reuse, and the loop a user would write with TransformerLens.

The model (trained once, cached under ~/.cache/headsweep/bench/ or $HEADSWEEP_BENCH_CACHE): a Llama
decoder of 4 layers, 8 query heads sharing 2 key/value heads, width 256, a byte-level BPE of 4,096
pieces, trained for a fixed number of updates (``--train-steps``, batches of 16 windows of 128
tokens; a fixed count rather than a time budget, so a busy machine gives the same model, later) on
English from ../shared/data (Multi30k English train captions and SST-2 train sentences).
Held-out text: Multi30k's English test_2016_flickr and test_2017_mscoco captions, never seen in
training.

Three routes over the same windows (128 tokens, ``--windows`` of them) and the same 32
single-head masks plus the baseline, in one process (no Ray: start-up is not counted):

* plain: ``sweep.reuse: false, masks_per_batch: 1``: the whole model once per mask;
* reuse: ``sweep.reuse: true, masks_per_batch: 0`` (headsweep's default): baseline states kept per
  window batch, each mask starting at its first gated layer, masks of one layer packed in one pass;
* TransformerLens 4 (when ``transformer_lens`` imports beside this transformers): its
  ``TransformerBridge`` over the same HF model, one forward per head with a hook zeroing that head's
  ``hook_z`` (the input of the output projection), the perplexity computed from the returned logits
  exactly as headsweep scores windows.

Prints ``RESULT lm_grid ratio=<plain_s/reuse_s> max_abs_ppl_diff=<x> max_rel_ppl_diff=<y> ... plain_mfu=<x>
reuse_mfu=<x>`` once both headsweep routes are measured (``*_mfu``: the grid's FLOP/s, counted from the
configuration as bench/real_size.py counts, over the float32 ``torch.mm`` rate on the same threads; CPU only)
and, when TransformerLens runs, then
``RESULT lm_grid_vs_transformerlens ratio=<tl_s/reuse_s> max_abs_ppl_diff=<x>``.

Usage: python -m bench.lm_grid [--train-steps N] [--windows N] [--threads T] [sweep.device=cuda]
       [model.dtype=bfloat16] [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

from bench import common
from bench.gpu_check import synchronize
from bench.measure import PeakRSS, mib

DATA = common.DATA
CACHE = common.CACHE
VOCAB = 4096
SHAPE = {"layers": 4, "heads": 8, "kv_heads": 2, "hidden": 256, "intermediate": 688, "window": 128}


@common.on_smoke
def use_smoke() -> None:
    """A 2-layer Llama (4 query heads on 2 key/value heads, width 32), a BPE of 300 pieces, windows of 32 tokens,
    on the smoke copy of the data."""
    global DATA, CACHE, VOCAB, SHAPE
    DATA, CACHE, VOCAB = common.smoke_data(), common.smoke_cache(), 300
    SHAPE = {"layers": 2, "heads": 4, "kv_heads": 2, "hidden": 32, "intermediate": 64, "window": 32}


def sst2_sentences(split: str) -> list[str]:
    with open(DATA / "sst2" / f"{split}.tsv", encoding="utf-8", newline="") as f:
        return [row["sentence"] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def train_text() -> str:
    """The training text: Multi30k's English train captions and SST-2's train sentences, a line each."""
    return "\n".join(common.read_gz(DATA / "multi30k" / "train.en.gz") + sst2_sentences("train")) + "\n"


def heldout_text() -> str:
    """The held-out text: Multi30k's English test_2016_flickr and test_2017_mscoco captions, a line each."""
    return "\n".join(common.read_gz(DATA / "multi30k" / "test_2016_flickr.en.gz")
                     + common.read_gz(DATA / "multi30k" / "test_2017_mscoco.en.gz")) + "\n"


def build_tokenizer(text: str):
    """A byte-level BPE (GPT-2's scheme: spaces and newlines kept) trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def model_dir(steps: int) -> Path:
    key = (f"llama-{SHAPE['layers']}x{SHAPE['heads']}q{SHAPE['kv_heads']}kv-d{SHAPE['hidden']}-bpe{VOCAB}"
           f"-{steps}steps")
    return CACHE / "lm_grid" / key


def train(out: Path, steps: int, threads: int) -> Path:
    """Train the benchmark model once (``steps`` updates) and cache it; later runs load it."""
    done = out / "trained.json"
    if done.exists():
        print(f"using cached model {out} ({done.read_text().strip()})", flush=True)
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    text = train_text()
    tokenizer = build_tokenizer(text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    window = SHAPE["window"]
    rows = torch.tensor(ids[: len(ids) // window * window]).view(-1, window)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=SHAPE["hidden"],
                         intermediate_size=SHAPE["intermediate"], num_hidden_layers=SHAPE["layers"],
                         num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
                         max_position_embeddings=2 * window, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    print(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {len(ids):,} tokens "
          f"({len(rows):,} windows of {window}) for {steps} updates, {threads} threads", flush=True)
    batch, lr = 16, 2e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=g)
    step, position, recent = 0, 0, []
    model.train()
    while step < steps:
        if position + batch > len(order):
            order, position = torch.randperm(len(rows), generator=g), 0
        chunk = rows[order[position : position + batch]]
        position += batch
        for group in opt.param_groups:  # linear warm-up, then cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=chunk, labels=chunk, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent = (recent + [loss.item()])[-50:]
        if step % 50 == 0:
            print(f"  step {step}: train loss {sum(recent) / len(recent):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"steps": step, "tokens_seen": step * batch * window, "seconds": round(time.perf_counter() - start),
               "train_loss_last50": round(sum(recent) / max(1, len(recent)), 4), "threads": threads}
    # Written last: a run stopped mid-training leaves no marker and is trained again.
    done.write_text(json.dumps(summary) + "\n")
    print(f"trained: {summary}", flush=True)
    return out


def headsweep_adapter(path: Path, heldout: Path, args, reuse: bool):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    model = CausalLMModel(path=str(path), attn_implementation="sdpa", dtype=args.dtype)
    data = CausalLMData(path=str(heldout), window=SHAPE["window"], max_windows=args.windows)
    runtime = RuntimeOptions(device=args.device, batch_size=args.batch_size,
                             masks_per_batch=args.masks_per_batch if reuse else 1,
                             reuse=reuse, threads=args.threads)
    return load_causal_lm_adapter(model, data, runtime)


def headsweep_grid(adapter, masks: list, device: str) -> list[float]:
    """Perplexity of the baseline and every mask, as a sweep evaluates them (baseline first)."""
    adapter.baseline()
    outputs = adapter.evaluate(masks)
    synchronize(device)
    return [o.score for o in outputs]


def transformer_lens_grid(adapter, masks: list, device: str) -> list[float]:
    """The loop a TransformerLens 4 user writes: one forward per head, its ``hook_z`` zeroed by a hook."""
    import torch
    import torch.nn.functional as F
    from transformer_lens.model_bridge import TransformerBridge  # pyright: ignore[reportMissingImports]  (optional)

    bridge = TransformerBridge.boot_transformers(str(adapter.model.name_or_path), device=device,
                                                 dtype=adapter.model.dtype, hf_model=adapter.model)
    scored = adapter.scored
    inputs = adapter.inputs
    results = []
    for mask in masks:
        hooks = []
        for head in mask:
            def zero(z, hook, h=head.head):  # z: (batch, position, head, d_head)
                z[:, :, h, :] = 0.0
                return z
            hooks.append((f"blocks.{head.layer}.attn.hook_z", zero))
        nll_sum, tokens = 0.0, 0.0
        with torch.inference_mode():
            for start in range(0, len(inputs), adapter.runtime.batch_size):
                ids = inputs[start : start + adapter.runtime.batch_size]
                logits = bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type="logits")
                nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                      ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)
                keep = scored[start : start + ids.shape[0]]
                nll_sum += float((nll.double() * keep).sum())
                tokens += float(keep.sum())
        results.append(math.exp(nll_sum / tokens))
    synchronize(device)
    return results


def overrides(values: list[str], args) -> None:
    """``sweep.device=cuda`` / ``model.dtype=bfloat16`` as in headsweep's own command line."""
    known = {"sweep.device": "device", "model.dtype": "dtype", "sweep.batch_size": "batch_size",
             "sweep.threads": "threads", "sweep.masks_per_batch": "masks_per_batch"}
    for item in values:
        key, _, value = item.partition("=")
        if key not in known:
            sys.exit(f"lm_grid: unknown override {key!r} (takes {', '.join(known)})")
        numeric = key in ("sweep.batch_size", "sweep.threads", "sweep.masks_per_batch")
        setattr(args, known[key], int(value) if numeric else value)


def machine_fraction(adapter, masks: list, seconds: dict[str, float], args) -> dict[str, str]:
    """Each route's FLOP/s over its whole grid as a fraction of the machine's float32 matrix-product rate on the
    route's threads, counted as bench/real_size.py counts (``Arch``: projections, feed-forward, attention scores
    and the LM head at every position of every window; reuse: one baseline pass, then each mask from its layer on)."""
    from bench.flops import Arch, cpu_matmul_rate

    arch = Arch.of(adapter.model.config)
    batches = [(len(idx), SHAPE["window"], SHAPE["window"]) for idx in adapter.batches]
    flops = {"plain": len(masks) * arch.mask(batches, None),
             "reuse": arch.mask(batches, None) + sum(arch.mask(batches, m[0].layer) for m in masks if m)}
    rate = cpu_matmul_rate(args.threads)
    out = {name: f"{flops[name] / seconds[name] / rate:.3f}" for name in flops}
    print(f"FLOP/s over the grid against torch.mm 2048 x 2048 on {args.threads} thread(s) ({rate / 1e9:.1f} GFLOP/s): "
          f"plain {flops['plain'] / seconds['plain'] / 1e9:.1f} GFLOP/s ({out['plain']}), reuse "
          f"{flops['reuse'] / seconds['reuse'] / 1e9:.1f} GFLOP/s ({out['reuse']})", flush=True)
    return out


def parse_args() -> argparse.Namespace:
    """The command line, overrides applied; in smoke mode, a few updates and windows on one thread."""
    parser = common.command_line(__doc__)
    parser.add_argument("overrides", nargs="*", help="sweep.device=cuda, model.dtype=bfloat16, ...")
    parser.add_argument("--train-steps", type=int, default=600, help="updates of 16 x 128 tokens")
    parser.add_argument("--windows", type=int, default=96, help="held-out windows of 128 tokens")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--masks-per-batch", type=int, default=0,
                        help="the reuse route's sweep.masks_per_batch (0: automatic, headsweep's default)")
    parser.add_argument("--skip-transformerlens", action="store_true")
    parser.add_argument("--train-only", action="store_true", help="train and cache the model, then stop")
    args = parser.parse_args()
    overrides(args.overrides, args)
    if common.enable_smoke(args):
        args.train_steps, args.windows, args.batch_size, args.threads = 4, 4, 4, 1
    return args


def peak_memory(peak: PeakRSS, name: str, device: str) -> int:
    """The route's peak: GPU memory allocated on a GPU, else the resident set size ``peak`` sampled."""
    import torch

    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else peak.peak[name]


def reset_peak_memory(device: str) -> None:
    """Start a route's GPU peak afresh (nothing to do on a CPU)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def headsweep_routes(path: Path, heldout: Path, masks: list, args: argparse.Namespace, peak: PeakRSS
                     ) -> tuple[float, list[float]]:
    """The plain and the reuse route, timed and compared; the RESULT lm_grid line. Returns the reuse route's
    seconds and perplexities (the TransformerLens route is compared with them)."""
    cuda = args.device.startswith("cuda")
    seconds, scores, memory = {}, {}, {}
    for name, reuse in (("plain", False), ("reuse", True)):
        adapter = headsweep_adapter(path, heldout, args, reuse)
        reset_peak_memory(args.device)
        scores[name], seconds[name] = peak.timed(name, headsweep_grid, adapter, masks, args.device)
        memory[name] = peak_memory(peak, name, args.device)
        print(f"  {name:<6} {seconds[name]:7.1f} s  ({seconds[name] / len(masks):.3f} s a mask)  "
              f"peak {'GPU memory' if cuda else 'RSS'} {mib(memory[name])}  reuse: {adapter.reuse_note}", flush=True)
    base = scores["plain"][0]
    worst = max(range(1, len(masks)), key=lambda i: scores["plain"][i])
    print(f"baseline perplexity {base:.4f}; most harmful head {masks[worst][0]} "
          f"(perplexity {scores['plain'][worst]:.4f})", flush=True)
    diffs = [abs(a - b) for a, b in zip(scores["plain"], scores["reuse"], strict=True)]
    rel = [d / a for d, a in zip(diffs, scores["plain"], strict=True)]
    mfu = machine_fraction(adapter, masks, seconds, args) if not cuda else {"plain": "n/a", "reuse": "n/a"}
    common.result("lm_grid", ratio=f"{seconds['plain'] / seconds['reuse']:.2f}", max_abs_ppl_diff=f"{max(diffs):.3g}",
                  max_rel_ppl_diff=f"{max(rel):.3g}", plain_s=f"{seconds['plain']:.1f}",
                  reuse_s=f"{seconds['reuse']:.1f}", plain_peak_mib=f"{memory['plain'] / (1 << 20):.0f}",
                  reuse_peak_mib=f"{memory['reuse'] / (1 << 20):.0f}", plain_mfu=mfu["plain"], reuse_mfu=mfu["reuse"])
    return seconds["reuse"], scores["reuse"]


def transformer_lens_route(path: Path, heldout: Path, masks: list, args: argparse.Namespace, peak: PeakRSS,
                           reuse: tuple[float, list[float]]) -> None:
    """The TransformerLens route, where it imports, against the reuse route's ``(seconds, perplexities)``; the
    RESULT lm_grid_vs_transformerlens line."""
    if args.skip_transformerlens:
        print("TransformerLens: skipped (--skip-transformerlens)")
        return
    try:
        import transformer_lens  # noqa: F401  # pyright: ignore[reportMissingImports]  (optional)
    except ImportError as exc:
        print(f"TransformerLens: not run: {exc} (pip install transformer-lens==4.3.0 to compare)")
        return
    reuse_s, reuse_scores = reuse
    adapter = headsweep_adapter(path, heldout, args, True)
    reset_peak_memory(args.device)
    tl, tl_s = peak.timed("transformer_lens", transformer_lens_grid, adapter, masks, args.device)
    tl_mem = peak_memory(peak, "transformer_lens", args.device)
    print(f"  TransformerLens {tl_s:7.1f} s  ({tl_s / len(masks):.3f} s a mask)  peak "
          f"{'GPU memory' if args.device.startswith('cuda') else 'RSS'} {mib(tl_mem)}", flush=True)
    tl_diff = max(abs(a - b) for a, b in zip(tl, reuse_scores, strict=True))
    common.result("lm_grid_vs_transformerlens", ratio=f"{tl_s / reuse_s:.2f}",
                  max_abs_ppl_diff=f"{tl_diff:.3g}", transformerlens_s=f"{tl_s:.1f}", reuse_s=f"{reuse_s:.1f}")


def main() -> None:
    """Train or load the model, then time the routes over the held-out windows."""
    args = parse_args()
    if not DATA.is_dir():
        common.skip("lm_grid", f"{DATA} not found")

    import torch

    from headsweep.workers.core.heads import Head

    torch.set_num_threads(args.threads)
    path = train(model_dir(args.train_steps), args.train_steps, args.threads)
    if args.train_only:
        return
    heldout = CACHE / "lm_grid" / "heldout.en.txt"
    if not heldout.exists():
        heldout.write_text(heldout_text(), encoding="utf-8")

    masks = [[]] + [[Head("self", layer, head)] for layer in range(SHAPE["layers"]) for head in range(SHAPE["heads"])]
    peak = PeakRSS()
    print(f"device {args.device}, dtype {args.dtype}, threads {args.threads}, {args.windows} windows of "
          f"{SHAPE['window']} tokens, {len(masks) - 1} single-head masks + baseline", flush=True)
    reuse = headsweep_routes(path, heldout, masks, args, peak)
    transformer_lens_route(path, heldout, masks, args, peak, reuse)
    peak.stop()


if __name__ == "__main__":
    main()
