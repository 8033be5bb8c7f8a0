"""The ``importance`` table: one row per checkpoint and head, its score by the run's ``importance.method``."""

from __future__ import annotations

import pyarrow as pa

from headsweep.results.schema import HEAD_COLUMNS, Table

IMPORTANCE_TABLE = Table("importance", pa.schema([
    ("method", pa.string()),
    *HEAD_COLUMNS,
    ("score", pa.float64()),
    ("score_normalized", pa.float64()),
    ("rank", pa.int32()),
    ("checkpoint", pa.string()),
]))
