"""Beam search through ``model.generate`` with per-row gates: several masks in one search, and the encoder's output
reused by masks that gate only decoder heads.

transformers' beam search runs the encoder once on the batch (``B`` rows), then expands every row to ``num_beams``
rows (``repeat_interleave``: row ``b`` becomes rows ``b * beams .. b * beams + beams - 1``) and keeps that layout to
the end: beams are reordered only within their sentence, and finished sentences keep their rows. A batch repeated
once per mask, mask-major (rows ``m * B .. m * B + B - 1`` carry mask ``m``), therefore has mask ``m`` on encoder rows
``m * B ..`` and on decoder rows ``m * B * beams ..``: :func:`row_gates` gives every site its table at the right
row count, and a gate table of the wrong height fails loudly in the gate hook (never gates the wrong rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head, SiteKey


def row_gates(gates: HeadGates, masks: Sequence[Sequence[Head]], rows: int, beams: int,
              device: torch.device) -> dict[SiteKey, torch.Tensor]:
    """Per-row gate tables for ``masks`` over a batch of ``rows`` sentences repeated once per mask: encoder sites
    one row per sentence, decoder sites one row per beam."""
    tables = gates.gate_tables(masks, device)
    return {key: table.repeat_interleave(rows if key[0] == "enc_self" else rows * beams, dim=0)
            for key, table in tables.items()}


def gates_encoder(mask: Sequence[Head]) -> bool:
    """Whether ``mask`` gates an encoder head (its encoder output is not the baseline's)."""
    return any(h.attention == "enc_self" for h in mask)
