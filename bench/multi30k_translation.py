"""Benchmark: single-head and all-but-one grids of a small fairseq Transformer on Multi30k en->fr.

Trains (once; cached under ~/.cache/headsweep/bench/) a 3+3-layer, 4-head, d=128 Transformer
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

Usage: python bench/multi30k_translation.py [--max-examples N] [--train-minutes M] [--beam B] [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import sys
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
import common  # noqa: E402  (RESULT lines, cache, smoke mode)

DATA = common.DATA / "multi30k"
CACHE = common.CACHE
SRC, TGT = "en", "fr"
VOCAB = 4000


def skip(reason: str) -> None:
    print(f"SKIP multi30k_grid: {reason}")
    sys.exit(0)


def use_smoke() -> None:
    """Smoke mode for every Multi30k benchmark: the first sentences of each file, a small vocabulary, and the
    smoke cache (the tiny model itself comes from ``common.shrink`` in the settings)."""
    global DATA, CACHE, VOCAB
    DATA, CACHE, VOCAB = common.smoke_data() / "multi30k", common.smoke_cache(), common.SMOKE_VOCAB


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def settings(train_minutes: float, threads: int):
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    return common.shrink(TrainSettings(threads=threads,
        encoder_layers=3, decoder_layers=3, embed_dim=128, ffn_dim=512, attention_heads=4,
        dropout=0.1, share_all_embeddings=True, share_decoder_input_output_embed=True,
        lr=2e-3, warmup_updates=300, clip_norm=1.0, label_smoothing=0.1, max_tokens=4096,
        max_epochs=40, max_seconds=train_minutes * 60, seed=1,
    ))


def prepare(workdir: Path, vocab: int | None = None) -> tuple[Path, Path]:
    """A joint SentencePiece model of ``vocab`` pieces (default ``VOCAB``) and a fairseq data-bin of the
    train/valid splits."""
    import sentencepiece as spm

    from headsweep.workers.families.fairseq_translation.train import write_data_bin

    vocab = vocab or VOCAB
    spm_model = workdir / "spm.model"
    data_bin = workdir / "data-bin"
    if not spm_model.exists():
        text = workdir / "spm_train.txt"
        lines = read_gz(DATA / f"train.{SRC}.gz") + read_gz(DATA / f"train.{TGT}.gz")
        text.write_text("\n".join(lines) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(workdir / "spm"), vocab_size=vocab, model_type="bpe",
            character_coverage=1.0, num_threads=2, minloglevel=2,
        )
        text.unlink()
    if not (data_bin / f"dict.{TGT}.txt").exists():
        sp = spm.SentencePieceProcessor(model_file=str(spm_model))

        def encode(lines: list[str]) -> list[str]:
            return [" ".join(sp.encode(line, out_type=str)) for line in lines]

        splits = {
            split: (encode(read_gz(DATA / f"{split}.{SRC}.gz")), encode(read_gz(DATA / f"{split}.{TGT}.gz")))
            for split in ("train", "valid" if (DATA / "valid.en.gz").exists() else "val")
        }
        splits = {("valid" if k == "val" else k): v for k, v in splits.items()}
        write_data_bin(data_bin, splits, SRC, TGT, joint_dictionary=True)
    return spm_model, data_bin


def train(workdir: Path, train_minutes: float, threads: int) -> Path:
    from headsweep.workers.families.fairseq_translation.train import train_translation

    checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
    done = workdir / "checkpoints" / "trained.json"
    if done.exists():
        print(f"using cached model {checkpoint} ({done.read_text().strip()})")
        return checkpoint
    _spm_model, data_bin = prepare(workdir)
    start = time.perf_counter()
    result = train_translation(data_bin, workdir / "checkpoints", SRC, TGT, settings(train_minutes, threads),
                               log=lambda msg: print(msg, flush=True))
    summary = (f"trained {result.epochs} epochs, {result.updates} updates in {time.perf_counter() - start:.0f}s, "
               f"valid loss {result.valid_loss:.3f} nats/token")
    print(summary, flush=True)
    # Written last: a run stopped mid-training leaves no marker and is trained again.
    done.write_text(summary + "\n")
    return checkpoint


def cached_model(threads: int, train_minutes: float = 12.0) -> tuple[Path, Path, Path]:
    """(checkpoint, SentencePiece model, data-bin) of this benchmark's model: trained once with ``train_minutes``
    and cached under a key of its settings, so every Multi30k benchmark shares it."""
    trained = settings(train_minutes, threads=0)  # the thread count does not change the model
    key = hashlib.sha256(json.dumps([VOCAB, repr(trained)]).encode()).hexdigest()[:10]
    workdir = CACHE / f"multi30k_{SRC}_{TGT}_{key}"
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = train(workdir, train_minutes, threads)
    spm_model, data_bin = prepare(workdir)
    return checkpoint, spm_model, data_bin


def grids(inventory) -> tuple[list[list], list[list]]:
    """Masks of Michel et al.'s single-head (sec. 3.2) and all-but-one (sec. 3.3) experiments."""
    single = [[h] for h in inventory.heads]
    all_but_one = [[o for o in shape.heads() if o != h] for shape in inventory.layers for h in shape.heads()]
    return single, all_but_one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=None,
                        help="decode only the first N test sentences (default: all 1,000)")
    parser.add_argument("--train-minutes", type=float, default=12.0)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--masks-per-batch", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: two threads on two busy cores thrash, measured 5-10x slower)")
    common.add_argument(parser)
    args = parser.parse_args()
    if common.enable_smoke(args):
        use_smoke()
        args.max_examples = common.SMOKE_EXAMPLES

    if not DATA.is_dir():
        skip(f"{DATA} not found (the shared data folder beside the repository)")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        skip("the sentencepiece package is not installed (pip install sentencepiece)")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)

    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
    from headsweep.workers.family import RuntimeOptions

    t0 = time.perf_counter()
    checkpoint, spm_model, data_bin = cached_model(args.threads, args.train_minutes)
    print(f"model ready in {time.perf_counter() - t0:.0f}s", flush=True)

    test = "test_2016_flickr"
    task = load_translation(
        TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam),
        TranslationData(source=str(DATA / f"{test}.{SRC}.gz"), target=str(DATA / f"{test}.{TGT}.gz"),
                        sentencepiece_model=str(spm_model), max_examples=args.max_examples, name=test),
        RuntimeOptions(batch_size=args.batch_size, masks_per_batch=args.masks_per_batch),
    )
    info = task.describe()
    n_total = len(read_gz(DATA / f"{test}.{SRC}.gz"))
    subset = "" if info.n_examples == n_total else f" (a subset: the first {info.n_examples} of {n_total} sentences)"
    print(f"decoding {test}{subset}, beam {args.beam}, {len(info.inventory.heads)} heads, "
          f"masks per search {task.masks_per_forward()}; {info.facts['sacrebleu_signature']}", flush=True)

    start = time.perf_counter()
    baseline = task.evaluate([[]])[0]
    baseline_s = time.perf_counter() - start
    print(f"baseline BLEU {baseline.score:.2f} in {baseline_s:.1f}s; e.g. {baseline.outputs[0]!r} "
          f"(ref {info.references[0]!r})", flush=True)

    single, all_but_one = grids(info.inventory)
    start = time.perf_counter()
    single_out = task.evaluate(single)
    single_s = time.perf_counter() - start
    print(f"\nsingle-head ablation: {len(single)} decodes in {single_s:.1f}s ({single_s / len(single):.2f}s each)")
    for mask, out in zip(single, single_out, strict=True):
        print(f"  {mask[0]!s:<12} BLEU {out.score:6.2f}  delta {out.score - baseline.score:+6.2f}")

    start = time.perf_counter()
    abo_out = task.evaluate(all_but_one)
    abo_s = time.perf_counter() - start
    print(f"\nall-but-one-head: {len(all_but_one)} decodes in {abo_s:.1f}s ({abo_s / len(all_but_one):.2f}s each)")
    kept = [h for shape in info.inventory.layers for h in shape.heads()]
    best: dict[tuple[str, int], tuple[float, object]] = {}
    for head, out in zip(kept, abo_out, strict=True):
        print(f"  keep {head!s:<12} BLEU {out.score:6.2f}  delta {out.score - baseline.score:+6.2f}")
        key_ = (head.attention, head.layer)
        if key_ not in best or out.score > best[key_][0]:
            best[key_] = (out.score, head)
    print("best kept head per layer: " + ", ".join(f"{h} ({s:.2f})" for s, h in best.values()))
    print()
    common.result("multi30k_grid", bleu=f"{baseline.score:.2f}", heads=len(info.inventory.heads),
                  single_head_s=f"{single_s:.1f}", all_but_one_s=f"{abo_s:.1f}")


if __name__ == "__main__":
    main()
