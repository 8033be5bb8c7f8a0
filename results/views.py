"""The SQL of the views that answer the common questions without hand-written joins.

Every view is keyed so that a run sweeping several training checkpoints never repeats a
head: rows of one run differ by ``checkpoint`` (null when the run has one model), and joins on
it use ``IS NOT DISTINCT FROM`` so that the null checkpoint matches itself.

The views over every run (``deltas``, ``heads``, ``layers``, ``pruning``, ``summary``) are defined here; an
experiment kind adds its own with :func:`register_view` (``roles``, by the roles kind), and the kinds whose
evaluations are points of a pruning curve say so with :func:`register_pruning_curve` (``prune_level``, ``l0``),
which is what the ``pruning`` view is made of. ``heads`` reads the ``importance`` table of the importance kind.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.results.schema import HEAD_COLUMNS
from headsweep.workers.core.metrics import LOWER_IS_BETTER

# The metric's primary test (a t-test for accuracy and multiple choice's length-normalised accuracy_norm, the
# paired bootstrap for corpus metrics, BLEU and perplexity, and for any metric not named here).
PRIMARY_TEST = {"accuracy": "paired_ttest", "accuracy_norm": "paired_ttest", "bleu": "paired_bootstrap",
                "perplexity": "paired_bootstrap"}
OTHER_METRICS_TEST = "paired_bootstrap"


def shown_test(metric: str, tests: Sequence[str]) -> str:
    """The one test shown next to a delta (views, ``headsweep status``, the report, a live run's progress): the
    metric's primary test when the run computed it, else the first of the run's ``significance.tests``. The other
    tests stay in ``significance``. ``SHOWN_SIGNIFICANCE`` is the same rule in SQL."""
    primary = PRIMARY_TEST.get(metric, OTHER_METRICS_TEST)
    return primary if primary in tests else tests[0]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def harm_sql(delta: str, metric: str) -> str:
    """SQL for how much worse than the baseline a score is, from its ``delta`` and the ``metric`` column's
    direction (``headsweep.workers.core.metrics.Metric.higher_is_better``): ``-delta`` where higher is better,
    ``delta`` where lower is (perplexity). Positive harm: the masked heads were needed."""
    if not LOWER_IS_BETTER:
        return f"-{delta}"
    names = ", ".join(_literal(m) for m in LOWER_IS_BETTER)
    return f"CASE WHEN {metric} IN ({names}) THEN {delta} ELSE -{delta} END"


def primary_test_sql(metric: str) -> str:
    """SQL naming the primary test of the metric in column ``metric`` (generated from ``PRIMARY_TEST``)."""
    cases = " ".join(f"WHEN {_literal(m)} THEN {_literal(t)}" for m, t in PRIMARY_TEST.items())
    return f"CASE {metric} {cases} ELSE {_literal(OTHER_METRICS_TEST)} END"


# Per evaluation, the significance row of the test ``shown_test`` picks: the metric's primary test when the run
# has it, else the first test of the run's significance.tests (from its config; null there means the metric's
# defaults, which hold the primary test), else (a config that names none of the stored tests) the first by name.
SHOWN_SIGNIFICANCE = f"""
SELECT s.run_id, s.eval_id, s.test, s.p_value, s.p_adjusted, s.correction, s.alpha, s.significant, s.ci_low, s.ci_high
FROM significance s
JOIN (SELECT DISTINCT run_id, eval_id, metric FROM evaluations) e ON e.run_id = s.run_id AND e.eval_id = s.eval_id
LEFT JOIN (SELECT run_id, any_value(from_json(json_extract(config, '$.significance.tests'), '["VARCHAR"]')) AS tests
           FROM runs GROUP BY run_id) c ON c.run_id = s.run_id
QUALIFY row_number() OVER (PARTITION BY s.run_id, s.eval_id
                           ORDER BY s.test = {primary_test_sql("e.metric")} DESC,
                                    list_position(c.tests, s.test) NULLS LAST, s.test) = 1
"""

# `logit_diff_normalized`, for paired prompts (metric logit_diff): the normalised patching score most papers report,
# (score - corrupted) / (clean - corrupted), from the unpatched clean and corrupted mean logit differences the run
# recorded in runs.facts (1: the clean run's, 0: the corrupted run's; of the first model where a run has checkpoints).
DELTAS = f"""
CREATE VIEW deltas AS
SELECT e.run_id, e.eval_id, e.experiment, e.attention, e.layer, e.head, e.level, e.checkpoint, e.n_masked,
       e.heads_masked, e.metric, e.score, e.baseline_score, e.delta, s.test, s.p_value, s.p_adjusted, s.correction,
       s.alpha, s.significant, s.ci_low, s.ci_high, {harm_sql("e.delta", "e.metric")} AS harm, e.screen,
       coalesce(e.ablation, 'zero') AS ablation,
       CASE WHEN e.metric = 'logit_diff' THEN (e.score - p.corrupted) / nullif(p.clean - p.corrupted, 0)
       END AS logit_diff_normalized
FROM evaluations e
LEFT JOIN ({SHOWN_SIGNIFICANCE}) s ON s.run_id = e.run_id AND s.eval_id = e.eval_id
LEFT JOIN (SELECT run_id, max(CAST(json_extract(facts, '$.logit_diff_clean') AS DOUBLE)) AS clean,
                  max(CAST(json_extract(facts, '$.logit_diff_corrupted') AS DOUBLE)) AS corrupted
           FROM runs GROUP BY run_id) p ON p.run_id = e.run_id
"""

_HEAD_STRUCT = "[{" + ", ".join(f'"{n}": "{t}"' for n, t in
                                (("attention", "VARCHAR"), ("layer", "INTEGER"), ("num_heads", "INTEGER"))) + "}]"


def same_head_sql(a: str, b: str) -> str:
    """SQL joining rows ``a`` and ``b`` of one head: the same run, checkpoint (null matching null) and head."""
    keys = " AND ".join(f"{a}.{name} = {b}.{name}" for name, _ in HEAD_COLUMNS)
    return f"{a}.run_id = {b}.run_id AND {a}.checkpoint IS NOT DISTINCT FROM {b}.checkpoint AND {keys}"


# Every head of every run (and checkpoint): the inventory the run recorded in `runs.heads`,
# plus any head an evaluation or the importance table names (runs that stopped early).
HEADS = f"""
CREATE VIEW heads AS
WITH checkpoints AS (SELECT DISTINCT run_id, checkpoint FROM evaluations),
declared AS (
    SELECT run_id, s.attention AS attention, s.layer AS layer, CAST(unnest(range(s.num_heads)) AS INTEGER) AS head
    FROM (SELECT run_id, unnest(from_json(heads, '{_HEAD_STRUCT}')) AS s FROM runs WHERE heads IS NOT NULL)
),
inventory AS (
    SELECT d.run_id, c.checkpoint, d.attention, d.layer, d.head FROM declared d JOIN checkpoints c USING (run_id)
    UNION
    SELECT run_id, checkpoint, attention, layer, head FROM evaluations
    WHERE experiment IN ('single_head', 'all_but_one')
    UNION
    SELECT run_id, checkpoint, attention, layer, head FROM importance
)
SELECT i.run_id, i.checkpoint, i.attention, i.layer, i.head, i.attention || ':' || i.layer || ':' || i.head AS name,
       coalesce(b.metric, s.metric) AS metric, coalesce(b.score, s.baseline_score) AS baseline_score,
       s.score, s.delta, s.test, s.p_value, s.p_adjusted, s.correction, s.alpha, s.significant, s.harm, s.screen,
       a.score AS all_but_one_score, a.delta AS all_but_one_delta,
       m.method AS importance_method, m.score AS importance, m.score_normalized AS importance_normalized,
       m.rank AS importance_rank, coalesce(r.ablation, 'zero') AS ablation
FROM inventory i
LEFT JOIN (SELECT run_id, any_value(ablation) AS ablation FROM runs GROUP BY run_id) r ON r.run_id = i.run_id
LEFT JOIN (SELECT * FROM evaluations WHERE experiment = 'baseline') b
  ON b.run_id = i.run_id AND b.checkpoint IS NOT DISTINCT FROM i.checkpoint
LEFT JOIN (SELECT * FROM deltas WHERE experiment = 'single_head') s ON {same_head_sql("s", "i")}
LEFT JOIN (SELECT * FROM evaluations WHERE experiment = 'all_but_one') a ON {same_head_sql("a", "i")}
LEFT JOIN importance m ON {same_head_sql("m", "i")}
"""

# All-but-one (Michel et al. sec. 3.3): per layer of each attention type, the head that scores
# best (in the metric's direction: lowest perplexity) when it is the only one kept (ties go to the
# lowest head index), with its test; `worst_delta` is the delta of the worst kept head.
LAYERS = f"""
CREATE VIEW layers AS
SELECT run_id, checkpoint, attention, layer, n_heads, head AS best_head,
       attention || ':' || layer || ':' || head AS best_name, metric, score, baseline_score, delta,
       test, p_value, p_adjusted, correction, alpha, significant, worst_delta
FROM (
    SELECT *,
           row_number() OVER w_sorted AS position,
           count(*) OVER w AS n_heads,
           arg_max(delta, harm) OVER w AS worst_delta
    FROM deltas WHERE experiment = 'all_but_one'
    WINDOW w AS (PARTITION BY run_id, checkpoint, attention, layer),
           w_sorted AS (PARTITION BY run_id, checkpoint, attention, layer ORDER BY {harm_sql("score", "metric")}, head)
)
WHERE position = 1
"""

# Pruning curves (sec. 4.2): `scope` is `global`, one attention type, or types joined by `+`
# (from the evaluation id); `attention` is set only when the scope is one attention type. `method` says which
# kind's curve a row is a point of (`importance`: prune_level, the least important heads masked; `l0`: l0_gates,
# the heads whose trained Hard Concrete gate closed, Voita et al. sec. 6, with its penalty weight `l0_lambda`), so
# the curves of a run compare at the same number of heads masked (`n_masked`, `level` = its share of the scope's
# heads).


@dataclass(frozen=True)
class PruningCurve:
    """Evaluations of ``experiment`` (eval ids ``<experiment>/<scope>/<point>``) are points of a pruning curve:
    ``method`` names the curve in the ``pruning`` view; ``parameter``, when set, is a column of that view holding
    the ``<point>`` part of the eval id as a number (null on other curves' rows); ``levels``, whether its points
    are pruning levels (the ``level`` column: the masks a pruning level names, as ``headsweep export --level``
    and ``efficiency.level`` do); ``label``, when set, what the report calls its curves (before their scope)."""

    experiment: str
    method: str
    parameter: str | None = None
    levels: bool = False
    label: str | None = None


# The curves the pruning view is made of, in registration order (register_pruning_curve).
PRUNING_CURVES: dict[str, PruningCurve] = {}


def pruning_sql() -> str:
    """The ``pruning`` view over the registered curves."""
    curves = list(PRUNING_CURVES.values())
    names = "|".join(re.escape(c.experiment) for c in curves) or "(?!)"
    method = " ".join(f"WHEN {_literal(c.experiment)} THEN {_literal(c.method)}" for c in curves)
    parameters = "".join(
        f",\n       CASE WHEN experiment = {_literal(c.experiment)} THEN "
        f"TRY_CAST(regexp_extract(eval_id, '/([^/]+)$', 1) AS DOUBLE) END AS {c.parameter}"
        for c in curves if c.parameter)
    experiments = ", ".join(_literal(c.experiment) for c in curves) or "NULL"
    return f"""
CREATE VIEW pruning AS
SELECT run_id, checkpoint, regexp_extract(eval_id, '({names})/([^/]+)/', 2) AS scope, attention,
       level, n_masked, heads_masked, metric, score, baseline_score, delta,
       score / nullif(baseline_score, 0) AS relative_score, test, p_value, p_adjusted, correction, alpha, significant,
       ablation, CASE experiment {method or "WHEN NULL THEN NULL"} END AS method{parameters}
FROM deltas WHERE experiment IN ({experiments})
"""


# One line per run: what `headsweep runs` prints. `n_significant` counts heads whose single-head
# ablation is significant (in any checkpoint, from the written families, by the test `deltas` shows); while a
# run goes, `significant_so_far` (corrected over the heads tested so far) and `eta_s` (of the pass in
# progress) come from the live row's facts.progress (null once it has ended). `baseline_score` is the run
# row's, else (a run that stopped before its row had it, written by an older release) its first model's
# baseline evaluation (`baseline` or `ckpt0/baseline`, the smallest eval id). `n_done` counts the evaluations stored
# (what `headsweep status` and the report show too), not the row's own count: that one is written with the row, so it
# lags behind a live run and is never updated by a driver that was killed.
SUMMARY = """
CREATE VIEW summary AS
SELECT r.run_id, r.name, r.status, r.created_at, r.model, r.dataset, r.metric,
       coalesce(r.baseline_score, b.score) AS baseline_score, r.n_examples,
       r.n_planned, coalesce(c.n_stored, 0) AS n_done, coalesce(c.n_checkpoints, 0) AS n_checkpoints,
       coalesce(h.n_heads, 0) AS n_heads,
       coalesce(h.n_significant, 0) AS n_significant,
       CAST(json_extract(r.facts, '$.progress.significant_so_far') AS INTEGER) AS significant_so_far,
       CAST(json_extract(r.facts, '$.progress.eta_s') AS DOUBLE) AS eta_s, r.updated_at
FROM runs r
LEFT JOIN (SELECT run_id, count(DISTINCT name) AS n_heads, count(DISTINCT name) FILTER (WHERE significant)
                  AS n_significant
           FROM heads GROUP BY run_id) h USING (run_id)
LEFT JOIN (SELECT run_id, count(DISTINCT coalesce(checkpoint, '')) AS n_checkpoints, count(DISTINCT eval_id) AS n_stored
           FROM evaluations GROUP BY run_id) c
  USING (run_id)
LEFT JOIN (SELECT run_id, arg_min(score, eval_id) AS score FROM evaluations WHERE experiment = 'baseline'
           GROUP BY run_id) b USING (run_id)
"""

# In creation order: a view may use the ones before it. The kinds' views come after these (register_view).
VIEWS: dict[str, str] = {"deltas": DELTAS, "heads": HEADS, "layers": LAYERS, "pruning": pruning_sql(),
                         "summary": SUMMARY}


@dataclass(frozen=True)
class View:
    """A view an experiment kind declares: its ``name`` and the ``CREATE VIEW <name> AS ...`` statement (which may
    read the tables and the views created before it)."""

    name: str
    sql: str


def register_view(view: View) -> None:
    """Add ``view`` after the views known so far. Registering the same view again is a no-op; another view under a
    name already taken is refused."""
    known = VIEWS.get(view.name)
    if known is not None and known != view.sql:
        raise HeadsweepError(f"results view {view.name!r} is declared already, as another query")
    VIEWS[view.name] = view.sql


def register_pruning_curve(curve: PruningCurve) -> None:
    """Add ``curve``'s rows to the ``pruning`` view (the same curve again is a no-op; another curve of the same
    experiment, or a parameter column another curve names, is refused)."""
    known = PRUNING_CURVES.get(curve.experiment)
    if known == curve:
        return
    taken = {c.parameter for c in PRUNING_CURVES.values()}
    if known is not None or (curve.parameter is not None and curve.parameter in taken):
        raise HeadsweepError(f"pruning curve of {curve.experiment!r} is declared already, or its column "
                             f"{curve.parameter!r} is another curve's")
    PRUNING_CURVES[curve.experiment] = curve
    VIEWS["pruning"] = pruning_sql()

# What `headsweep runs` lists, newest first.
RUNS_LIST = "SELECT * FROM summary ORDER BY created_at DESC, run_id"
