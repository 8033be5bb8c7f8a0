"""Benchmark: pruning curves per attention type and cross-domain consistency on Multi30k en->fr.

Uses the small fairseq Transformer of ``bench/multi30k_translation.py`` (trained and cached
there on first use) and reproduces Michel et al. sec. 4.2 and 5 on it:
1. gradient head importance (per-token |dL/dxi|, label-smoothed cross-entropy, per-layer
   normalised) on the validation split, never on a test set;
2. pruning curves (BLEU at 0%, 10%, ..., 100% of heads masked, least important first) for
   global pruning and for enc_self-only, enc_dec-only and dec_self-only pruning, on
   test_2016_flickr;
3. single-head deltas on test_2016_flickr (in-domain) and test_2017_mscoco (out-of-domain) and
   their Spearman and Pearson correlations.

Usage: python bench/multi30k_pruning.py [--max-examples N] [--importance-examples N] [--smoke]
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

LEVELS = [round(0.1 * i, 1) for i in range(11)]
SCOPES = {"global": None, "enc_self": ["enc_self"], "enc_dec": ["enc_dec"], "dec_self": ["dec_self"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=300, help="test sentences decoded per set")
    parser.add_argument("--importance-examples", type=int, default=500, help="validation pairs for importance")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    common.add_argument(parser)
    args = parser.parse_args()
    if common.enable_smoke(args):
        m30k.use_smoke()
        args.max_examples = args.importance_examples = common.SMOKE_EXAMPLES
    if not m30k.DATA.is_dir():
        m30k.skip(f"{m30k.DATA} not found (the shared data folder beside the repository)")
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch
    from scipy import stats

    from headsweep.sweep.pruning.levels import level_masks
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
    from headsweep.workers.family import RuntimeOptions
    from headsweep.workers.importance import gradient_importance

    torch.set_num_threads(args.threads)
    checkpoint, spm_model, data_bin = m30k.cached_model(args.threads)
    model_cfg = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam)
    runtime = RuntimeOptions(batch_size=64)

    def test_task(name: str):
        return load_translation(
            model_cfg,
            TranslationData(source=str(m30k.DATA / f"{name}.{m30k.SRC}.gz"),
                            target=str(m30k.DATA / f"{name}.{m30k.TGT}.gz"), sentencepiece_model=str(spm_model),
                            max_examples=args.max_examples, name=name),
            runtime,
        )

    start = time.perf_counter()
    valid = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="valid",
                                                        max_examples=args.importance_examples), runtime)
    importance = gradient_importance(valid, per_token=True, normalize=True)
    imp_s = time.perf_counter() - start
    print(f"gradient importance on {importance.n_examples} validation pairs in {imp_s:.1f}s ({importance.loss_name})")
    for head in sorted(importance.scores, key=lambda h: -importance.scores[h])[:5]:
        print(f"  most important: {head}  {importance.scores[head]:.3f}")

    flickr = test_task("test_2016_flickr")
    inventory = flickr.describe().inventory
    baseline = flickr.evaluate([[]])[0].score
    print(f"\ntest_2016_flickr ({args.max_examples} sentences) baseline BLEU {baseline:.2f}")
    curves: dict[str, list[tuple[float, int, float]]] = {}
    start = time.perf_counter()
    for scope, attention in SCOPES.items():
        masks = level_masks(importance.scores, inventory, LEVELS, attention)
        outs = flickr.evaluate([list(mask) for _, mask in masks])
        curves[scope] = [(p, len(mask), out.score) for (p, mask), out in zip(masks, outs, strict=True)]
    prune_s = time.perf_counter() - start
    print(f"pruning curves: {sum(len(c) for c in curves.values())} decodes in {prune_s:.1f}s")
    print("level  " + "  ".join(f"{s:>16}" for s in SCOPES))
    for i, p in enumerate(LEVELS):
        cells = [f"{curves[s][i][2]:7.2f} ({curves[s][i][1]:2d} h)" for s in SCOPES]
        print(f"{p:5.1f}  " + "  ".join(f"{c:>16}" for c in cells))

    start = time.perf_counter()
    deltas = {}
    for name in ("test_2016_flickr", "test_2017_mscoco"):
        task = flickr if name == "test_2016_flickr" else test_task(name)
        outs = task.evaluate([[]] + [[h] for h in inventory.heads])
        deltas[name] = [o.score - outs[0].score for o in outs[1:]]
        print(f"{name}: baseline BLEU {outs[0].score:.2f}, single-head deltas from {min(deltas[name]):+.2f} "
              f"to {max(deltas[name]):+.2f}")
    cross_s = time.perf_counter() - start
    spearman = stats.spearmanr(deltas["test_2016_flickr"], deltas["test_2017_mscoco"]).statistic
    pearson = stats.pearsonr(deltas["test_2016_flickr"], deltas["test_2017_mscoco"]).statistic
    print(f"cross-domain single-head deltas ({len(inventory.heads)} heads, {cross_s:.1f}s): "
          f"Spearman {spearman:.3f}, Pearson {pearson:.3f}")
    half = {f"{s}_50": f"{curves[s][5][2]:.2f}" for s in SCOPES}
    common.result("multi30k_pruning", baseline=f"{baseline:.2f}", **half, spearman_flickr_mscoco=f"{spearman:.3f}",
                  pearson_flickr_mscoco=f"{pearson:.3f}")


if __name__ == "__main__":
    main()
