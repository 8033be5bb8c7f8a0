"""The ``gates`` table of the ``l0`` kind, and its pruning curve.

``gates``: one row per penalty weight and gated head, the trained Hard Concrete gate (``hard_concrete.py``):
``p_open`` = P(g > 0); closed by the run's ``l0.closing`` rule. Its ``l0_lambda`` was called ``lambda`` before
schema version 8 (a keyword in DuckDB's SQL): older files' ``lambda`` reads as ``l0_lambda``.

Each lambda's closed-gate mask is evaluated as experiment ``l0_gates`` (eval id ``l0_gates/<scope>/<lambda>``):
points of the ``l0`` pruning curve, beside prune_level's in the ``pruning`` view, with the lambda as ``l0_lambda``.
"""

from __future__ import annotations

import pyarrow as pa

from headsweep.results.schema import HEAD_COLUMNS, Table
from headsweep.results.views import PruningCurve

GATES = Table("gates", pa.schema([
    ("l0_lambda", pa.float64()),
    *HEAD_COLUMNS,
    ("log_alpha", pa.float64()),
    ("p_open", pa.float64()),
    ("closed", pa.bool_()),
    ("step", pa.int64()),
    ("train", pa.string()),
    ("checkpoint", pa.string()),
]), renamed={"l0_lambda": "lambda"})

L0_CURVE = PruningCurve("l0_gates", "l0", parameter="l0_lambda", label="L0 gates")
