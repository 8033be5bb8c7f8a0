"""Load a fairseq checkpoint with a clear trust rule, and its model and dictionaries.

torch >= 2.6 reads checkpoints with ``weights_only=True``: tensors and plain containers
only. Most fairseq checkpoints also hold pickled Python objects (``argparse.Namespace``
options, omegaconf nodes, metric meters), and unpickling those can run code from the
file. The rule: a checkpoint that reads with ``weights_only=True`` loads as is; one that
needs full unpickling loads only when the user says they trust it (``model.trusted``).
"""

from __future__ import annotations

import codecs
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from headsweep.errors import HeadsweepError


def read_checkpoint(path: str | Path, trusted: bool) -> dict:
    """The raw state dict of a fairseq checkpoint file, loaded on the CPU under the trust rule."""
    p = Path(path)
    if not str(path):
        raise HeadsweepError("config key 'model.checkpoint' is required (a fairseq checkpoint .pt file)")
    if not p.is_file():
        raise HeadsweepError(f"checkpoint not found: {path}")
    _check_torch_file(p)
    try:
        state = torch.load(p, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if not trusted and found:
            raise HeadsweepError(
                f"checkpoint {path} holds pickled Python objects ({found.group(1)}), which torch only reads with "
                "weights_only=False and which can run code from the file: if you trust where it came from, "
                "set model.trusted=true"
            ) from None
        raise HeadsweepError(f"{path} is not a fairseq checkpoint: torch cannot read it ({_reason(exc)})") from None
    except EOFError as exc:
        raise HeadsweepError(f"checkpoint {path} is truncated: torch ran out of data reading it ({_first_line(exc)}; "
                             f"{REFETCH})") from None
    except (RuntimeError, OSError, ValueError, AttributeError, ModuleNotFoundError, KeyError, IndexError,
            TypeError) as exc:
        raise HeadsweepError(f"{path} is not a fairseq checkpoint: torch cannot read it ({_first_line(exc)})") from None
    if not isinstance(state, dict) or "model" not in state or not (state.get("cfg") or state.get("args")):
        keys = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise HeadsweepError(f"{path} is not a fairseq checkpoint: no 'model' with 'cfg' or 'args' (found: {keys})")
    return state


REFETCH = "an interrupted download or copy? fetch or copy it again"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_MAGIC = b"\x80"  # the legacy format: a pickle, starting with its protocol opcode


def _check_torch_file(path: Path) -> None:
    """One-line error unless ``path`` starts as ``torch.save`` writes files, and a zip one is whole.

    torch's own errors for a foreign file are opaque (a text file reads as ``KeyError: 101``, the
    pickle memo index its first bytes happen to spell)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        raise HeadsweepError(f"checkpoint {path} is empty ({REFETCH})")
    if head.startswith(ZIP_MAGIC):
        if not zipfile.is_zipfile(path):
            raise HeadsweepError(f"checkpoint {path} is truncated: a zip archive without its end ({REFETCH})")
        return
    if head.startswith(PICKLE_MAGIC):
        return
    text = _as_text(head)
    if text is not None:
        what = f"a text file (it starts {text.strip().splitlines()[0][:40]!r})" if text.strip() else "blank text"
    else:
        what = f"not a file torch.save wrote (its first bytes are {head[:8].hex(' ')})"
    raise HeadsweepError(f"{path} is not a fairseq checkpoint: it is {what}; model.checkpoint must name the .pt "
                         "file fairseq-train wrote (e.g. checkpoints/checkpoint_best.pt)")


def _as_text(head: bytes) -> str | None:
    """The first bytes of a file as text, if they are printable UTF-8 (a character cut at the end allowed)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return None
    return text if all(c.isprintable() or c in "\r\n\t" for c in text) else None


def _reason(exc: BaseException) -> str:
    # torch's weights_only errors are paragraphs; the cause follows "WeightsUnpickler error:".
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        rest = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        if rest:
            return rest[0]
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def prepare_state(state: dict, overrides: dict[str, Any]) -> dict:
    """What ``checkpoint_utils.load_checkpoint_to_cpu`` does after ``torch.load``: apply
    overrides to the stored options and upgrade old layouts."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name
    from omegaconf import OmegaConf

    if state.get("args") is not None:
        for name, value in overrides.items():
            setattr(state["args"], name, value)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        overwrite_args_by_name(state["cfg"], overrides)
    return checkpoint_utils._upgrade_state_dict(state)


def task_option(state: dict, name: str) -> Any:
    """One of the checkpoint's task options (from ``cfg.task``, or the legacy ``args``)."""
    if state.get("args") is not None:
        return getattr(state["args"], name, None)
    task = state["cfg"].get("task") or {}
    return task.get(name) if isinstance(task, dict) else getattr(task, name, None)


def check_dictionaries(state: dict, src_dict, tgt_dict, src_file: Path, tgt_file: Path) -> None:
    """One-line error unless the dictionaries have as many entries as the embedding tables."""
    weights = state["model"]
    for key, dictionary, file in (
        ("encoder.embed_tokens.weight", src_dict, src_file),
        ("decoder.embed_tokens.weight", tgt_dict, tgt_file),
    ):
        if key in weights and weights[key].shape[0] != len(dictionary):
            raise HeadsweepError(
                f"dictionary {file} has {len(dictionary)} entries but the checkpoint's {key.split('.')[0]} "
                f"embedding has {weights[key].shape[0]} rows: use the dictionaries the model was trained with "
                "(model.data_bin)"
            )


def build_model(state: dict, path: str | Path):
    """The model and task of a prepared state, through fairseq's own loader."""
    from fairseq import checkpoint_utils

    from headsweep.workers.families.fairseq_translation.pruning import pruned_task

    try:
        # A checkpoint written by `headsweep export` holds fewer heads: its task builds the model pruned.
        task = pruned_task(state)
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state, task=task)
    except (RuntimeError, KeyError, AttributeError, ValueError, AssertionError, FileNotFoundError) as exc:
        raise HeadsweepError(f"cannot build the fairseq model from the checkpoint: {_first_line(exc)}") from None
    return models[0], cfg, task


def trained_label_smoothing(path: str) -> float | None:
    """The label smoothing the checkpoint at ``path`` was trained with (its stored criterion options), or None when
    it does not say (or cannot be read: the loader reports a bad checkpoint in its own words)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        # mmap: the options are wanted, not the weights; fairseq checkpoints hold option objects (not weights-only).
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - the adapter's loader reports a bad checkpoint in its own words
        return None
    args = state.get("args")
    if args is not None and getattr(args, "label_smoothing", None) is not None:
        return float(args.label_smoothing)
    criterion = (state.get("cfg") or {}).get("criterion")
    value = criterion.get("label_smoothing") if hasattr(criterion, "get") else getattr(criterion, "label_smoothing",
                                                                                        None)
    return None if value is None else float(value)
