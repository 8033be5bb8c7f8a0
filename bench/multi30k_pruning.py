"""Benchmark: pruning curves per attention type and cross-domain consistency on Multi30k en->fr.

Uses the small fairseq Transformer of ``bench/multi30k_translation.py`` (``bench/multi30k.py``:
trained and cached on first use) and reproduces Michel et al. sec. 4.2 and 5 on it:
1. gradient head importance (per-token |dL/dxi|, label-smoothed cross-entropy, per-layer
   normalised) on the validation split, never on a test set;
2. pruning curves (BLEU at 0%, 10%, ..., 100% of heads masked, least important first) for
   global pruning and for enc_self-only, enc_dec-only and dec_self-only pruning, on
   test_2016_flickr;
3. single-head deltas on test_2016_flickr (in-domain) and test_2017_mscoco (out-of-domain) and
   their Spearman and Pearson correlations.

Usage: python -m bench.multi30k_pruning [--max-examples N] [--importance-examples N] [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import time

from bench import common, multi30k

LEVELS = [round(0.1 * i, 1) for i in range(11)]
SCOPES = {"global": None, "enc_self": ["enc_self"], "enc_dec": ["enc_dec"], "dec_self": ["dec_self"]}


def parse_args() -> argparse.Namespace:
    """The command line; in smoke mode, a few sentences."""
    parser = common.command_line(__doc__)
    parser.add_argument("--max-examples", type=int, default=300, help="test sentences decoded per set")
    parser.add_argument("--importance-examples", type=int, default=500, help="validation pairs for importance")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.max_examples = args.importance_examples = common.SMOKE_EXAMPLES
    return args


def importance(model_cfg, data_bin, runtime, examples: int):
    """Gradient importance (per token, normalised per layer) on ``examples`` validation pairs, its top heads
    printed."""
    from headsweep.workers.analyses.importance import gradient_importance
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData

    start = time.perf_counter()
    valid = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="valid",
                                                        max_examples=examples), runtime)
    found = gradient_importance(valid, per_token=True, normalize=True)
    print(f"gradient importance on {found.n_examples} validation pairs in {time.perf_counter() - start:.1f}s "
          f"({found.loss_name})")
    for head in sorted(found.scores, key=lambda h: -found.scores[h])[:5]:
        print(f"  most important: {head}  {found.scores[head]:.3f}")
    return found


def pruning_curves(flickr, scores: dict, inventory) -> dict[str, list[tuple[float, int, float]]]:
    """Per scope, (level, heads masked, BLEU) at every level, least important first; printed as a table."""
    from headsweep.sweep.pruning.levels import level_masks

    curves: dict[str, list[tuple[float, int, float]]] = {}
    start = time.perf_counter()
    for scope, attention in SCOPES.items():
        masks = level_masks(scores, inventory, LEVELS, attention)
        outs = flickr.evaluate([list(mask) for _, mask in masks])
        curves[scope] = [(p, len(mask), out.score) for (p, mask), out in zip(masks, outs, strict=True)]
    prune_s = time.perf_counter() - start
    print(f"pruning curves: {sum(len(c) for c in curves.values())} decodes in {prune_s:.1f}s")
    print("level  " + "  ".join(f"{s:>16}" for s in SCOPES))
    for i, p in enumerate(LEVELS):
        cells = [f"{curves[s][i][2]:7.2f} ({curves[s][i][1]:2d} h)" for s in SCOPES]
        print(f"{p:5.1f}  " + "  ".join(f"{c:>16}" for c in cells))
    return curves


def cross_domain(tasks: dict, inventory) -> tuple[float, float]:
    """Single-head deltas on each test set of ``tasks`` (in-domain first); their Spearman and Pearson
    correlations, printed."""
    from scipy import stats

    start = time.perf_counter()
    deltas = {}
    for name, task in tasks.items():
        outs = task().evaluate([[]] + [[h] for h in inventory.heads])
        deltas[name] = [o.score - outs[0].score for o in outs[1:]]
        print(f"{name}: baseline BLEU {outs[0].score:.2f}, single-head deltas from {min(deltas[name]):+.2f} "
              f"to {max(deltas[name]):+.2f}")
    cross_s = time.perf_counter() - start
    flickr, mscoco = deltas.values()
    spearman = stats.spearmanr(flickr, mscoco).statistic
    pearson = stats.pearsonr(flickr, mscoco).statistic
    print(f"cross-domain single-head deltas ({len(inventory.heads)} heads, {cross_s:.1f}s): "
          f"Spearman {spearman:.3f}, Pearson {pearson:.3f}")
    return spearman, pearson


def main() -> None:
    """Importance, pruning curves and cross-domain deltas; the RESULT multi30k_pruning line."""
    args = parse_args()
    multi30k.require("multi30k_pruning")
    common.quiet_logging()
    import torch

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationModel

    torch.set_num_threads(args.threads)
    checkpoint, spm_model, data_bin = multi30k.cached_model(args.threads)
    model_cfg = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam)
    runtime = RuntimeOptions(batch_size=64)

    def test_task(name: str):
        return load_translation(model_cfg, multi30k.test_data(spm_model, args.max_examples, name), runtime)

    scores = importance(model_cfg, data_bin, runtime, args.importance_examples).scores
    flickr = test_task("test_2016_flickr")
    inventory = flickr.describe().inventory
    baseline = flickr.evaluate([[]])[0].score
    print(f"\ntest_2016_flickr ({args.max_examples} sentences) baseline BLEU {baseline:.2f}")
    curves = pruning_curves(flickr, scores, inventory)
    spearman, pearson = cross_domain({"test_2016_flickr": lambda: flickr,
                                      "test_2017_mscoco": lambda: test_task("test_2017_mscoco")}, inventory)
    half = {f"{s}_50": f"{curves[s][5][2]:.2f}" for s in SCOPES}
    common.result("multi30k_pruning", baseline=f"{baseline:.2f}", **half, spearman_flickr_mscoco=f"{spearman:.3f}",
                  pearson_flickr_mscoco=f"{pearson:.3f}")


if __name__ == "__main__":
    main()
