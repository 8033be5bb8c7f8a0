"""Loading a fairseq translation model: checkpoint, dictionaries and the task options decoding needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from fairseq.data import Dictionary

from headsweep.errors import HeadsweepError
from headsweep.workers.families.fairseq_translation.checkpoint import (
    build_model,
    check_dictionaries,
    prepare_state,
    read_checkpoint,
    task_option,
)
from headsweep.workers.families.fairseq_translation.config import TranslationModel


@dataclass
class LoadedTranslation:
    """A translation model with its dictionaries, languages and source padding side."""

    model: torch.nn.Module
    src_dict: Dictionary
    tgt_dict: Dictionary
    source_lang: str
    target_lang: str
    left_pad_source: bool
    num_updates: int


def load_model(cfg: TranslationModel) -> LoadedTranslation:
    """The checkpoint's model (on the CPU) with its dictionaries and the options decoding needs."""
    state = read_checkpoint(cfg.checkpoint, cfg.trusted)
    src = cfg.source_lang or task_option(state, "source_lang")
    tgt = cfg.target_lang or task_option(state, "target_lang")
    if not src or not tgt:
        raise HeadsweepError(
            "the checkpoint does not name its languages: set model.source_lang and model.target_lang"
        )
    if not cfg.data_bin:
        raise HeadsweepError("config key 'model.data_bin' is required (the folder with dict.<lang>.txt)")
    folder = Path(cfg.data_bin)
    files = [folder / f"dict.{lang}.txt" for lang in (src, tgt)]
    for file in files:
        if not file.is_file():
            raise HeadsweepError(f"dictionary not found: {file} (model.data_bin must hold dict.{src}.txt and "
                                 f"dict.{tgt}.txt)")
    src_dict, tgt_dict = (Dictionary.load(str(f)) for f in files)
    check_dictionaries(state, src_dict, tgt_dict, *files)
    state = prepare_state(state, {"data": str(folder), "source_lang": src, "target_lang": tgt})
    history = state.get("optimizer_history") or [{}]
    num_updates = int(history[-1].get("num_updates", 0) or 0)
    model, model_cfg, task = build_model(state, cfg.checkpoint)
    left_pad = bool(getattr(model_cfg.task, "left_pad_source", True))
    return LoadedTranslation(model, task.source_dictionary, task.target_dictionary, src, tgt, left_pad, num_updates)
