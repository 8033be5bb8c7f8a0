"""Benchmark: Hard Concrete (L0) head gates against gradient-importance pruning at the same head counts (Multi30k).

Voita et al. 2019 (sec. 6) prune encoder self-attention heads by training a Hard Concrete gate per head with a
relaxed L0 penalty, starting from a converged model, and sweeping the penalty weight lambda; they find that
this keeps more BLEU than pruning by importance at the same number of heads. Here, on the small fairseq
Transformer of ``bench/multi30k_translation.py`` (trained and cached there on first use):

1. for each lambda (at least four): gates on encoder self-attention only, gates and model trained together
   (``train: all``, as the paper) for ``--steps`` updates on Multi30k train (``--train-examples`` pairs);
   the closed heads (test-time gate 0) masked, BLEU of the fine-tuned model on test_2016_flickr;
2. gradient importance (per token, label-smoothed cross-entropy, normalised per layer) of the original model
   on the validation split; for each head count the L0 runs reached, the same number of least important
   encoder self-attention heads masked in the original model, BLEU on test_2016_flickr.

Prints ``RESULT l0 heads_kept=<k1,k2,...> bleu_l0=<...> bleu_importance=<...>`` and the wall time.

Usage: python bench/multi30k_l0.py [--lambdas 0.1,0.2,0.3,0.5] [--steps N] [--train-examples N] [--max-examples N]
       [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import common  # noqa: E402  (RESULT lines, smoke mode)
import multi30k_translation as m30k  # noqa: E402  (the model and data of the grid benchmark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lambdas", default="0.1,0.2,0.3,0.5",
                        help="penalty weights, comma-separated (at least four); measured: 0.1 keeps all 12 encoder "
                        "heads, 0.3 keeps 2, 0.5 none (300 steps)")
    parser.add_argument("--steps", type=int, default=1000, help="updates per lambda")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of the gates")
    parser.add_argument("--model-lr", type=float, default=1e-5, help="Adam learning rate of the model (train all)")
    parser.add_argument("--train", choices=("all", "gates"), default="all", help="all: gates and model (paper)")
    parser.add_argument("--train-examples", type=int, default=5000, help="Multi30k train pairs for the gates")
    parser.add_argument("--importance-examples", type=int, default=500, help="validation pairs for importance")
    parser.add_argument("--max-examples", type=int, default=300, help="test sentences decoded")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    common.add_argument(parser)
    args = parser.parse_args()
    lambdas = [float(x) for x in args.lambdas.split(",") if x.strip()]
    if len(lambdas) < 4:
        parser.error("--lambdas: give at least four penalty weights")

    if common.enable_smoke(args):
        m30k.use_smoke()
        args.steps, args.train_examples = 3, 40
        args.importance_examples = args.max_examples = common.SMOKE_EXAMPLES
    if not m30k.DATA.is_dir():
        m30k.skip(f"{m30k.DATA} not found (the shared data folder beside the repository)")
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch

    from headsweep.sweep.experiments.l0.settings import L0Section
    from headsweep.sweep.experiments.l0.training import L0Trainer, checkpoint_label_smoothing
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
    from headsweep.workers.family import RuntimeOptions
    from headsweep.workers.heads import Head
    from headsweep.workers.importance import gradient_importance, rank_heads

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    checkpoint, spm_model, data_bin = m30k.cached_model(args.threads)  # shared with the other Multi30k benchmarks
    model_cfg = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam)
    # reuse off: the L0 runs load fine-tuned weights into the test adapter's model, and no cache may outlive them
    runtime = RuntimeOptions(batch_size=64, max_tokens=0, reuse=False)
    flickr_data = TranslationData(source=str(m30k.DATA / f"test_2016_flickr.{m30k.SRC}.gz"),
                                  target=str(m30k.DATA / f"test_2016_flickr.{m30k.TGT}.gz"),
                                  sentencepiece_model=str(spm_model), max_examples=args.max_examples,
                                  name="test_2016_flickr")
    flickr = load_translation(model_cfg, flickr_data, runtime)
    original = {k: v.clone() for k, v in flickr.model.state_dict().items()}
    inventory = flickr.describe().inventory
    enc_self = [h for h in inventory.heads if h.attention == "enc_self"]
    baseline = flickr.evaluate([[]])[0].score
    label_smoothing = checkpoint_label_smoothing(model_cfg)
    print(f"test_2016_flickr ({args.max_examples} sentences) baseline BLEU {baseline:.2f}; "
          f"{len(enc_self)} encoder self-attention heads; label smoothing {label_smoothing}")

    l0_points: list[tuple[float, int, float]] = []
    for lam in lambdas:
        start = time.perf_counter()
        train = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="train",
                                                            max_examples=args.train_examples), runtime)
        trainer = L0Trainer(train, L0Section(steps=args.steps, lr=args.lr, model_lr=args.model_lr, train=args.train,
                                             seed=args.seed, attention=["enc_self"], label_smoothing=label_smoothing),
                            lam)
        history = trainer.train()
        closed = trainer.closed_heads()
        if args.train == "all":
            flickr.model.load_state_dict(trainer.model.state_dict())
        bleu = flickr.evaluate([closed])[0].score
        flickr.model.load_state_dict(original)
        kept = len(enc_self) - len(closed)
        l0_points.append((lam, kept, bleu))
        print(f"lambda={lam:g}: {kept}/{len(enc_self)} heads kept, BLEU {bleu:.2f} "
              f"(task loss {history[-1].task_loss:.3f}, expected open {history[-1].expected_open:.2f}, "
              f"{time.perf_counter() - start:.0f}s)")
        del train, trainer

    valid = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="valid",
                                                        max_examples=args.importance_examples), runtime)
    importance = gradient_importance(valid, per_token=True, normalize=True)
    order = [h for h in rank_heads(importance.scores) if h.attention == "enc_self"]  # least important first
    imp_points = []
    for _, kept, _ in l0_points:
        mask: list[Head] = order[: len(enc_self) - kept]
        imp_points.append(flickr.evaluate([mask])[0].score)
    for (lam, kept, bleu), imp in zip(l0_points, imp_points, strict=True):
        print(f"  {kept:2d} heads kept: L0 (lambda={lam:g}) BLEU {bleu:6.2f}   importance BLEU {imp:6.2f}")
    seconds = time.perf_counter() - wall
    common.result("l0", heads_kept=",".join(str(k) for _, k, _ in l0_points),
                  bleu_l0=",".join(f"{b:.2f}" for _, _, b in l0_points),
                  bleu_importance=",".join(f"{b:.2f}" for b in imp_points), baseline=f"{baseline:.2f}",
                  train=args.train, steps=args.steps, wall_s=f"{seconds:.0f}")


if __name__ == "__main__":
    main()
