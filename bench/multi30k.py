"""The Multi30k en->fr data and the fairseq models the Multi30k benchmarks train on it, each trained once and cached.

* the **small** model (:func:`cached_model`): 3+3 layers, 4 heads, d=128, a joint SentencePiece BPE of ``VOCAB``
  (4,000) pieces, trained for 12 minutes; why this model: ``bench/multi30k_translation.py``. Shared by
  multi30k_translation, multi30k_l0, multi30k_pruning, multi30k_roles (``--model small``), ablation_methods and
  screening.
* the **vs_fairseq** model (:func:`vs_fairseq_settings`, :func:`vs_fairseq_dir`): 3+3 layers, 8 heads, d=256, a
  joint BPE of ``VS_FAIRSEQ_VOCAB`` (8,000) pieces, trained and measured by ``bench/translation_vs_fairseq.py``;
  multi30k_roles reads it.

``DATA``, ``CACHE`` and the vocabularies change in smoke mode (``use_smoke``): read them as attributes of this
module, after ``common.enable_smoke``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from bench import common

DATA = common.DATA / "multi30k"
CACHE = common.CACHE
SRC, TGT = "en", "fr"
TEST = "test_2016_flickr"
VOCAB = 4000
VS_FAIRSEQ_VOCAB = 8000
VS_FAIRSEQ_MINUTES = 30.0  # the vs_fairseq model's first training stage (part of its cache key)


@common.on_smoke
def use_smoke() -> None:
    """The first sentences of each file, small vocabularies and the smoke cache (the tiny model itself comes from
    ``common.shrink`` in the settings)."""
    global DATA, CACHE, VOCAB, VS_FAIRSEQ_VOCAB
    DATA, CACHE = common.smoke_data() / "multi30k", common.smoke_cache()
    VOCAB = VS_FAIRSEQ_VOCAB = common.SMOKE_VOCAB


def require(name: str) -> None:
    """Skip benchmark ``name`` (``SKIP`` line, exit 0) where the data folder or sentencepiece is absent."""
    if not DATA.is_dir():
        common.skip(name, f"{DATA} not found (the shared data folder beside the repository)")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        common.skip(name, "the sentencepiece package is not installed (pip install sentencepiece)")


def pair(split: str) -> tuple[Path, Path]:
    """The source and target files of ``split`` (``test_2016_flickr``, ``train``, ...)."""
    return DATA / f"{split}.{SRC}.gz", DATA / f"{split}.{TGT}.gz"


def test_data(spm_model: Path, max_examples: int | None, name: str = TEST):
    """headsweep's ``data`` section (``TranslationData``) of the test set ``name``: its first ``max_examples``
    sentences (None: all), segmented by ``spm_model``."""
    from headsweep.workers.families.fairseq_translation.config import TranslationData

    source, target = pair(name)
    return TranslationData(source=str(source), target=str(target), sentencepiece_model=str(spm_model),
                           max_examples=max_examples, name=name)


def settings(train_minutes: float, threads: int):
    """The small model's ``TrainSettings`` (the smoke model's in smoke mode)."""
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    return common.shrink(TrainSettings(threads=threads,
        encoder_layers=3, decoder_layers=3, embed_dim=128, ffn_dim=512, attention_heads=4,
        dropout=0.1, share_all_embeddings=True, share_decoder_input_output_embed=True,
        lr=2e-3, warmup_updates=300, clip_norm=1.0, label_smoothing=0.1, max_tokens=4096,
        max_epochs=40, max_seconds=train_minutes * 60, seed=1,
    ))


def prepare(workdir: Path, vocab: int | None = None) -> tuple[Path, Path]:
    """A joint SentencePiece model of ``vocab`` pieces (default ``VOCAB``) and a fairseq data-bin of the
    train/valid splits, made once in ``workdir``."""
    import sentencepiece as spm

    from headsweep.workers.families.fairseq_translation.train import write_data_bin

    vocab = vocab or VOCAB
    spm_model = workdir / "spm.model"
    data_bin = workdir / "data-bin"
    if not spm_model.exists():
        text = workdir / "spm_train.txt"
        lines = [line for path in pair("train") for line in common.read_gz(path)]
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

        splits = {split: tuple(encode(common.read_gz(path)) for path in pair(split))
                  for split in ("train", "valid" if (DATA / "valid.en.gz").exists() else "val")}
        splits = {("valid" if k == "val" else k): v for k, v in splits.items()}
        write_data_bin(data_bin, splits, SRC, TGT, joint_dictionary=True)
    return spm_model, data_bin


def train(workdir: Path, train_minutes: float, threads: int) -> Path:
    """The small model's checkpoint in ``workdir``: trained unless a finished training is cached there."""
    from headsweep.workers.families.fairseq_translation.train import train_translation

    checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
    done = workdir / "checkpoints" / "trained.json"
    if done.exists():
        print(f"using cached model {checkpoint} ({done.read_text().strip()})")
        return checkpoint
    _spm_model, data_bin = prepare(workdir)
    start = time.perf_counter()
    result = train_translation(data_bin, workdir / "checkpoints", SRC, TGT, settings(train_minutes, threads),
                               log=common.log)
    summary = (f"trained {result.epochs} epochs, {result.updates} updates in {time.perf_counter() - start:.0f}s, "
               f"valid loss {result.valid_loss:.3f} nats/token")
    print(summary, flush=True)
    # Written last: a run stopped mid-training leaves no marker and is trained again.
    done.write_text(summary + "\n")
    return checkpoint


def cached_model(threads: int, train_minutes: float = 12.0) -> tuple[Path, Path, Path]:
    """(checkpoint, SentencePiece model, data-bin) of the small model: trained once with ``train_minutes`` and
    cached under a key of its settings, so every Multi30k benchmark shares it."""
    trained = settings(train_minutes, threads=0)  # the thread count does not change the model
    key = hashlib.sha256(json.dumps([VOCAB, repr(trained)]).encode()).hexdigest()[:10]
    workdir = CACHE / f"multi30k_{SRC}_{TGT}_{key}"
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = train(workdir, train_minutes, threads)
    spm_model, data_bin = prepare(workdir)
    return checkpoint, spm_model, data_bin


def vs_fairseq_settings(minutes: float, threads: int):
    """The vs_fairseq model's ``TrainSettings``: 3+3 layers, 8 heads, d=256, ffn 1024, a shared 8k joint
    vocabulary, trained ``minutes``."""
    from headsweep.workers.families.fairseq_translation.train import TrainSettings

    return common.shrink(TrainSettings(
        threads=threads, encoder_layers=3, decoder_layers=3, embed_dim=256, ffn_dim=1024, attention_heads=8,
        dropout=0.1, share_all_embeddings=True, share_decoder_input_output_embed=True, lr=1.5e-3,
        warmup_updates=500, clip_norm=1.0, label_smoothing=0.1, max_tokens=4096, max_epochs=100,
        max_seconds=minutes * 60, seed=1,
    ))


def vs_fairseq_dir(minutes: float = VS_FAIRSEQ_MINUTES) -> Path:
    """The cache folder of the vs_fairseq model first trained ``minutes`` (the thread count does not enter the
    key)."""
    import dataclasses

    trained = dataclasses.replace(vs_fairseq_settings(minutes, threads=0), threads=0)
    key = hashlib.sha256(json.dumps([VS_FAIRSEQ_VOCAB, repr(trained)]).encode()).hexdigest()[:10]
    return CACHE / f"vs_fairseq_3x3_h8_d256_{SRC}_{TGT}_{key}"
