"""The ``head_roles`` table and the ``roles`` view of the ``roles`` kind.

``head_roles``: one row per checkpoint and head, statistics of its unmasked attention maps
(``headsweep.workers.attention.head_roles``), and per syntactic relation and direction (dep2gov: from the dependent to
its governor; gov2dep: back) the head's accuracy and the most-frequent-offset baseline, and the relation's instances
(``headsweep.workers.attention.syntax.syntax_columns``: null where no parses were given or the attention type is not
parsed). More statistics are added as nullable columns: older files then read them as null.
"""

from __future__ import annotations

import pyarrow as pa

from headsweep.results.schema import HEAD_COLUMNS, Table
from headsweep.results.views import View, same_head_sql
from headsweep.workers.attention.syntax import syntax_columns

SYNTAX_COLUMNS = [(name, pa.float64() if kind == "float" else pa.int64()) for name, kind in syntax_columns()]

HEAD_ROLES = Table("head_roles", pa.schema([
    ("checkpoint", pa.string()),
    *HEAD_COLUMNS,
    ("n_tokens", pa.int64()),
    ("confidence", pa.float64()),
    ("entropy", pa.float64()),
    ("top_offset", pa.int32()),
    ("top_offset_share", pa.float64()),
    ("rare_share", pa.float64()),
    ("rare_sentences", pa.int64()),
    ("rare_chance", pa.float64()),
    ("roles", pa.list_(pa.string())),
    *SYNTAX_COLUMNS,
    ("sink_share", pa.float64()),  # schema v10: attention on the first position (causal sites; null elsewhere)
]))

_SYNTAX = ", ".join("r." + name for name, _ in SYNTAX_COLUMNS)

# What each head attends to (`head_roles`, Voita et al. 2019) beside its single-head delta, test and importance
# (from `heads`; null where the run has none).
ROLES_VIEW = View("roles", f"""
CREATE VIEW roles AS
SELECT r.run_id, r.checkpoint, r.attention, r.layer, r.head, r.attention || ':' || r.layer || ':' || r.head AS name,
       r.confidence, r.entropy, r.top_offset, r.top_offset_share, r.rare_share, r.rare_sentences, r.rare_chance,
       r.n_tokens, r.roles, {_SYNTAX}, r.sink_share, h.metric, h.baseline_score, h.score, h.delta, h.test,
       h.p_value, h.p_adjusted, h.correction, h.alpha, h.significant, h.harm, h.importance_method, h.importance,
       h.importance_normalized, h.importance_rank
FROM head_roles r
LEFT JOIN heads h ON {same_head_sql("h", "r")}
""")
