"""Train a real fairseq Transformer translation model from parallel text lines.

Everything that matters is fairseq's own: its dictionaries and binarised (mmap) data-bin
layout, its ``transformer`` architecture, the ``label_smoothed_cross_entropy`` criterion,
Adam with the inverse-sqrt schedule, and its ``Trainer``. Checkpoints have the structure
``Trainer.save_checkpoint`` writes, minus the pickled metric meters, so they load with
``checkpoint_utils.load_model_ensemble_and_task`` under torch's default
``weights_only=True`` (no ``trusted`` flag needed).

Used by the demo (a tiny model on synthetic data), by the Multi30k benchmark, and for
one checkpoint per epoch (importance over training).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headsweep.errors import HeadsweepError

logger = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """Model size and optimisation; the defaults are a tiny model for CPU demos."""

    encoder_layers: int = 2
    decoder_layers: int = 2
    embed_dim: int = 64
    ffn_dim: int = 128
    attention_heads: int = 4
    dropout: float = 0.1
    attention_dropout: float = 0.0
    share_decoder_input_output_embed: bool = True
    share_all_embeddings: bool = False
    lr: float = 3e-3
    warmup_updates: int = 50
    clip_norm: float = 0.0
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    max_tokens: int = 1024
    max_epochs: int = 10
    max_seconds: float | None = None
    max_positions: int = 256
    seed: int = 1
    # torch threads while training (0: torch's default). One by default: these models are too
    # small to gain from more, and two threads on two cores that another process also uses
    # thrash (measured here: 0.05 s -> 3 s per update of the demo model).
    threads: int = 1
    save_every_epoch: bool = False
    save_optimizer_state: bool = False
    extra_args: list[str] = field(default_factory=list)


@dataclass
class TrainResult:
    """What a training run left on disk and how it went."""

    checkpoint: Path
    epoch_checkpoints: list[Path]
    epochs: int
    updates: int
    seconds: float
    train_loss: float
    valid_loss: float | None


# -- dictionaries and binarised data --------------------------------------------------------
def build_dictionary(lines: Sequence[str], threshold: int = 0, nwords: int = -1, padding_factor: int = 8):
    """A fairseq ``Dictionary`` over the space-separated tokens of ``lines``, finalised as
    ``fairseq-preprocess`` does (sorted by count, padded to a multiple of ``padding_factor``)."""
    from fairseq.data import Dictionary

    d = Dictionary()
    for line in lines:
        for tok in line.split():
            d.add_symbol(tok)
    d.finalize(threshold=threshold, nwords=nwords, padding_factor=padding_factor)
    return d


def binarize(lines: Sequence[str], dictionary, prefix: Path) -> float:
    """Write ``prefix.bin``/``prefix.idx`` (mmap) as ``fairseq-preprocess`` does; return the unknown-token rate."""
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=len(dictionary))
    n_tok = n_unk = 0
    for line in lines:
        ids = dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).long()
        n_tok += ids.numel() - 1
        n_unk += int((ids == dictionary.unk()).sum())
        builder.add_item(ids)
    builder.finalize(f"{prefix}.idx")
    return n_unk / max(1, n_tok)


def write_data_bin(
    dest: str | Path,
    splits: dict[str, tuple[Sequence[str], Sequence[str]]],
    source_lang: str,
    target_lang: str,
    joint_dictionary: bool = False,
    threshold: int = 0,
) -> Path:
    """A fairseq data-bin folder: ``dict.<lang>.txt`` built on the ``train`` split, and every
    split binarised as ``<split>.<src>-<tgt>.<lang>.{bin,idx}``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if "train" not in splits:
        raise HeadsweepError("write_data_bin needs a 'train' split to build the dictionaries")
    src_train, tgt_train = splits["train"]
    if joint_dictionary:
        src_dict = tgt_dict = build_dictionary([*src_train, *tgt_train], threshold=threshold)
    else:
        src_dict = build_dictionary(src_train, threshold=threshold)
        tgt_dict = build_dictionary(tgt_train, threshold=threshold)
    src_dict.save(str(dest / f"dict.{source_lang}.txt"))
    tgt_dict.save(str(dest / f"dict.{target_lang}.txt"))
    for split, (src, tgt) in splits.items():
        if len(src) != len(tgt):
            raise HeadsweepError(f"split {split!r}: {len(src)} source lines but {len(tgt)} target lines")
        pair = f"{source_lang}-{target_lang}"
        binarize(src, src_dict, dest / f"{split}.{pair}.{source_lang}")
        binarize(tgt, tgt_dict, dest / f"{split}.{pair}.{target_lang}")
    return dest


# -- training -------------------------------------------------------------------------------
def _fairseq_args(data_bin: Path, save_dir: Path, s: TrainSettings, src: str, tgt: str, valid: bool) -> list[str]:
    args = [
        str(data_bin), "--task", "translation", "--source-lang", src, "--target-lang", tgt,
        "--arch", "transformer",
        "--encoder-layers", str(s.encoder_layers), "--decoder-layers", str(s.decoder_layers),
        "--encoder-embed-dim", str(s.embed_dim), "--decoder-embed-dim", str(s.embed_dim),
        "--encoder-ffn-embed-dim", str(s.ffn_dim), "--decoder-ffn-embed-dim", str(s.ffn_dim),
        "--encoder-attention-heads", str(s.attention_heads), "--decoder-attention-heads", str(s.attention_heads),
        "--dropout", str(s.dropout), "--attention-dropout", str(s.attention_dropout),
        "--max-source-positions", str(s.max_positions), "--max-target-positions", str(s.max_positions),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", str(s.label_smoothing),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(s.lr), "--weight-decay", str(s.weight_decay),
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(s.warmup_updates), "--warmup-init-lr", "1e-7",
        "--clip-norm", str(s.clip_norm), "--max-tokens", str(s.max_tokens), "--seed", str(s.seed),
        "--max-epoch", str(s.max_epochs), "--cpu", "--num-workers", "0", "--dataset-impl", "mmap",
        "--save-dir", str(save_dir), "--no-progress-bar", "--skip-invalid-size-inputs-valid-test",
    ]
    if s.share_decoder_input_output_embed:
        args.append("--share-decoder-input-output-embed")
    if s.share_all_embeddings:
        args.append("--share-all-embeddings")
    if not s.save_optimizer_state:
        args.append("--no-save-optimizer-state")
    if not valid:
        args.append("--disable-validation")
    return args + list(s.extra_args)


def _checkpoint_state(trainer, epoch: int, updates_in_epoch: int, seconds: float) -> dict:
    # Trainer.state_dict() minus extra_state["metrics"]: the meters are pickled Python objects
    # that would make the file need weights_only=False (an arbitrary-code load) to read back.
    state = trainer.state_dict()
    model_cfg = state["cfg"].get("model")
    if isinstance(model_cfg, argparse.Namespace):
        # Legacy architectures keep their options as a Namespace inside the config; fairseq
        # rebuilds the same model from the plain mapping, which needs no unpickling.
        state["cfg"]["model"] = dict(vars(model_cfg))
    state["extra_state"] = {
        "train_iterator": {"epoch": epoch, "iterations_in_epoch": updates_in_epoch, "shuffle": True},
        "previous_training_time": seconds,
    }
    return state


def _mean_loss(trainer, task, split: str) -> float | None:
    # Mean label-smoothed loss per target token in nats, over a whole split.
    if split not in task.datasets:
        return None
    itr = trainer.get_valid_iterator(split).next_epoch_itr(shuffle=False)
    total = tokens = 0.0
    for sample in itr:
        out = trainer.valid_step(sample)
        if out and "loss" in out:
            # Trainer reports the loss in bits per target token.
            total += float(out["loss"]) * math.log(2) * float(out["sample_size"])
            tokens += float(out["sample_size"])
    return total / tokens if tokens else None


def train_translation(
    data_bin: str | Path,
    save_dir: str | Path,
    source_lang: str,
    target_lang: str,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train a fairseq ``transformer`` on ``data_bin``'s ``train`` split (validating on ``valid``
    when it exists) and save ``checkpoint_last.pt`` (and ``checkpoint<N>.pt`` every epoch when
    ``settings.save_every_epoch``) in ``save_dir``.

    Training stops after ``max_epochs`` or at the first update past ``max_seconds``, whichever
    comes first; the last (possibly partial) epoch is saved either way.
    """
    s = settings or TrainSettings()
    data_bin, save_dir = Path(data_bin), Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    say = log or (lambda msg: logger.info(msg))
    threads_before = torch.get_num_threads()
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    try:
        return _train(data_bin, save_dir, source_lang, target_lang, s, say)
    finally:
        torch.set_num_threads(threads_before)


def _train(data_bin: Path, save_dir: Path, source_lang: str, target_lang: str, s: TrainSettings,
           say: Callable[[str], None]) -> TrainResult:
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    has_valid = (data_bin / f"valid.{source_lang}-{target_lang}.{source_lang}.idx").exists()
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=_fairseq_args(data_bin, save_dir, s, source_lang,
                                                                          target_lang, has_valid))
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)

    task = tasks.setup_task(cfg.task)
    task.load_dataset("train", combine=False, epoch=1)
    if has_valid:
        task.load_dataset("valid", combine=False, epoch=1)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"training fairseq transformer: {n_params / 1e6:.2f}M parameters, "
        f"{len(task.datasets['train'])} training pairs, {s.encoder_layers}+{s.decoder_layers} layers, "
        f"{s.attention_heads} heads, d={s.embed_dim}")

    epoch_itr = trainer.get_train_iterator(epoch=1, load_dataset=False)
    start = time.perf_counter()
    epoch_checkpoints: list[Path] = []
    train_loss = float("nan")
    valid_loss = None
    epoch = 0
    out_of_time = False
    while epoch < s.max_epochs and not out_of_time:
        itr = epoch_itr.next_epoch_itr(shuffle=True)
        epoch = epoch_itr.epoch
        losses, weights, steps = 0.0, 0.0, 0
        for sample in itr:
            out = trainer.train_step([sample])
            steps += 1
            if out is not None and "loss" in out:
                # Trainer logs the loss in bits per target token; keep nats, like the evaluator.
                losses += float(out["loss"]) * float(out.get("sample_size", 1.0)) * math.log(2)
                weights += float(out.get("sample_size", 1.0))
            if s.max_seconds is not None and time.perf_counter() - start >= s.max_seconds:
                # Stop inside the epoch: on a busy machine one epoch can outlast the whole budget.
                out_of_time = True
                break
        train_loss = losses / max(1.0, weights)
        valid_loss = _mean_loss(trainer, task, "valid") if has_valid else None
        trainer.lr_step(epoch, valid_loss)
        seconds = time.perf_counter() - start
        state = _checkpoint_state(trainer, epoch, steps if out_of_time else 0, seconds)
        if s.save_every_epoch:
            path = save_dir / f"checkpoint{epoch}.pt"
            _save(state, path)
            epoch_checkpoints.append(path)
        _save(state, save_dir / "checkpoint_last.pt")
        shown_valid = f", valid loss {valid_loss:.3f}" if valid_loss is not None else ""
        partial = f" (stopped after {steps} updates: {s.max_seconds:.0f}s time budget reached)" if out_of_time else ""
        say(f"epoch {epoch}: train loss {train_loss:.3f}{shown_valid}, {trainer.get_num_updates()} updates, "
            f"{seconds:.0f}s{partial}")
        if not out_of_time and epoch < s.max_epochs:
            epoch_itr = trainer.get_train_iterator(epoch=epoch + 1, load_dataset=False)
    return TrainResult(
        checkpoint=save_dir / "checkpoint_last.pt",
        epoch_checkpoints=epoch_checkpoints,
        epochs=epoch,
        updates=trainer.get_num_updates(),
        seconds=time.perf_counter() - start,
        train_loss=train_loss,
        valid_loss=valid_loss,
    )


def _save(state: dict, path: Path) -> None:
    from fairseq import checkpoint_utils

    # fairseq's own writer (it writes to a temporary name and renames).
    checkpoint_utils.torch_persistent_save(state, str(path))
