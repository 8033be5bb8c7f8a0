"""The results tables: their columns and types, and the schema version.

Every table is a Parquet dataset partitioned by ``run_id`` (Hive style); the files
themselves do not repeat ``run_id``. Readers use these schemas (not the first file's) so
that files written before a column was added read back with that column null.

``TABLES`` holds the tables every run writes (``runs``, ``evaluations``, ``examples``, ``significance``), the values
of mean ablation (``ablation_values``, written by runs with ``sweep.ablation: mean``) and,
registered with :func:`register_table`, the tables of the experiment kinds (``importance``, ``efficiency``,
``gates``, ``head_roles``, ``interactions``: each declared by its kind in ``headsweep.sweep.experiments``, which
registers them when it is imported; the ``headsweep`` API, the CLI and the driver import it). This module never
imports the kinds: imports point from the driver to the results, not back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from headsweep.errors import HeadsweepError

# The version of the tables below, written to `runs.schema_version` with every run. Changes are
# additive (a new table, a new nullable column), so a release reads every older store: a table
# an older store lacks reads empty, a column its files lack reads null; a renamed column reads from
# its old name in older files (RENAMED). A store holding runs of a newer version is refused
# (results/query.py). Bump it with every change and say what changed.
SCHEMA_HISTORY = {
    1: "runs, evaluations, examples, significance, importance",
    2: "new table efficiency (speed and memory of full and pruned models)",
    3: "new table head_roles (confidence, positional and rare-word statistics and roles of each head)",
    4: "head_roles gains syntactic accuracy and baseline columns per relation",
    5: "new table interactions (pairwise head interactions)",
    6: "new table gates (Hard Concrete L0 gates per lambda)",
    7: "evaluations gain screen, screen_examples, screen_ci_low, screen_ci_high (sequential screening)",
    8: "gates.lambda renamed l0_lambda (lambda is a keyword in DuckDB's SQL); older files' lambda reads as l0_lambda",
    9: "runs and evaluations gain ablation (sweep.ablation: what a gated-off head leaves behind; null in older files, "
       "which were all zero ablation); new table ablation_values (mean ablation's per-head values)",
    10: "new table inputs (each run's evaluated inputs with their example ids, written once per run); head_roles "
        "gains sink_share (attention on the first position, causal attention)",
    11: "new table serving (prefill and decode tokens/s and KV-cache bytes per token of a stock-exported pruned "
        "model against the full model)",
}

SCHEMA_VERSION = max(SCHEMA_HISTORY)

HEAD_COLUMNS = [("attention", pa.string()), ("layer", pa.int32()), ("head", pa.int32())]

TABLES: dict[str, pa.Schema] = {
    "runs": pa.schema(
        [
            ("created_at", pa.timestamp("us", tz="UTC")),
            ("updated_at", pa.timestamp("us", tz="UTC")),
            ("status", pa.string()),
            ("name", pa.string()),
            ("config", pa.string()),
            ("config_hash", pa.string()),
            ("model", pa.string()),
            ("dataset", pa.string()),
            ("metric", pa.string()),
            ("n_examples", pa.int64()),
            ("n_planned", pa.int64()),
            ("n_done", pa.int64()),
            ("baseline_score", pa.float64()),
            ("heads", pa.string()),
            ("facts", pa.string()),
            ("error", pa.string()),
            ("code_version", pa.string()),
            ("schema_version", pa.int32()),
            ("ablation", pa.string()),  # sweep.ablation (schema v9; null before: zero)
        ]
    ),
    "evaluations": pa.schema(
        [
            ("eval_id", pa.string()),
            ("experiment", pa.string()),
            *HEAD_COLUMNS,
            ("heads_masked", pa.list_(pa.string())),
            ("n_masked", pa.int32()),
            ("level", pa.float64()),
            ("checkpoint", pa.string()),
            ("metric", pa.string()),
            ("score", pa.float64()),
            ("baseline_score", pa.float64()),
            ("delta", pa.float64()),
            ("n_examples", pa.int64()),
            ("seconds", pa.float64()),
            ("worker", pa.string()),
            ("finished_at", pa.timestamp("us", tz="UTC")),
            # sweep.screen (headsweep.sweep.run.screening): screened_out (this row is the subset's) or completed;
            # the subset's size and its confidence interval for the delta. Null when the run did not screen.
            ("screen", pa.string()),
            ("screen_examples", pa.int64()),
            ("screen_ci_low", pa.float64()),
            ("screen_ci_high", pa.float64()),
            ("ablation", pa.string()),  # sweep.ablation (schema v9; null before: zero)
        ]
    ),
    "examples": pa.schema(
        [
            ("eval_id", pa.string()),
            ("example_id", pa.string()),
            ("stats", pa.list_(pa.float64())),
            ("loss", pa.float64()),
            ("output", pa.string()),
            ("reference", pa.string()),
        ]
    ),
    "significance": pa.schema(
        [
            ("eval_id", pa.string()),
            ("test", pa.string()),
            ("statistic", pa.float64()),
            ("p_value", pa.float64()),
            ("p_adjusted", pa.float64()),
            ("correction", pa.string()),
            ("alpha", pa.float64()),
            ("ci_low", pa.float64()),
            ("ci_high", pa.float64()),
            ("significant", pa.bool_()),
            ("n_resamples", pa.int64()),
            ("seed", pa.int64()),
        ]
    ),
    # Mean ablation's values (schema v9): per head (and checkpoint) what a gated-off head is replaced by, so that a
    # resumed run can check it computes the same (sweep/ablation/values.py).
    "ablation_values": pa.schema(
        [
            ("checkpoint", pa.string()),
            *HEAD_COLUMNS,
            ("method", pa.string()),
            ("positions", pa.string()),
            ("n_rows", pa.int32()),
            ("head_dim", pa.int32()),
            ("n_tokens", pa.int64()),
            ("mean_norm", pa.float64()),
            ("dtype", pa.string()),
            ("values", pa.list_(pa.float32())),
        ]
    ),
    # Each run's evaluated inputs (schema v10), once per run rather than per mask: what the report's drill-downs and
    # ``Store.head`` show beside the per-example changes, months after the data file moved. ``position``: the
    # example's place in the evaluation set; ``input``: its text as the family reads it (a classifier's sentence, a
    # translation's source, a language model's window decoded).
    "inputs": pa.schema(
        [
            ("example_id", pa.string()),
            ("position", pa.int64()),
            ("input", pa.string()),
        ]
    ),
}

# A run's status in ``runs``: running (its driver is writing it, or died), complete, failed (an
# error stopped it), interrupted (Ctrl-C), partial (``sweep.budget`` reached; resumable like an
# interrupted run). The driver writes these names and nothing else.
RUNNING, COMPLETE, FAILED, INTERRUPTED, PARTIAL = "running", "complete", "failed", "interrupted", "partial"
RUN_STATUSES = (RUNNING, COMPLETE, FAILED, INTERRUPTED, PARTIAL)


# Columns renamed since they were first written: table -> {name today: name in files of older versions}.
# Readers take the old column where a file lacks the new one (ResultStore.read, the query views).
RENAMED: dict[str, dict[str, str]] = {}


@dataclass(frozen=True)
class Table:
    """A results table an experiment kind declares: its ``name``, its columns (``schema``, without ``run_id``)
    and the columns ``renamed`` since they were first written ({name today: name in older files})."""

    name: str
    schema: pa.Schema
    renamed: Mapping[str, str] = field(default_factory=dict)


def register_table(table: Table) -> None:
    """Add ``table`` to :data:`TABLES` (and its renamed columns to :data:`RENAMED`). Registering the same table
    again is a no-op; another table under a name already taken is refused."""
    known = TABLES.get(table.name)
    if known is not None:
        if known.equals(table.schema) and RENAMED.get(table.name, {}) == dict(table.renamed):
            return
        raise HeadsweepError(f"results table {table.name!r} is declared already, with other columns")
    TABLES[table.name] = table.schema
    if table.renamed:
        RENAMED[table.name] = dict(table.renamed)


def with_run_id(schema: pa.Schema) -> pa.Schema:
    """The schema readers see: ``run_id`` (from the partition path) first."""
    return pa.schema([pa.field("run_id", pa.string()), *schema])


def file_schema(table: str) -> pa.Schema:
    """What the table's files may hold: ``with_run_id`` of its schema plus the old names of renamed columns
    (``RENAMED``), typed like the columns they became."""
    schema = with_run_id(TABLES[table])
    legacy = [pa.field(old, schema.field(new).type) for new, old in RENAMED.get(table, {}).items()]
    return pa.schema([*schema, *legacy])
