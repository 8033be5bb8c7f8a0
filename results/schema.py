"""The results tables: their columns and types, and the schema version.

Every table is a Parquet dataset partitioned by ``run_id`` (Hive style); the files
themselves do not repeat ``run_id``. Readers use these schemas (not the first file's) so
that files written before a column was added read back with that column null.
"""

from __future__ import annotations

import pyarrow as pa

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
}

SCHEMA_VERSION = max(SCHEMA_HISTORY)

HEAD_COLUMNS = [("attention", pa.string()), ("layer", pa.int32()), ("head", pa.int32())]

# Syntactic heads (head_roles, headsweep.workers.syntax.syntax_columns names the same): per relation and direction
# (dep2gov: from the dependent to its governor; gov2dep: back) the head's accuracy and the most-frequent-offset
# baseline, and the relation's instances. Null where no parses were given or the attention type is not parsed.
SYNTAX_RELATIONS = ("nsubj", "obj", "amod", "advmod")
SYNTAX_COLUMNS = [
    col for rel in SYNTAX_RELATIONS
    for col in ((f"{rel}_dep2gov", pa.float64()), (f"{rel}_dep2gov_baseline", pa.float64()),
                (f"{rel}_gov2dep", pa.float64()), (f"{rel}_gov2dep_baseline", pa.float64()),
                (f"{rel}_instances", pa.int64()))
]

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
    "importance": pa.schema(
        [
            ("method", pa.string()),
            *HEAD_COLUMNS,
            ("score", pa.float64()),
            ("score_normalized", pa.float64()),
            ("rank", pa.int32()),
            ("checkpoint", pa.string()),
        ]
    ),
    # The efficiency experiment: one row per model variant (full / pruned) and batch size.
    "efficiency": pa.schema(
        [
            ("mask_source", pa.string()),
            ("source_run", pa.string()),
            ("level", pa.float64()),
            ("heads_masked", pa.list_(pa.string())),
            ("n_masked", pa.int32()),
            ("heads_removed", pa.float64()),
            ("checkpoint", pa.string()),
            ("variant", pa.string()),
            ("batch_size", pa.int32()),
            ("device", pa.string()),
            ("n_params", pa.int64()),
            ("n_heads", pa.int32()),
            ("peak_memory_mb", pa.float64()),
            ("examples", pa.int64()),
            ("tokens", pa.int64()),
            ("warmup", pa.int32()),
            ("repeats", pa.int32()),
            ("seconds_median", pa.float64()),
            ("seconds_min", pa.float64()),
            ("seconds_max", pa.float64()),
            ("examples_per_s", pa.float64()),
            ("examples_per_s_iqr", pa.float64()),
            ("tokens_per_s", pa.float64()),
            ("tokens_per_s_iqr", pa.float64()),
            ("speedup", pa.float64()),
            ("finished_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    # The l0 experiment (Voita et al. 2019 sec. 6): one row per penalty weight and gated head, the trained
    # Hard Concrete gate (headsweep.workers.hard_concrete). p_open = P(g > 0); closed by the run's l0.closing rule.
    "gates": pa.schema(
        [
            ("l0_lambda", pa.float64()),
            *HEAD_COLUMNS,
            ("log_alpha", pa.float64()),
            ("p_open", pa.float64()),
            ("closed", pa.bool_()),
            ("step", pa.int64()),
            ("train", pa.string()),
            ("checkpoint", pa.string()),
        ]
    ),
    # The roles experiment (Voita et al. 2019): one row per checkpoint and head, statistics of its unmasked
    # attention maps (headsweep.workers.head_roles). More statistics (e.g. per syntactic relation, an accuracy
    # and a baseline column each) are added as nullable columns: older files then read them as null.
    "head_roles": pa.schema(
        [
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
        ]
    ),
    # The pairs experiment: one row per checkpoint and pair of heads i < j (model order), the interaction
    # delta_ij - delta_i - delta_j in the metric's units with its paired bootstrap over the four evaluations
    # (headsweep.sweep.statistics.interactions); excess_harm is the interaction in the direction "pair hurts more
    # than the sum".
    "interactions": pa.schema(
        [
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
RENAMED: dict[str, dict[str, str]] = {"gates": {"l0_lambda": "lambda"}}


def with_run_id(schema: pa.Schema) -> pa.Schema:
    """The schema readers see: ``run_id`` (from the partition path) first."""
    return pa.schema([pa.field("run_id", pa.string()), *schema])


def file_schema(table: str) -> pa.Schema:
    """What the table's files may hold: ``with_run_id`` of its schema plus the old names of renamed columns
    (``RENAMED``), typed like the columns they became."""
    schema = with_run_id(TABLES[table])
    legacy = [pa.field(old, schema.field(new).type) for new, old in RENAMED.get(table, {}).items()]
    return pa.schema([*schema, *legacy])
