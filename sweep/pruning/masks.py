"""Masks named by where they were evaluated: a pruning level or an evaluation id of a stored run.

The efficiency experiment and ``headsweep export`` take a mask either as a list of head names
or as ``--from-run RUN --level P`` / ``--eval-id ID``, read back from the run's
``evaluations`` rows (their ``heads_masked``), so a pruned model is exactly the model whose
score that run reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headsweep.errors import HeadsweepError
from headsweep.results.views import PRUNING_CURVES
from headsweep.workers.core.heads import Head, HeadInventory

if TYPE_CHECKING:  # reading a config (which names the efficiency kind) needs no store
    from headsweep.results.store import ResultStore


@dataclass(frozen=True)
class MaskChoice:
    """The heads to remove and where they came from (``source``: an eval id, or ``mask``)."""

    heads: tuple[Head, ...]
    source: str
    run_id: str | None = None
    level: float | None = None

    def columns(self, inventory: HeadInventory) -> dict:
        """The mask's columns in the ``efficiency`` table."""
        return {
            "mask_source": self.source,
            "source_run": self.run_id,
            "level": self.level,
            "heads_masked": [str(h) for h in self.heads],
            "n_masked": len(self.heads),
            "heads_removed": len(self.heads) / max(1, len(inventory.heads)),
        }


def explicit_mask(names: Sequence[str], inventory: HeadInventory) -> MaskChoice:
    """A mask given as head names, checked against the model's heads."""
    heads = tuple(sorted({inventory.check(Head.parse(n)) for n in names}))
    return MaskChoice(heads, "mask")


def stored_mask(
    store: ResultStore,
    run_id: str,
    inventory: HeadInventory,
    level: float | None = None,
    eval_id: str | None = None,
    checkpoint: str | None = None,
    prefix: str = "",
) -> MaskChoice:
    """The mask of run ``run_id``'s ``prune_level`` evaluation at ``level``, or of evaluation ``eval_id``.

    ``prefix`` and ``checkpoint`` single out one training checkpoint of a run over several.
    """
    if (level is None) == (eval_id is None):
        raise HeadsweepError("name the stored mask by a pruning level or by an evaluation id (one of the two)")
    columns = ["eval_id", "experiment", "level", "heads_masked", "checkpoint"]
    rows = store.read("evaluations", run_id, columns=columns).to_pylist()
    if not rows:
        raise HeadsweepError(f"run {run_id} has no evaluations in store {store.uri}")
    if level is not None:
        curves = [c.experiment for c in PRUNING_CURVES.values() if c.levels]
        what = f"{' or '.join(curves)} evaluation at level {level}"
        found = [r for r in rows if r["experiment"] in curves and abs(r["level"] - level) < 1e-9]
        if not found:
            levels = sorted({r["level"] for r in rows if r["experiment"] in curves})
            raise HeadsweepError(f"run {run_id} has no {what} (its levels: {levels or 'none'})")
    else:
        what = f"evaluation {eval_id!r}"
        found = [r for r in rows if r["eval_id"] in (eval_id, prefix + eval_id)]
        if not found:
            raise HeadsweepError(f"run {run_id} has no {what}")
    if len(found) > 1:
        found = [r for r in found if r["checkpoint"] == checkpoint]
        if len(found) != 1:
            raise HeadsweepError(f"run {run_id} has a {what} for several checkpoints: name one by eval id")
    row = found[0]
    heads = tuple(sorted(inventory.check(Head.parse(n)) for n in row["heads_masked"]))
    return MaskChoice(heads, row["eval_id"], run_id, row["level"])


def efficiency_mask(section, store: ResultStore, run_id: str, inventory: HeadInventory, prefix: str = "",
                    checkpoint: str | None = None) -> MaskChoice:
    """The mask the config's ``efficiency`` section names (``run_id`` is this run, used without ``from_run``)."""
    if section.mask is not None:
        return explicit_mask(section.mask, inventory)
    return stored_mask(store, section.from_run or run_id, inventory, section.level, section.eval_id, checkpoint, prefix)
