"""Benchmark: single-head and all-but-one grids of a small fairseq Transformer on Multi30k en->fr.

Trains (once; cached under ~/.cache/headsweep/bench/, by ``bench/multi30k.py``) a 3+3-layer, 4-head, d=128 Transformer
on Multi30k's 29,000 English-French caption pairs, then evaluates every single-head
ablation and every all-but-one-head mask on test_2016_flickr with real beam search
(``load_translation`` + ``evaluate``, a plain loop, no Ray), printing BLEU and wall times.

Why this model: 3 layers x 4 heads x 3 attention types (36 heads) give every grid of Michel
et al. something to find, and Multi30k sentences are short (about 12 words), so a small
model learns the task quickly. The width is set by the CPU budget, measured here: one update
of ~3,000 target tokens takes about 0.6 s at d=128 and 1.2 s at d=256 (one thread, 2 busy
cores), i.e. ~100 s against ~190 s per epoch; in 12 minutes d=128 sees about 7 epochs,
d=256 under 4, and the smaller model also decodes the 73 grids twice as fast. Vocabulary:
one joint SentencePiece BPE model of 4,000 pieces over English and French (it trains in
seconds, needs no Moses tokenisation, and turns hypotheses back into plain text for
sacrebleu with fairseq's ``--post-process sentencepiece``); joint pieces let the encoder,
decoder and output share one embedding matrix, which keeps the softmax cheap. Training
stops at the first update past the time budget, so a busy machine gets a weaker model,
not a longer wait. Decoding takes the whole test set by default (1,000 sentences, beam 5:
73 decodes in about 15 minutes here, measured at 6.3 s a decode for 500 sentences); pass
``--max-examples N`` for a quicker run on the first N sentences.

Usage: python -m bench.multi30k_translation [--max-examples N] [--train-minutes M] [--beam B] [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import time

from bench import common, multi30k


def grids(inventory) -> tuple[list[list], list[list]]:
    """Masks of Michel et al.'s single-head (sec. 3.2) and all-but-one (sec. 3.3) experiments."""
    single = [[h] for h in inventory.heads]
    all_but_one = [[o for o in shape.heads() if o != h] for shape in inventory.layers for h in shape.heads()]
    return single, all_but_one


def parse_args() -> argparse.Namespace:
    """The command line; in smoke mode, the first ``SMOKE_EXAMPLES`` sentences."""
    parser = common.command_line(__doc__)
    parser.add_argument("--max-examples", type=int, default=None,
                        help="decode only the first N test sentences (default: all 1,000)")
    parser.add_argument("--train-minutes", type=float, default=12.0)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--masks-per-batch", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: two threads on two busy cores thrash, measured 5-10x slower)")
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.max_examples = common.SMOKE_EXAMPLES
    return args


def load_task(args: argparse.Namespace):
    """The test set's translation adapter on the cached model (trained first if need be), described."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationModel

    t0 = time.perf_counter()
    checkpoint, spm_model, data_bin = multi30k.cached_model(args.threads, args.train_minutes)
    print(f"model ready in {time.perf_counter() - t0:.0f}s", flush=True)
    task = load_translation(
        TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam),
        multi30k.test_data(spm_model, args.max_examples),
        RuntimeOptions(batch_size=args.batch_size, masks_per_batch=args.masks_per_batch),
    )
    info = task.describe()
    n_total = len(common.read_gz(multi30k.pair(multi30k.TEST)[0]))
    subset = "" if info.n_examples == n_total else f" (a subset: the first {info.n_examples} of {n_total} sentences)"
    print(f"decoding {multi30k.TEST}{subset}, beam {args.beam}, {len(info.inventory.heads)} heads, "
          f"masks per search {task.masks_per_forward()}; {info.facts['sacrebleu_signature']}", flush=True)
    return task, info


def timed(task, masks: list) -> tuple[list, float]:
    """The outputs of ``masks`` and the seconds they took."""
    start = time.perf_counter()
    return task.evaluate(masks), time.perf_counter() - start


def single_head(task, inventory, baseline) -> float:
    """Every single-head ablation, printed with its BLEU delta; the grid's seconds."""
    single, _ = grids(inventory)
    outs, seconds = timed(task, single)
    print(f"\nsingle-head ablation: {len(single)} decodes in {seconds:.1f}s ({seconds / len(single):.2f}s each)")
    for mask, out in zip(single, outs, strict=True):
        print(f"  {mask[0]!s:<12} BLEU {out.score:6.2f}  delta {out.score - baseline.score:+6.2f}")
    return seconds


def all_but_one(task, inventory, baseline) -> float:
    """Every all-but-one-head mask, printed by the head kept, and the best kept head per layer; the grid's
    seconds."""
    _, masks = grids(inventory)
    outs, seconds = timed(task, masks)
    print(f"\nall-but-one-head: {len(masks)} decodes in {seconds:.1f}s ({seconds / len(masks):.2f}s each)")
    kept = [h for shape in inventory.layers for h in shape.heads()]
    best: dict[tuple[str, int], tuple[float, object]] = {}
    for head, out in zip(kept, outs, strict=True):
        print(f"  keep {head!s:<12} BLEU {out.score:6.2f}  delta {out.score - baseline.score:+6.2f}")
        key_ = (head.attention, head.layer)
        if key_ not in best or out.score > best[key_][0]:
            best[key_] = (out.score, head)
    print("best kept head per layer: " + ", ".join(f"{h} ({s:.2f})" for s, h in best.values()))
    print()
    return seconds


def main() -> None:
    """Train or load the model, decode the baseline and both grids, print the RESULT line."""
    args = parse_args()
    multi30k.require("multi30k_grid")
    common.quiet_logging()
    import torch

    torch.set_num_threads(args.threads)
    task, info = load_task(args)
    (baseline,), baseline_s = timed(task, [[]])
    print(f"baseline BLEU {baseline.score:.2f} in {baseline_s:.1f}s; e.g. {baseline.outputs[0]!r} "
          f"(ref {info.references[0]!r})", flush=True)
    single_s = single_head(task, info.inventory, baseline)
    abo_s = all_but_one(task, info.inventory, baseline)
    common.result("multi30k_grid", bleu=f"{baseline.score:.2f}", heads=len(info.inventory.heads),
                  single_head_s=f"{single_s:.1f}", all_but_one_s=f"{abo_s:.1f}")


if __name__ == "__main__":
    main()
