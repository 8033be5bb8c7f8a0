"""The model families headsweep knows: the built-in ones, and plugins installed as ``headsweep.families`` entry
points (``headsweep.plugins``).

The families import only the contract (:mod:`headsweep.workers.core.family`); this module imports the families'
declarations (``workers/families/<name>/family.py``, which import nothing heavy), so importing it on the driver
imports neither torch nor fairseq. Generic code asks the families through here: by name (:func:`model_family`),
or, for a bare model or an exported folder, each built-in family in turn (:func:`family_of_model`,
:func:`family_of_export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.plugins import FAMILIES_GROUP
from headsweep.registry import Registry
from headsweep.workers.core.family import ModelFamily
from headsweep.workers.families.fairseq_translation.family import FAIRSEQ_TRANSLATION
from headsweep.workers.families.hf_causal_lm.family import HF_CAUSAL_LM
from headsweep.workers.families.hf_classifier.family import HF_CLASSIFIER
from headsweep.workers.families.hf_seq2seq.family import HF_SEQ2SEQ

if TYPE_CHECKING:
    from torch import nn

# In the order a bare model or an exported folder is asked of them.
BUILTIN: tuple[ModelFamily, ...] = (HF_CLASSIFIER, FAIRSEQ_TRANSLATION, HF_CAUSAL_LM, HF_SEQ2SEQ)


def _unknown(name: str, known: list[str]) -> str:
    return (f"unknown model.kind {name!r} (known: {', '.join(sorted(known))}, or the name of an installed "
            f"{FAMILIES_GROUP!r} entry point)")


# Every family by name: the built-in ones, then plugins as configs name them (imported once, on first use).
FAMILIES: Registry[ModelFamily] = Registry("model family", "model.kind", FAMILIES_GROUP, ModelFamily,
                                           unknown=_unknown)
for _builtin in BUILTIN:
    FAMILIES.register(_builtin)


def builtin_families() -> list[ModelFamily]:
    """The families that ship with headsweep (a bare model is asked of them in this order)."""
    return list(BUILTIN)


def model_family(name: str) -> ModelFamily:
    """The model family called ``name``: a built-in one, or one installed as a ``headsweep.families`` entry point
    (importable on the driver and on every worker); or a clear error listing the known ones."""
    return FAMILIES.lookup(name)


def family_of_model(model: nn.Module) -> ModelFamily:
    """The built-in family whose attention sites a bare ``model`` has."""
    for family in BUILTIN:
        try:
            if family.owns(model):
                return family
        except ImportError:  # that family's library is not installed, so the model is not one of its
            continue
    raise HeadsweepError(f"no attention modules recognised in {type(model).__name__} (not a model of the built-in "
                         f"families {', '.join(f.name for f in BUILTIN)})")


def family_of_export(folder: str | Path) -> ModelFamily:
    """The built-in family that wrote the exported model folder ``folder`` (``headsweep export``)."""
    for family in BUILTIN:
        if family.loads_exported(folder):
            return family
    raise HeadsweepError(f"{folder} is not a model folder written by headsweep export (no config.json of a "
                         "transformers model)")


def syntax_families() -> list[str]:
    """The built-in families whose heads roles can score against parses of their evaluation text."""
    return [f.name for f in BUILTIN if f.syntax_attention is not None]
