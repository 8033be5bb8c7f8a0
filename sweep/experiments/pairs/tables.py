"""The ``interactions`` table of the ``pairs`` kind: one row per checkpoint and pair of heads i < j (model order),
the interaction delta_ij - delta_i - delta_j in the metric's units with its paired bootstrap over the four
evaluations (``interactions.py``); ``excess_harm`` is the interaction in the direction "pair hurts more than the
sum"."""

from __future__ import annotations

import pyarrow as pa

from headsweep.results.schema import Table

INTERACTIONS = Table("interactions", pa.schema([
    ("eval_id", pa.string()),
    ("checkpoint", pa.string()),
    ("metric", pa.string()),
    ("head_i", pa.string()),
    ("attention_i", pa.string()),
    ("layer_i", pa.int32()),
    ("index_i", pa.int32()),
    ("head_j", pa.string()),
    ("attention_j", pa.string()),
    ("layer_j", pa.int32()),
    ("index_j", pa.int32()),
    ("same_layer", pa.bool_()),
    ("baseline_score", pa.float64()),
    ("delta_i", pa.float64()),
    ("delta_j", pa.float64()),
    ("delta_ij", pa.float64()),
    ("interaction", pa.float64()),
    ("excess_harm", pa.float64()),
    ("test", pa.string()),
    ("ci_low", pa.float64()),
    ("ci_high", pa.float64()),
    ("p_value", pa.float64()),
    ("p_adjusted", pa.float64()),
    ("correction", pa.string()),
    ("alpha", pa.float64()),
    ("significant", pa.bool_()),
    ("n_resamples", pa.int64()),
    ("seed", pa.int64()),
]))
