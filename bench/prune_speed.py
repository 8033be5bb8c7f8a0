"""Benchmark: inference speed of a BERT classifier with half its heads physically removed.

Michel et al. (2019, sec. 6.2) report up to 17.5% faster BERT inference at batch size 64
with half the heads pruned. This builds a 6-layer, 12-head BERT classifier with BERT-base
widths (hidden 768 = 12 x 64, feed-forward 3072, vocabulary 30522; random weights, which do
not change the arithmetic's cost), removes a seeded random 50% of its 72 heads with
``headsweep.workers.pruning.removal`` and times the full and the pruned model side by side
(``headsweep.workers.analyses.efficiency``: interleaved repeats after warm-up, on the same batch of random
token ids of length 128, no padding) at batch sizes 1 and 64, on the CPU or a GPU if there is
one. It also checks that the pruned model's logits equal the gated model's.

Run: ``python -m bench.prune_speed [--repeats-small 30] [--repeats-large 6] [--threads N]`` (``--smoke``: a tiny
BERT, seconds). Each batch size prints ``RESULT prune_speed model=<name> heads_removed=<fraction> batch=<b>
speedup=<full_seconds/pruned_seconds>`` (median seconds) as soon as it is timed; the table of all follows.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from bench import common
from headsweep.workers.analyses.efficiency import Workload, measure, summary
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.pruning.removal import prune_heads, ungated_copy

LAYERS, HEADS, HIDDEN, SEQ_LEN, VOCAB = 6, 12, 768, 128, 30522
FRACTION = 0.5


@common.on_smoke
def use_smoke() -> None:
    """A 2-layer, 4-head BERT of width 32 on sequences of 16 tokens."""
    global LAYERS, HEADS, HIDDEN, SEQ_LEN, VOCAB
    LAYERS, HEADS, HIDDEN, SEQ_LEN, VOCAB = 2, 4, 32, 16, 2000


def name() -> str:
    return f"bert-{LAYERS}x{HEADS}-h{HIDDEN}"


def build_model(device: torch.device):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     intermediate_size=4 * HIDDEN, max_position_embeddings=512, num_labels=2)
    return BertForSequenceClassification(cfg).to(device).eval()


def workload(batch: int, device: torch.device) -> Workload:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(min(1000, VOCAB // 2), VOCAB, (batch, SEQ_LEN), generator=g).to(device)
    mask = torch.ones_like(ids)
    return Workload(batch, batch * SEQ_LEN, lambda model: model(input_ids=ids, attention_mask=mask))


def main() -> int:
    """Build, prune, check and time both models at batch sizes 1 and 64; the exit status."""
    parser = common.command_line(__doc__)
    parser.add_argument("--repeats-small", type=int, default=30, help="timed repeats at batch size 1")
    parser.add_argument("--repeats-large", type=int, default=6, help="timed repeats at batch size 64")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.repeats_small, args.repeats_large, args.warmup, args.threads = 3, 2, 1, 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    start = time.perf_counter()

    model = build_model(device)
    gates = HeadGates(find_sites(model))
    heads = gates.inventory.heads
    removed = sorted(random.Random(0).sample(heads, round(FRACTION * len(heads))))
    full = ungated_copy(model, gates)
    pruned = ungated_copy(model, gates)
    prune_heads(pruned, removed)
    kept = [HEADS - sum(1 for h in removed if h.layer == layer) for layer in range(LAYERS)]
    print(f"{name()} ({model.config._attn_implementation} attention) on {where}; sequence length {SEQ_LEN}")
    print(f"removed {len(removed)} of {len(heads)} heads (seed 0); heads kept per layer: {kept}")

    check = workload(4, device)
    with torch.inference_mode():
        with gates.masked(removed):
            gated = check.run(model).logits
        diff = (check.run(pruned).logits - gated).abs().max().item()
    print(f"max |pruned - gated| logit difference: {diff:.2e}")
    del model, gates

    models = {"full": full, "pruned": pruned}
    n_heads = {"full": len(heads), "pruned": len(heads) - len(removed)}
    rows = []
    for batch, repeats in ((1, args.repeats_small), (64, args.repeats_large)):
        timings = measure(models, n_heads, lambda b: workload(b, device), [batch], args.warmup, repeats, device)
        rows += summary(timings)
        for r in rows[-len(models):]:
            if r["variant"] == "pruned":
                common.result("prune_speed", model=name(), heads_removed=FRACTION, batch=r["batch_size"],
                              speedup=f"{r['speedup']:.3f}")
    print(f"{'variant':8} {'batch':>5} {'params':>11} {'peak MB':>9} {'median s':>9} {'min s':>8} {'max s':>8} "
          f"{'ex/s':>8} {'ex/s IQR':>8} {'speedup':>7}")
    for r in rows:
        mem = f"{r['peak_memory_mb']:.1f}" if r["peak_memory_mb"] is not None else "n/a"
        print(f"{r['variant']:8} {r['batch_size']:>5} {r['n_params']:>11,} {mem:>9} {r['seconds_median']:>9.4f} "
              f"{r['seconds_min']:>8.4f} {r['seconds_max']:>8.4f} {r['examples_per_s']:>8.1f} "
              f"{r['examples_per_s_iqr']:>8.1f} {r['speedup']:>7.3f}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
