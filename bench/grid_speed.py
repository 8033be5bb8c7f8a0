"""Benchmark: exhaustive-grid evaluation with compute reuse against the plain per-mask loop.

Both sides run in one process, on the same machine, interleaved (classifier: layer by layer;
translation: call by call) so that a change in the machine's load hits both, through the real
task adapters:

* plain: ``sweep.reuse: false, masks_per_batch: 1``: one full evaluation per mask, the way
  the anchors (the paper's scripts, TransformerLens) run a grid;
* reuse: ``sweep.reuse: true, masks_per_batch: 0``: masks packed into one forward pass /
  beam search (automatic size from the memory budget), classifier masks starting at their
  first gated layer from cached baseline states, translation masks sharing the cached
  encoder output (decoder heads) or encoder prefix (encoder heads).
Each side gets a fresh adapter (reuse builds its caches inside its timed calls) and masks go
in calls of ``masks_per_batch or 8`` as the driver sends them. A third side, not in the
ratio, runs the plain path with the same packing as reuse (reuse: false, masks_per_batch: 0),
which separates what packing gives from what reuse gives.

Classifier: a 6-layer, 12-head BERT (hidden 384 = 12 x 32, intermediate 1536), randomly
initialised (seeded; initializer_range 0.2 so that predictions depend on the input and on
heads), word-level tokenizer over the SST-2 training vocabulary, 1000 sentences of SST-2 dev
(../shared/data/sst2; generated sentences when absent): ``bench/classifier.py``. Masks timed: ``--classifier-masks``
single-head and as many all-but-one masks per layer (heads spread over the layer), the same
masks on both sides.

Translation: a 6+6-layer fairseq Transformer (d=128, 4 heads, ffn 512) trained briefly on
Multi30k en-fr (cached in ~/.cache/headsweep/bench; ``--train-minutes``), beam 5, 500
sentences of test_2016_flickr; ``--translation-masks`` single-head masks spread evenly over
the 72 heads (all three attention types, all layers), sent in one call per 8 masks. Without
../shared/data: the synthetic task of the demo.

torch runs on ``--threads`` threads, both sides alike (default: every core, as a worker would; on two
idle cores: classifier 2.14, translation 1.52; with ``--threads 1``: 2.04 and 1.36, because packing
masks into one beam search pays off more when the larger products spread over cores). Memory, per
side: the highest resident set size sampled every 20 ms during its calls (all adapters live in
the one process), the most it rose above its value at the start of one call (after
``malloc_trim``, so freed memory does not hide a call's own), and the bytes of baseline state
the reuse side keeps between calls.

Run: ``python -m bench.grid_speed`` (``--smoke``: tiny models and data, seconds). Each part prints its line as
soon as it is measured: ``RESULT grid_classifier ratio=<plain_s/reuse_s> max_abs_delta_diff=<x>``, then
``RESULT grid_translation ratio=<plain_s/reuse_s> identical_hypotheses=<true|false>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path

from bench import classifier, common, multi30k
from bench.measure import PeakRSS, mib, run_grid, spread
from headsweep.sweep.cluster.dispatch import units_per_call  # the driver's masks per call

N_TRANSLATION = 500
N_SYNTHETIC_TRAIN = 3000  # training pairs of the synthetic translation task (without Multi30k)


@common.on_smoke
def use_smoke() -> None:
    """The translation part's smoke sizes (the classifier's and Multi30k's switch with their modules)."""
    global N_TRANSLATION, N_SYNTHETIC_TRAIN
    N_TRANSLATION, N_SYNTHETIC_TRAIN = common.SMOKE_EXAMPLES, 300


def report(kind: str, seconds: dict, n: int, peak: PeakRSS, kept: int) -> None:
    """Seconds and memory of each side, and what packing alone and reuse over packing give."""
    for k, s in seconds.items():
        print(f"  {k:<13} {s:7.1f}s  ({s / n:.2f}s a mask)  peak RSS {mib(peak.peak[f'{kind}_{k}'])}, "
              f"at most {mib(peak.rise[f'{kind}_{k}'])} above a call's start")
    print(f"  reuse keeps {mib(kept)} of baseline states between calls; packing alone: "
          f"x{seconds['plain'] / seconds['plain_packed']:.2f}; reuse over packed plain: "
          f"x{seconds['plain_packed'] / seconds['reuse']:.2f}", flush=True)


def loss_diff(a: list, b: list) -> str:
    """The largest per-example loss difference between two sides' outputs, or why there is none."""
    pairs = [(x.loss, y.loss) for x, y in zip(a, b, strict=True) if x.loss is not None and y.loss is not None]
    if not pairs:
        return "not computed (RuntimeOptions.loss off, the default)"
    return f"{max(float(abs(x - y).max()) for x, y in pairs):.2e}"


# -- classifier ---------------------------------------------------------------------------------
def classifier_bench(args: argparse.Namespace, peak: PeakRSS, workdir: Path) -> str:
    """The classifier part: its grid on the three sides, interleaved layer by layer; its RESULT line."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    model_dir, data, source = classifier.save_classifier(workdir)

    sides = {
        "plain": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=1, reuse=False),
        "reuse": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=0, reuse=True),
        "plain_packed": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=0, reuse=False),
    }
    tasks = {k: load_classifier(ClassifierModel(path=str(model_dir)), ClassifierData(path=str(data)), o)
             for k, o in sides.items()}
    info = tasks["plain"].describe()
    lengths = [inputs["input_ids"].shape[1] for _, inputs in tasks["plain"].batches]
    print(f"classifier: {source}, {info.n_examples} sentences, batches of {args.batch_size} "
          f"(padded length {min(lengths)}..{max(lengths)}), {classifier.classifier_shape()}, "
          f"hidden {classifier.CLASSIFIER['hidden_size']}, random init; reuse packs "
          f"{tasks['reuse'].masks_per_forward()} masks per forward", flush=True)
    baselines = {k: t.evaluate([[]])[0] for k, t in tasks.items()}

    chosen = spread(classifier.CLASSIFIER["num_attention_heads"], args.classifier_masks)
    by_layer = []
    for shape in info.inventory.layers:
        heads = shape.heads()
        by_layer.append([[heads[h]] for h in chosen] + [[o for o in heads if o != heads[h]] for h in chosen])
    outs = {k: [] for k in sides}
    seconds = dict.fromkeys(sides, 0.0)
    for layer, masks in enumerate(by_layer):
        for k in sides:
            got, s = run_grid(tasks[k], masks, sides[k], peak, f"classifier_{k}")
            outs[k] += got
            seconds[k] += s
        print(f"  layer {layer}: plain {seconds['plain']:.1f}s, reuse {seconds['reuse']:.1f}s, "
              f"plain packed {seconds['plain_packed']:.1f}s (cumulative)", flush=True)
    n = sum(len(m) for m in by_layer)

    def deltas(k):
        return [o.score - baselines[k].score for o in outs[k]]

    delta_diff = max(abs(a - b) for a, b in zip(deltas("plain"), deltas("reuse"), strict=True))
    changed = sum(abs(d) > 0 for d in deltas("plain"))
    kept = tasks["reuse"]._reuse.kept_bytes if tasks["reuse"]._reuse is not None else 0
    print(f"classifier grid: {n} masks ({len(chosen)} single-head + {len(chosen)} all-but-one per layer); "
          f"{changed} change accuracy; baseline accuracy {baselines['plain'].score:.4f}; "
          f"max |loss diff| per example, reuse vs plain: {loss_diff(outs['plain'], outs['reuse'])}")
    report("classifier", seconds, n, peak, kept)
    return common.result("grid_classifier", ratio=f"{seconds['plain'] / seconds['reuse']:.2f}",
                         max_abs_delta_diff=f"{delta_diff:.3g}")


# -- translation --------------------------------------------------------------------------------
def translation_settings(train_minutes: float):
    """The 6+6-layer model's ``TrainSettings`` (the smoke model's in smoke mode)."""
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    return common.shrink(TrainSettings(
        encoder_layers=6, decoder_layers=6, embed_dim=128, ffn_dim=512, attention_heads=4, dropout=0.1,
        share_all_embeddings=True, share_decoder_input_output_embed=True, lr=2e-3, warmup_updates=300,
        clip_norm=1.0, label_smoothing=0.1, max_tokens=4096, max_epochs=40, max_seconds=train_minutes * 60, seed=1,
    ))


def translation_model(args: argparse.Namespace, workdir: Path):
    """(model config, data config, source): the cached Multi30k 6+6 model, or the synthetic task."""
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    # Capped hypothesis length (2 x source + 10): a briefly trained model must not babble for 200 steps.
    decode = {"beam": 5, "max_len_a": 2.0, "max_len_b": 10}
    settings = translation_settings(args.train_minutes)
    if multi30k.DATA.is_dir():
        key = hashlib.sha256(json.dumps([multi30k.VOCAB, repr(settings)]).encode()).hexdigest()[:10]
        cache = multi30k.CACHE / f"grid_speed_6x6_{multi30k.SRC}_{multi30k.TGT}_{key}"
        cache.mkdir(parents=True, exist_ok=True)
        checkpoint = cache / "checkpoints" / "checkpoint_last.pt"
        done = cache / "checkpoints" / "trained.json"
        spm_model, data_bin = multi30k.prepare(cache)
        if not done.exists():
            from headsweep.workers.families.fairseq_translation.train import train_translation

            result = train_translation(data_bin, cache / "checkpoints", multi30k.SRC, multi30k.TGT, settings)
            done.write_text(f"{result.epochs} epochs, {result.updates} updates, {result.seconds:.0f}s, "
                            f"valid loss {result.valid_loss}\n")
        return (TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), **decode),
                multi30k.test_data(spm_model, N_TRANSLATION),
                f"Multi30k {multi30k.TEST} (first {N_TRANSLATION}), model: {done.read_text().strip()}")
    from headsweep.sweep.demo.translation import prepare_synthetic
    from headsweep.workers.families.fairseq_translation.train import train_translation

    data = prepare_synthetic(workdir / "synthetic", n_train=N_SYNTHETIC_TRAIN, n_valid=100, n_test=N_TRANSLATION,
                             seed=3)
    result = train_translation(data.data_bin, workdir / "synthetic" / "checkpoints", "src", "tgt", settings)
    return (TranslationModel(checkpoint=str(result.checkpoint), data_bin=str(data.data_bin), **decode),
            TranslationData(data_bin=str(data.data_bin), split="test"),
            f"synthetic task ({N_TRANSLATION} test pairs; Multi30k absent)")


def translation_bench(args: argparse.Namespace, peak: PeakRSS, workdir: Path) -> str:
    """The translation part: its masks on the three sides, interleaved call by call; its RESULT line."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation

    model_cfg, data_cfg, source = translation_model(args, workdir)
    sides = {
        "plain": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=1, reuse=False),
        "reuse": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=0, reuse=True),
        "plain_packed": RuntimeOptions(batch_size=args.batch_size, masks_per_batch=0, reuse=False),
    }
    tasks = {k: load_translation(model_cfg, data_cfg, o) for k, o in sides.items()}
    info = tasks["plain"].describe()
    shape = translation_settings(args.train_minutes)
    print(f"translation: {source}; {info.n_examples} sentences, beam 5, {shape.encoder_layers}+{shape.decoder_layers}"
          f" layers x {shape.attention_heads} heads, d={shape.embed_dim}; "
          f"reuse packs {tasks['reuse'].masks_per_forward()} masks per search", flush=True)
    baselines = {k: t.evaluate([[]])[0] for k, t in tasks.items()}

    heads = info.inventory.heads
    masks = [[heads[i]] for i in spread(len(heads), args.translation_masks)]
    outs = {k: [] for k in sides}
    seconds = dict.fromkeys(sides, 0.0)
    call = units_per_call(sides["reuse"].masks_per_batch)
    for first in range(0, len(masks), call):
        for k in sides:
            got, s = run_grid(tasks[k], masks[first : first + call], sides[k], peak, f"translation_{k}")
            outs[k] += got
            seconds[k] += s
        print(f"  masks {first}..{first + call - 1}: plain {seconds['plain']:.1f}s, reuse {seconds['reuse']:.1f}s, "
              f"plain packed {seconds['plain_packed']:.1f}s (cumulative)", flush=True)
    n = len(masks)
    identical = all(a.outputs == b.outputs for a, b in zip(outs["plain"], outs["reuse"], strict=True))
    identical = identical and baselines["plain"].outputs == baselines["reuse"].outputs
    changed = sum(o.outputs != baselines["plain"].outputs for o in outs["plain"])
    kept = tasks["reuse"]._reuse.kept_bytes if tasks["reuse"]._reuse is not None else 0
    print(f"translation grid: {n} single-head masks ({', '.join(str(m[0]) for m in masks)}); "
          f"{changed} change some hypothesis; baseline BLEU {baselines['plain'].score:.2f}; "
          f"max |loss diff| per sentence, reuse vs plain: {loss_diff(outs['plain'], outs['reuse'])}")
    report("translation", seconds, n, peak, kept)
    return common.result("grid_translation", ratio=f"{seconds['plain'] / seconds['reuse']:.2f}",
                         identical_hypotheses=str(identical).lower())


def main() -> None:
    """Time both parts, each printing its RESULT line as soon as it is measured."""
    parser = common.command_line(__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for both sides (default: every core)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classifier-masks", type=int, default=2,
                        help="single-head (and as many all-but-one) masks per layer (12: the whole grid)")
    parser.add_argument("--translation-masks", type=int, default=8,
                        help="single-head masks, spread evenly over the 72 heads (72: the whole grid)")
    parser.add_argument("--train-minutes", type=float, default=4.0)
    parser.add_argument("--skip", choices=["classifier", "translation"], default=None)
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.threads, args.batch_size, args.classifier_masks, args.translation_masks = 1, 8, 1, 3
    common.quiet_logging()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    peak = PeakRSS()
    with tempfile.TemporaryDirectory() as tmp:
        # Each part prints its RESULT line when done: a failure in the next part does not lose it.
        if args.skip != "classifier":
            classifier_bench(args, peak, Path(tmp))
        if args.skip != "translation":
            translation_bench(args, peak, Path(tmp))
    peak.stop()


if __name__ == "__main__":
    main()
