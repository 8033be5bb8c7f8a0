"""Benchmark: Hard Concrete (L0) head gates against gradient-importance pruning at the same head counts (Multi30k).

Voita et al. 2019 (sec. 6) prune encoder self-attention heads by training a Hard Concrete gate per head with a
relaxed L0 penalty, starting from a converged model, and sweeping the penalty weight lambda; they find that
this keeps more BLEU than pruning by importance at the same number of heads. Here, on the small fairseq
Transformer of ``bench/multi30k_translation.py`` (``bench/multi30k.py``: trained and cached on first use):

1. for each lambda (at least four): gates on encoder self-attention only, gates and model trained together
   (``train: all``, as the paper) for ``--steps`` updates on Multi30k train (``--train-examples`` pairs);
   the closed heads (test-time gate 0) masked, BLEU of the fine-tuned model on test_2016_flickr;
2. gradient importance (per token, label-smoothed cross-entropy, normalised per layer) of the original model
   on the validation split; for each head count the L0 runs reached, the same number of least important
   encoder self-attention heads masked in the original model, BLEU on test_2016_flickr.

Prints ``RESULT l0 heads_kept=<k1,k2,...> bleu_l0=<...> bleu_importance=<...>`` and the wall time.

Usage: python -m bench.multi30k_l0 [--lambdas 0.1,0.2,0.3,0.5] [--steps N] [--train-examples N] [--max-examples N]
       [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import time

from bench import common, multi30k


def parse_args() -> argparse.Namespace:
    """The command line; in smoke mode, three steps and a few sentences."""
    parser = common.command_line(__doc__)
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
    args = parser.parse_args()
    args.lambdas = [float(x) for x in args.lambdas.split(",") if x.strip()]
    if len(args.lambdas) < 4:
        parser.error("--lambdas: give at least four penalty weights")
    if common.enable_smoke(args):
        args.steps, args.train_examples = 3, 40
        args.importance_examples = args.max_examples = common.SMOKE_EXAMPLES
    return args


def l0_runs(args: argparse.Namespace, model_cfg, data_bin, runtime, flickr, enc_self: list, label_smoothing: float
            ) -> list[tuple[float, int, float]]:
    """Per lambda, gates (and model) trained on Multi30k train, the closed heads masked: (lambda, heads kept, test
    BLEU of the fine-tuned model); ``flickr``'s model is given its original weights back after each."""
    from headsweep.sweep.experiments.l0.settings import L0Section
    from headsweep.sweep.experiments.l0.training import L0Trainer
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData

    original = {k: v.clone() for k, v in flickr.model.state_dict().items()}
    points: list[tuple[float, int, float]] = []
    for lam in args.lambdas:
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
        points.append((lam, kept, bleu))
        print(f"lambda={lam:g}: {kept}/{len(enc_self)} heads kept, BLEU {bleu:.2f} "
              f"(task loss {history[-1].task_loss:.3f}, expected open {history[-1].expected_open:.2f}, "
              f"{time.perf_counter() - start:.0f}s)")
        del train, trainer
    return points


def importance_runs(args: argparse.Namespace, model_cfg, data_bin, runtime, flickr, enc_self: list,
                    kept: list[int]) -> list[float]:
    """Gradient importance of the original model on the validation split; per head count in ``kept``, the test
    BLEU with the least important other encoder self-attention heads masked."""
    from headsweep.workers.analyses.importance import gradient_importance, rank_heads
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData

    valid = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="valid",
                                                        max_examples=args.importance_examples), runtime)
    importance = gradient_importance(valid, per_token=True, normalize=True)
    order = [h for h in rank_heads(importance.scores) if h.attention == "enc_self"]  # least important first
    points = []
    for k in kept:
        mask: list[Head] = order[: len(enc_self) - k]
        points.append(flickr.evaluate([mask])[0].score)
    return points


def main() -> None:
    """Both pruning routes at the same head counts, printed side by side; the RESULT l0 line."""
    args = parse_args()
    multi30k.require("l0")
    common.quiet_logging()
    import torch

    from headsweep.sweep.experiments.l0.training import checkpoint_label_smoothing
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationModel, TranslationRuntime

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    checkpoint, spm_model, data_bin = multi30k.cached_model(args.threads)  # shared with the other Multi30k benchmarks
    model_cfg = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam)
    # reuse off: the L0 runs load fine-tuned weights into the test adapter's model, and no cache may outlive them
    runtime = TranslationRuntime(batch_size=64, max_tokens=0, reuse=False)
    flickr = load_translation(model_cfg, multi30k.test_data(spm_model, args.max_examples), runtime)
    enc_self = [h for h in flickr.describe().inventory.heads if h.attention == "enc_self"]
    baseline = flickr.evaluate([[]])[0].score
    label_smoothing = checkpoint_label_smoothing(model_cfg)
    print(f"test_2016_flickr ({args.max_examples} sentences) baseline BLEU {baseline:.2f}; "
          f"{len(enc_self)} encoder self-attention heads; label smoothing {label_smoothing}")

    l0_points = l0_runs(args, model_cfg, data_bin, runtime, flickr, enc_self, label_smoothing)
    imp_points = importance_runs(args, model_cfg, data_bin, runtime, flickr, enc_self, [k for _, k, _ in l0_points])
    for (lam, kept, bleu), imp in zip(l0_points, imp_points, strict=True):
        print(f"  {kept:2d} heads kept: L0 (lambda={lam:g}) BLEU {bleu:6.2f}   importance BLEU {imp:6.2f}")
    seconds = time.perf_counter() - wall
    common.result("l0", heads_kept=",".join(str(k) for _, k, _ in l0_points),
                  bleu_l0=",".join(f"{b:.2f}" for _, _, b in l0_points),
                  bleu_importance=",".join(f"{b:.2f}" for b in imp_points), baseline=f"{baseline:.2f}",
                  train=args.train, steps=args.steps, wall_s=f"{seconds:.0f}")


if __name__ == "__main__":
    main()
