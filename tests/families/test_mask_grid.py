"""The mask-grid loop alone: every (mask, example) value lands where it belongs, whatever the batches, the chunk size
and the groups, in each kind of output a family fills (NumPy, a tensor, per-row objects). The families' own tests
(packed == one mask per pass, reuse == plain, resample and patching against hook loops) run it on real models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, grid_batches, mask_grid

MASKS = [[], [Head("self", 0, 1)], [Head("self", 1, 0)], [Head("self", 0, 0), Head("self", 1, 1)], [Head("self", 1, 2)]]
ORDER = [[4, 0], [3], [1, 2]]  # example positions of each batch, not in order


def value(mask: int, example: int) -> float:
    return 10.0 * mask + example


@pytest.mark.parametrize("per", [1, 2, 5])
@pytest.mark.parametrize("out_kind", ["numpy", "tensor", "objects"])
@pytest.mark.parametrize("grouped", [False, True])
def test_every_value_lands_at_its_mask_and_example(per, out_kind, grouped):
    batches = grid_batches([torch.tensor(rows) for rows in ORDER], lambda rows: rows)
    passes: list[tuple[int, int]] = []

    def start(batch: GridBatch[torch.Tensor]):
        def forward(chunk):
            passes.append((batch.key, len(chunk)))
            assert len(chunk) <= per
            # one value per row of the batch repeated once per mask, mask-major
            rows = [value(MASKS.index(m), int(e)) for m in chunk for e in batch.inputs]
            if out_kind == "objects":
                return [(v, "row") for v in rows]  # tuples: NumPy must not unpack them into an axis
            return torch.tensor(rows, dtype=torch.float64).unsqueeze(1)

        return forward

    n = 5
    shape = (len(MASKS), n) if out_kind == "objects" else (len(MASKS), n, 1)
    out = {"numpy": np.full(shape, np.nan), "tensor": torch.full(shape, float("nan"), dtype=torch.float64),
           "objects": np.empty(shape, dtype=object)}[out_kind]
    groups = [[0], [1, 3], [2, 4]] if grouped else None
    mask_grid(MASKS, batches, start, out, masks_per_forward=lambda _b: per, groups=groups)
    for m in range(len(MASKS)):
        for e in range(n):
            got = out[m, e] if out_kind == "objects" else float(out[m, e, 0])
            assert got == ((value(m, e), "row") if out_kind == "objects" else value(m, e)), (m, e)
    chunks = [[g[i : i + per] for i in range(0, len(g), per)] for g in (groups or [list(range(len(MASKS)))])]
    assert passes == [(key, len(c)) for key in range(len(ORDER)) for group in chunks for c in group]
