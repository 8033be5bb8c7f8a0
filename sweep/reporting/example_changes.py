"""Which examples a head's removal changes: per-example scores of a masked evaluation against the baseline's.

Every evaluation stores its per-example sufficient statistics (``examples.stats``); one example's score is the
metric's corpus score of its row alone: correct or not (accuracy), sentence BLEU (sacrebleu's corpus formula with
``effective_order``, as ``sacrebleu.sentence_bleu``), the window's perplexity, the pair's logit difference. The
change of an example is its score with the heads masked minus its baseline score, and ``harm`` the change in the
metric's direction (positive: the example got worse). The drill-down, ``Store.head`` and the scale bench read this
one definition; examples are ordered by harm, ties by ``example_id``, so a SQL query over the store names the same
top example.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headsweep.workers.core.metrics import METRICS, bleu_from_stats, higher_is_better

# What an example's score is called, per metric.
VALUE_NAMES = {"accuracy": "correct", "accuracy_norm": "correct (length-normalised)", "bleu": "sentence BLEU",
               "perplexity": "window perplexity", "logit_diff": "logit difference"}


def fetch(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[tuple]:
    """The rows of ``sql`` (``?`` filled from ``params``) as tuples, the result consumed whole."""
    return con.sql(sql, params=params or []).fetchall()


def one(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> tuple | None:
    """The first row of ``sql``, or None."""
    found = fetch(con, sql, params)
    return found[0] if found else None


def value_name(metric: str | None) -> str:
    """What one example's score is (``sentence BLEU``), for column headers."""
    return VALUE_NAMES.get(metric or "", "example score")


def example_values(metric: str | None, stats: np.ndarray) -> np.ndarray:
    """One score per example from per-example statistics ``(n, n_stats)``: the metric's score of the row alone."""
    stats = np.asarray(stats, dtype=np.float64)
    if metric == "bleu":
        return bleu_from_stats(stats, effective_order=True)
    known = METRICS.get(metric or "")
    if known is None:  # a metric headsweep does not know: its first statistic
        return stats[..., 0]
    return np.asarray(known.score_from_stats(stats, 1), dtype=np.float64)


def stats_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list<double> column of equal-length lists as an ``(n, k)`` array."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(column)
    flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float64)
    return flat.reshape(n, -1) if n else np.zeros((0, 1))


@dataclass
class Changes:
    """Per-example scores of evaluations against their baseline, in one flat table of ``n`` rows.

    ``eval_ids[i]``'s example ``example_ids[i]`` scored ``value[i]`` with the heads masked and ``base[i]``
    without; ``harm[i]`` is the change in the metric's direction.
    """

    metric: str | None
    eval_ids: np.ndarray
    example_ids: np.ndarray
    value: np.ndarray
    base: np.ndarray
    output: np.ndarray
    base_output: np.ndarray
    reference: np.ndarray
    loss: np.ndarray | None = None  # examples.loss with the heads masked (None: the family stores none)
    base_loss: np.ndarray | None = None

    @property
    def change(self) -> np.ndarray:
        return self.value - self.base

    @property
    def harm(self) -> np.ndarray:
        return -self.change if higher_is_better(self.metric) else self.change


def baseline_eval_id(con: duckdb.DuckDBPyConnection, run_id: str, checkpoint: str | None) -> str | None:
    """The eval id of the baseline evaluation of ``run_id``'s model ``checkpoint`` (None: the run has none)."""
    found = one(con, "SELECT min(eval_id) FROM evaluations WHERE run_id = ? AND experiment = 'baseline' "
                     "AND checkpoint IS NOT DISTINCT FROM ?", [run_id, checkpoint])
    return found[0] if found else None


def changes(con: duckdb.DuckDBPyConnection, run_id: str, checkpoint: str | None, metric: str | None,
            eval_ids: list[str] | None = None, experiment: str = "single_head") -> Changes | None:
    """The per-example changes of ``run_id``'s evaluations of ``experiment`` (or of ``eval_ids``) on model
    ``checkpoint`` against its baseline; None where the run stored no baseline examples (an older store)."""
    baseline = baseline_eval_id(con, run_id, checkpoint)
    if baseline is None:
        return None
    base = con.sql("SELECT example_id, stats, output, loss FROM examples WHERE run_id = ? AND eval_id = ?",
                   params=[run_id, baseline]).to_arrow_table()
    if base.num_rows == 0:
        return None
    if eval_ids is None:
        wanted = ("SELECT eval_id FROM evaluations WHERE run_id = ? AND experiment = ? "
                  "AND checkpoint IS NOT DISTINCT FROM ?")
        params: list = [run_id, experiment, checkpoint]
    else:
        wanted = "SELECT unnest(?::VARCHAR[])"
        params = [eval_ids]
    masked = con.sql(f"SELECT eval_id, example_id, stats, output, reference, loss FROM examples "
                     f"WHERE run_id = ? AND eval_id IN ({wanted})", params=[run_id, *params]).to_arrow_table()
    base_ids = base.column("example_id").to_numpy(zero_copy_only=False)
    at = {e: i for i, e in enumerate(base_ids)}
    example_ids = masked.column("example_id").to_numpy(zero_copy_only=False)
    where = np.array([at.get(e, -1) for e in example_ids], dtype=np.int64)
    keep = where >= 0  # an example the baseline lacks (a screening subset never does) has no change
    base_values = example_values(metric, stats_matrix(base.column("stats")))
    values = example_values(metric, stats_matrix(masked.column("stats"))) if masked.num_rows else np.zeros(0)
    base_out = base.column("output").to_numpy(zero_copy_only=False)
    # the per-example loss (a multiple-choice question's gold NLL, a pair's answer NLL...), where the family stores it
    has_loss = base.column("loss").null_count < base.num_rows
    base_loss = base.column("loss").to_numpy(zero_copy_only=False).astype(np.float64) if has_loss else None
    loss = masked.column("loss").to_numpy(zero_copy_only=False).astype(np.float64) if has_loss else None
    return Changes(
        metric=metric,
        eval_ids=masked.column("eval_id").to_numpy(zero_copy_only=False)[keep],
        example_ids=example_ids[keep],
        value=values[keep],
        base=base_values[where[keep]],
        output=masked.column("output").to_numpy(zero_copy_only=False)[keep],
        base_output=base_out[where[keep]],
        loss=None if loss is None else loss[keep],
        base_loss=None if base_loss is None else base_loss[where[keep]],
        reference=masked.column("reference").to_numpy(zero_copy_only=False)[keep],
    )


def top_changed(found: Changes, k: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per eval id, the row indices of its ``k`` most harmed examples (harm > 0, most first, ties by example id)
    and of its ``k`` most helped ones (harm < 0)."""
    if len(found.eval_ids) == 0:
        return {}
    harm = found.harm
    # One sort for every evaluation: by eval id, then harm (descending), then example id.
    order = np.lexsort((found.example_ids.astype(str), -harm, found.eval_ids.astype(str)))
    helped_order = np.lexsort((found.example_ids.astype(str), harm, found.eval_ids.astype(str)))
    sorted_ids = found.eval_ids[order].astype(str)
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    ends = np.r_[starts[1:], len(order)]
    helped_ids = found.eval_ids[helped_order].astype(str)
    h_starts = np.flatnonzero(np.r_[True, helped_ids[1:] != helped_ids[:-1]])
    h_ends = np.r_[h_starts[1:], len(helped_order)]
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (s, e), (hs, he) in zip(zip(starts, ends, strict=True), zip(h_starts, h_ends, strict=True), strict=True):
        worse = order[s:e]
        worse = worse[harm[worse] > 0][:k]
        better = helped_order[hs:he]
        better = better[harm[better] < 0][:k]
        out[sorted_ids[s]] = (worse, better)
    return out


def head_examples(con: duckdb.DuckDBPyConnection, run_id: str, name: str, checkpoint: str | None = None
                  ) -> pa.Table:
    """Every example of head ``name``'s single-head ablation in run ``run_id`` (model ``checkpoint``; a run over
    checkpoints needs one named), most harmed first (ties by example id): ``example_id``, ``input`` (null before
    schema version 10), ``reference``, ``baseline_output``, ``output``, ``baseline_value``, ``value``, ``change``,
    ``harm``, and where the family stores a per-example loss ``baseline_loss`` and ``loss``. Unknown runs, heads and
    checkpoints, and runs without per-example rows, are refused in one line."""
    from headsweep.errors import HeadsweepError

    run = one(con, "SELECT metric FROM runs WHERE run_id = ?", [run_id])
    if run is None:
        raise HeadsweepError(f"no run {run_id!r} in the store (headsweep runs lists them)")
    models = [r[0] for r in fetch(con, "SELECT DISTINCT checkpoint FROM evaluations WHERE run_id = ? "
                                        "ORDER BY checkpoint", [run_id])]
    if checkpoint is None and len(models) > 1:
        raise HeadsweepError(f"run {run_id} swept {len(models)} checkpoints: name one with checkpoint= "
                             f"({', '.join(str(m) for m in models)})")
    checkpoint = checkpoint if checkpoint is not None else (models[0] if models else None)
    if models and checkpoint not in models:
        raise HeadsweepError(f"run {run_id} has no checkpoint {checkpoint!r} ({', '.join(str(m) for m in models)})")
    found = one(con, "SELECT eval_id FROM evaluations WHERE run_id = ? AND experiment = 'single_head' AND "
                        "checkpoint IS NOT DISTINCT FROM ? AND attention || ':' || layer || ':' || head = ?",
                        [run_id, checkpoint, name])
    if found is None:
        known = [r[0] for r in fetch(con, "SELECT name FROM heads WHERE run_id = ? ORDER BY attention, layer, head",
                                           [run_id])]
        hint = f"its heads: {', '.join(known[:6])}{' ...' if len(known) > 6 else ''}" if known else "it has no heads"
        if name in known:
            raise HeadsweepError(f"head {name} was not ablated alone in run {run_id} (no single_head evaluation)")
        raise HeadsweepError(f"no head {name!r} in run {run_id} ({hint}; names are attention:layer:head)")
    got = changes(con, run_id, checkpoint, run[0], eval_ids=[found[0]])
    if got is None or len(got.eval_ids) == 0:
        raise HeadsweepError(f"run {run_id} stored no per-example rows for its baseline or head {name}: nothing to "
                             "show per example")
    order = np.lexsort((got.example_ids.astype(str), -got.harm))
    inputs = dict(fetch(con, "SELECT example_id, input FROM inputs WHERE run_id = ?", [run_id]))
    losses = {} if got.loss is None or got.base_loss is None else {
        "baseline_loss": got.base_loss[order], "loss": got.loss[order]}
    return pa.table({
        "example_id": got.example_ids[order].astype(str),
        "input": pa.array([inputs.get(e) for e in got.example_ids[order]], pa.string()),
        "reference": got.reference[order],
        "baseline_output": got.base_output[order],
        "output": got.output[order],
        "baseline_value": got.base[order],
        "value": got.value[order],
        "change": got.change[order],
        "harm": got.harm[order],
        **losses,
    })
