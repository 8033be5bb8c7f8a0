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
(../shared/data/sst2; generated sentences when absent). Masks timed: ``--classifier-masks``
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

Run: ``python bench/grid_speed.py`` (``--smoke``: tiny models and data, seconds). Each part prints its line as
soon as it is measured: ``RESULT grid_classifier ratio=<plain_s/reuse_s> max_abs_delta_diff=<x>``, then
``RESULT grid_translation ratio=<plain_s/reuse_s> identical_hypotheses=<true|false>``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))
import common  # noqa: E402  (RESULT lines, smoke mode)
import multi30k_translation as m30k  # noqa: E402  (Multi30k data, SentencePiece model, training cache)

from headsweep.sweep.run.dispatch import units_per_call  # noqa: E402  (the driver's masks per call)

SST2 = common.DATA / "sst2"
try:
    TRIM = ctypes.CDLL("libc.so.6")
except OSError:
    TRIM = None
N_CLASSIFIER, N_TRANSLATION = 1000, 500
CLASSIFIER = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}
N_SYNTHETIC_TRAIN = 3000  # training pairs of the synthetic translation task (without Multi30k)


def use_smoke() -> None:
    """Smoke mode for this benchmark and those that borrow its classifier: a 2x4 BERT of width 32 on the smoke
    copy of SST-2, and Multi30k's smoke mode for the translation part."""
    global SST2, N_CLASSIFIER, N_TRANSLATION, CLASSIFIER, N_SYNTHETIC_TRAIN
    SST2 = common.smoke_data() / "sst2"
    N_CLASSIFIER = N_TRANSLATION = common.SMOKE_EXAMPLES
    N_SYNTHETIC_TRAIN = 300
    CLASSIFIER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    m30k.use_smoke()


class PeakRSS:
    """Resident set size while a named phase runs, sampled by a thread: the highest seen, and the
    most it rose above its value at the start of one call (the call's transient memory)."""

    def __init__(self, every: float = 0.02):
        self.every, self.phase, self.peak, self.rise = every, None, {}, {}
        self._start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self, phase: str) -> None:
        rss = self.rss()
        self.peak[phase] = max(self.peak.get(phase, 0), rss)
        self.rise[phase] = max(self.rise.get(phase, 0), rss - self._start)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            phase = self.phase
            if phase is not None:
                self._sample(phase)

    def timed(self, phase: str, fn, *args):
        """Run ``fn(*args)`` as ``phase``; returns (result, seconds)."""
        if TRIM is not None:
            TRIM.malloc_trim(0)  # hand freed heap back, so that the rise measures this call alone
        self._start = self.rss()
        self._sample(phase)
        self.phase = phase
        start = time.perf_counter()
        try:
            return fn(*args), time.perf_counter() - start
        finally:
            self.phase = None
            self._sample(phase)

    def stop(self) -> None:
        self._stop.set()


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def report(kind: str, seconds: dict, n: int, peak: PeakRSS, kept: int) -> None:
    """Seconds and memory of each side, and what packing alone and reuse over packing give."""
    for k, s in seconds.items():
        print(f"  {k:<13} {s:7.1f}s  ({s / n:.2f}s a mask)  peak RSS {mib(peak.peak[f'{kind}_{k}'])}, "
              f"at most {mib(peak.rise[f'{kind}_{k}'])} above a call's start")
    print(f"  reuse keeps {mib(kept)} of baseline states between calls; packing alone: "
          f"x{seconds['plain'] / seconds['plain_packed']:.2f}; reuse over packed plain: "
          f"x{seconds['plain_packed'] / seconds['reuse']:.2f}", flush=True)


def run_grid(task, masks: list, options, peak: PeakRSS, phase: str) -> tuple[list, float]:
    """Evaluate ``masks`` in driver-sized calls; returns outputs and seconds."""
    outs, total = [], 0.0
    step = units_per_call(options.masks_per_batch)
    for i in range(0, len(masks), step):
        got, seconds = peak.timed(phase, task.evaluate, masks[i : i + step])
        outs += got
        total += seconds
    return outs, total


def spread(n: int, count: int) -> list[int]:
    """``count`` indices spread over range(n)."""
    count = min(count, n)
    return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)}) if count > 1 else [0]


def loss_diff(a: list, b: list) -> str:
    """The largest per-example loss difference between two sides' outputs, or why there is none."""
    pairs = [(x.loss, y.loss) for x, y in zip(a, b, strict=True) if x.loss is not None and y.loss is not None]
    if not pairs:
        return "not computed (RuntimeOptions.loss off, the default)"
    return f"{max(float(abs(x - y).max()) for x, y in pairs):.2e}"


# -- classifier ---------------------------------------------------------------------------------
def sst2_rows(n: int) -> tuple[list[tuple[str, str]], list[str], str]:
    """``n`` (sentence, label) rows to evaluate, training sentences for the vocabulary, and the source."""
    if (SST2 / "dev.tsv").exists() and (SST2 / "train.tsv").exists():
        def read(name):
            with open(SST2 / name, newline="", encoding="utf-8") as f:
                return [(r[0].strip(), r[1]) for r in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]
        return read("dev.tsv")[:n], [s for s, _ in read("train.tsv")], f"SST-2 dev (first {n})"
    from headsweep.sweep.demo.sentiment import generate

    rows = [(t, str(y)) for t, y in generate(n, seed=11)]
    return rows, [t for t, _ in generate(5000, seed=12)], "generated sentences (SST-2 absent)"


def word_tokenizer(sentences: list[str], size: int = 16000):
    """A word-level BERT-style tokenizer over the ``size`` most frequent words."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    counts = Counter(w for s in sentences for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(s.lower()))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in counts.most_common(size)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def classifier_shape() -> str:
    return f"{CLASSIFIER['num_hidden_layers']} layers x {CLASSIFIER['num_attention_heads']} heads"


def save_classifier(workdir: Path, n_examples: int | None = None) -> tuple[Path, Path, str]:
    """This benchmark's classifier (random BERT of ``CLASSIFIER``'s shape, 6x12 by default, word tokenizer over
    SST-2 train) and its first ``n_examples`` (default ``N_CLASSIFIER``) SST-2 dev rows, saved under ``workdir``:
    (model folder, data file, where the rows came from)."""
    n_examples = n_examples or N_CLASSIFIER
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    rows, train_text, source = sst2_rows(n_examples)
    tokenizer = word_tokenizer(train_text)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tokenizer), **CLASSIFIER, max_position_embeddings=128, num_labels=2,
                     initializer_range=0.2, id2label={0: "0", 1: "1"}, label2id={"0": 0, "1": 1})
    model_dir = workdir / f"bert-{CLASSIFIER['num_hidden_layers']}x{CLASSIFIER['num_attention_heads']}"
    BertForSequenceClassification(cfg).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = workdir / f"sst2-{n_examples}.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows), encoding="utf-8")
    return model_dir, data, source


def classifier_bench(args, peak: PeakRSS, workdir: Path) -> str:
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
    from headsweep.workers.family import RuntimeOptions

    model_dir, data, source = save_classifier(workdir)

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
          f"(padded length {min(lengths)}..{max(lengths)}), {classifier_shape()}, hidden {CLASSIFIER['hidden_size']}, "
          f"random init; reuse packs {tasks['reuse'].masks_per_forward()} masks per forward", flush=True)
    baselines = {k: t.evaluate([[]])[0] for k, t in tasks.items()}

    chosen = spread(CLASSIFIER["num_attention_heads"], args.classifier_masks)
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
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    return common.shrink(TrainSettings(
        encoder_layers=6, decoder_layers=6, embed_dim=128, ffn_dim=512, attention_heads=4, dropout=0.1,
        share_all_embeddings=True, share_decoder_input_output_embed=True, lr=2e-3, warmup_updates=300,
        clip_norm=1.0, label_smoothing=0.1, max_tokens=4096, max_epochs=40, max_seconds=train_minutes * 60, seed=1,
    ))


def translation_model(args, workdir: Path):
    """(model config, data config, source): the cached Multi30k 6+6 model, or the synthetic task."""
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    # Capped hypothesis length (2 x source + 10): a briefly trained model must not babble for 200 steps.
    decode = {"beam": 5, "max_len_a": 2.0, "max_len_b": 10}
    settings = translation_settings(args.train_minutes)
    if m30k.DATA.is_dir():
        key = hashlib.sha256(json.dumps([m30k.VOCAB, repr(settings)]).encode()).hexdigest()[:10]
        cache = m30k.CACHE / f"grid_speed_6x6_{m30k.SRC}_{m30k.TGT}_{key}"
        cache.mkdir(parents=True, exist_ok=True)
        checkpoint = cache / "checkpoints" / "checkpoint_last.pt"
        done = cache / "checkpoints" / "trained.json"
        spm_model, data_bin = m30k.prepare(cache)
        if not done.exists():
            from headsweep.workers.families.fairseq_translation.train import train_translation

            result = train_translation(data_bin, cache / "checkpoints", m30k.SRC, m30k.TGT, settings)
            done.write_text(f"{result.epochs} epochs, {result.updates} updates, {result.seconds:.0f}s, "
                            f"valid loss {result.valid_loss}\n")
        test = "test_2016_flickr"
        return (TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), **decode),
                TranslationData(source=str(m30k.DATA / f"{test}.{m30k.SRC}.gz"),
                                target=str(m30k.DATA / f"{test}.{m30k.TGT}.gz"),
                                sentencepiece_model=str(spm_model), max_examples=N_TRANSLATION, name=test),
                f"Multi30k {test} (first {N_TRANSLATION}), model: {done.read_text().strip()}")
    from headsweep.sweep.demo.translation import prepare_synthetic
    from headsweep.workers.families.fairseq_translation.train import train_translation

    data = prepare_synthetic(workdir / "synthetic", n_train=N_SYNTHETIC_TRAIN, n_valid=100, n_test=N_TRANSLATION,
                             seed=3)
    result = train_translation(data.data_bin, workdir / "synthetic" / "checkpoints", "src", "tgt", settings)
    return (TranslationModel(checkpoint=str(result.checkpoint), data_bin=str(data.data_bin), **decode),
            TranslationData(data_bin=str(data.data_bin), split="test"),
            f"synthetic task ({N_TRANSLATION} test pairs; Multi30k absent)")


def translation_bench(args, peak: PeakRSS, workdir: Path) -> str:
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.family import RuntimeOptions

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for both sides (default: every core)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classifier-masks", type=int, default=2,
                        help="single-head (and as many all-but-one) masks per layer (12: the whole grid)")
    parser.add_argument("--translation-masks", type=int, default=8,
                        help="single-head masks, spread evenly over the 72 heads (72: the whole grid)")
    parser.add_argument("--train-minutes", type=float, default=4.0)
    parser.add_argument("--skip", choices=["classifier", "translation"], default=None)
    common.add_argument(parser)
    args = parser.parse_args()
    if common.enable_smoke(args):
        use_smoke()
        args.threads, args.batch_size, args.classifier_masks, args.translation_masks = 1, 8, 1, 3
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
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
