"""The driver's side of ``sweep.ablation``: the workers' ablation settings, and mean ablation's values in the store.

The workers compute the means (``headsweep.workers.ablation.means``); the driver fetches them from one worker per
model (each checkpoint's workers compute their own) and stores them in ``ablation_values``: one row per head with its
vector (``values``, float32, ``n_rows x head_dim`` flattened: one row, or with ``per_position`` one per position plus
the pooled mean last), the tokens it averaged and its norm. A resumed run recomputes them and compares: values that
differ mean the reference data (or the model) changed since the run started, and the run is refused before it
writes anything, rather than mixing evaluations under two different fills. The comparison allows float32 rounding
and a different summation order (another thread count or device): a relative difference of ``RTOL``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.ablation import method_settings
from headsweep.sweep.configuration.data_sections import typed_data
from headsweep.sweep.configuration.sections import Config
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.heads import Head

# Stored and recomputed means agree within this share of the site's largest value (float32 rounding and summation
# order); a changed reference moves them far more.
RTOL = 1e-4


def ablation_spec(cfg: Config, reference: bool = True) -> AblationSpec:
    """The workers' ``RuntimeOptions.ablation`` from ``sweep.ablation`` and the ``ablation`` section: the method's
    settings object, the reference data typed (unless not ``reference``: a fill rebuilt from stored values reads no
    data), and the fill's shape the settings ask for."""
    method, settings = method_settings(cfg)
    raw = getattr(settings, "reference", None) if method.reference != "none" else None
    typed = None if raw is None or not reference else typed_data(cfg, raw, "ablation.reference")
    return AblationSpec(method=method.name, reference=typed, per_position=method.per_position(settings) is not None,
                        keep_first=cfg.ablation.keep_first, settings=settings)


@dataclass
class StoredFill:
    """One model's constant fill as the workers computed it, and its rows in ``ablation_values``."""

    store: ResultStore
    run_id: str
    checkpoint: str | None
    method: str
    per_position: bool
    values: dict[str, np.ndarray]  # attention:layer -> (H, d), or (P + 1, H, d) per position
    tokens: dict[str, int]

    def rows(self) -> list[dict]:
        out = []
        for name, array in self.values.items():
            attention, layer = name.rsplit(":", 1)
            heads = array if not self.per_position else np.moveaxis(array, 1, 0)  # (H, [P + 1,] d)
            for head, value in enumerate(heads):
                value = np.asarray(value, dtype=np.float32).reshape(-1, array.shape[-1])
                out.append({
                    "checkpoint": self.checkpoint, "attention": attention, "layer": int(layer), "head": head,
                    "method": self.method, "positions": "per_position" if self.per_position else "all",
                    "n_rows": value.shape[0], "head_dim": value.shape[1], "n_tokens": self.tokens.get(name),
                    "mean_norm": float(np.linalg.norm(value[-1].astype(np.float64))),
                    "dtype": str(array.dtype), "values": value.reshape(-1).tolist(),
                })
        return out

    def stored(self) -> list[dict]:
        rows = self.store.read("ablation_values", self.run_id).to_pylist()
        return [r for r in rows if r["checkpoint"] == self.checkpoint]

    def check(self) -> None:
        """Refuse values that differ from those this run stored for this model (a resumed run), in one line."""
        stored = {(r["attention"], r["layer"], r["head"]): r for r in self.stored()}
        if not stored:
            return
        model = f" (checkpoint {self.checkpoint})" if self.checkpoint is not None else ""
        for row in self.rows():
            key = (row["attention"], row["layer"], row["head"])
            old = stored.get(key)
            head = str(Head(*key))
            if old is None or (old["method"], old["positions"], old["n_rows"], old["head_dim"]) != (
                    row["method"], row["positions"], row["n_rows"], row["head_dim"]):
                raise HeadsweepError(
                    f"run {self.run_id}{model} stored other mean-ablation values for {head} (another shape or "
                    "method) than the workers computed now: start a new run (--new)")
            new, before = np.asarray(row["values"]), np.asarray(old["values"], dtype=np.float32)
            scale = max(float(np.abs(before).max(initial=0.0)), 1e-12)
            gap = float(np.abs(new - before).max(initial=0.0))
            if not gap <= RTOL * scale or math.isnan(gap):
                raise HeadsweepError(
                    f"run {self.run_id}{model} stored other mean-ablation values than the workers compute now "
                    f"({head}: largest difference {gap:.3g}, {gap / scale:.2g} of its largest value): the reference "
                    "data or the model changed since the run started; restore them, or start a new run (--new)")

    def write(self) -> None:
        """Store the values, unless this run stored them for this model already (a resumed run, checked)."""
        if not self.stored():
            self.store.write_rows("ablation_values", self.run_id, self.rows(),
                                  "values" if self.checkpoint is None else None)


def stored_values(store: ResultStore, run_id: str, checkpoint: str | None) -> dict[str, np.ndarray]:
    """The values run ``run_id`` stored for this model, shaped as the workers give them (``attention:layer`` ->
    ``(H, d)``, or ``(P + 1, H, d)`` per position); empty where it stored none."""
    return values_from_rows(store.read("ablation_values", run_id).to_pylist(), checkpoint)


def values_from_rows(rows: list[dict], checkpoint: str | None) -> dict[str, np.ndarray]:
    """:func:`stored_values` from a run's ``ablation_values`` rows as dicts (a query's, or the store's)."""
    by_site: dict[str, dict[int, np.ndarray]] = {}
    per_position = False
    for row in rows:
        if row["checkpoint"] != checkpoint:
            continue
        per_position = row["positions"] == "per_position"
        value = np.asarray(row["values"], dtype=np.float32).reshape(row["n_rows"], row["head_dim"])
        by_site.setdefault(f"{row['attention']}:{row['layer']}", {})[row["head"]] = value
    out = {}
    for name, heads in by_site.items():
        stacked = np.stack([heads[h] for h in sorted(heads)])  # (H, rows, d)
        out[name] = np.moveaxis(stacked, 0, 1) if per_position else stacked[:, 0]
    return out
