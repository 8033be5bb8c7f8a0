"""``headsweep report``: one self-contained folder (an interactive HTML page, the plotly.js bundle it draws with,
PNG figures; nothing fetched at view time), for one or more runs of a store.

Per run (and per training checkpoint when the run swept several): the part of each experiment kind, in
registration order (``Experiment.report``: a layer x head heat map of single-head deltas per attention type with
significance marks and the heads whose removal hurts most, the all-but-one table, an importance heat map, what
the heads do, pairwise interactions, and any registered kind's own); the run's pruning curves (global and per
attention type, with the curves of other runs of the same model and data whose pruning scope differs); and the
facts needed to reproduce it. Everything comes from the query views.
"""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import duckdb
import yaml

from headsweep.errors import HeadsweepError
from headsweep.results.outputs import check_output, written_folder
from headsweep.results.query import connect, scan_error
from headsweep.results.schema import SCHEMA_VERSION
from headsweep.results.store import ResultStore
from headsweep.results.views import PRUNING_CURVES
from headsweep.sweep.experiments import KINDS, register_stored_kinds
from headsweep.sweep.models.weights import check_run_weights
from headsweep.sweep.report_parts import figures
from headsweep.sweep.report_parts.page import (
    Page,
    ReportPart,
    ablation_label,
    facts_table,
    html_table,
    same,
    score_column,
)
from headsweep.sweep.report_parts.page import rows as query_rows
from headsweep.sweep.reporting import plots
from headsweep.sweep.reporting.example_changes import fetch
from headsweep.sweep.reporting.explorer import (
    TOP_EXAMPLES,
    Explorer,
    attention_extras,
    drill_script,
    figure_scripts,
    plot_div,
)
from headsweep.sweep.run.status import shown_status

# Baselines of two runs closer than this are the same model on the same data.
SAME_BASELINE = 1e-9

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0 1.2em; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; }
img { max-width: 100%; height: auto; display: block; margin: .5em 0; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: .85em; }
.note { color: #555; font-size: .9em; }
.plot { width: 100%; margin: .5em 0 1.5em; }
.drill { border: 2px solid #888; border-radius: 6px; padding: .5em 1em; margin: 1em 0; background: #fcfcfc; }
table.examples td { max-width: 28em; vertical-align: top; white-space: pre-wrap; }
details > summary { cursor: pointer; font-weight: bold; margin: 1.5em 0; }
"""


def _checkpoints(con: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[str | None, str]]:
    """The run's checkpoints (None for a single model) with short labels like ``ckpt1 (epoch2)``."""
    found = query_rows(con, "SELECT checkpoint, min(eval_id) AS first FROM evaluations WHERE run_id = ? "
                            "GROUP BY checkpoint ORDER BY first", [run_id])
    if len(found) <= 1:
        return [(found[0]["checkpoint"] if found else None, "")]
    return [(r["checkpoint"], f"{r['first'].split('/')[0]} ({Path(r['checkpoint'] or '').name})") for r in found]


def _pruning_curves(con: duckdb.DuckDBPyConnection, run: dict, checkpoints: list[tuple[str | None, str]],
                    heads_per_type: dict[str, int]) -> tuple[list[figures.Curve], list[dict]]:
    """This run's pruning curves, plus the newest curve of each scope this run lacks from other
    complete runs of the same model, data, checkpoint and baseline score (Michel et al. prune each
    attention type on its own: with headsweep, one run per ``prune.attention``)."""
    run_id = run["run_id"]
    curves: list[figures.Curve] = []
    table: list[dict] = []
    for checkpoint, label in checkpoints:
        baseline = query_rows(con, f"SELECT score FROM evaluations WHERE run_id = ? AND {same('checkpoint')} "
                              "AND experiment = 'baseline'", [run_id, checkpoint])
        own = query_rows(con, f"SELECT * FROM pruning WHERE run_id = ? AND {same('checkpoint')} ORDER BY scope, level",
                    [run_id, checkpoint])
        others = query_rows(con, f"""
            SELECT p.* FROM pruning p JOIN runs r USING (run_id)
            WHERE p.run_id <> ? AND {same('p.checkpoint')} AND r.status = 'complete'
              AND {same('r.model')} AND {same('r.dataset')} AND {same('r.metric')}
              AND abs(p.baseline_score - ?) <= {SAME_BASELINE}
            ORDER BY r.created_at DESC, p.run_id, p.scope, p.level""",
                       [run_id, checkpoint, run["model"], run["dataset"], run["metric"],
                        baseline[0]["score"] if baseline else None]) if own else []
        labels = {c.method: c.label for c in PRUNING_CURVES.values() if c.label}
        for r in own + others:  # e.g. L0 gates (Voita et al.) beside the importance curve of the same scope
            if r.get("method") in labels:
                r["scope"] = f"{labels[r['method']]}, {r['scope']}"
        by_curve: dict[tuple[str, str], list[dict]] = {}
        for r in own:
            by_curve.setdefault((r["scope"], run_id), []).append(r)
        source = {scope: run_id for scope, _ in by_curve}
        for r in others:
            if source.setdefault(r["scope"], r["run_id"]) == r["run_id"]:
                by_curve.setdefault((r["scope"], r["run_id"]), []).append(r)
        for (scope, origin), rows in by_curve.items():
            name = scope + (f", {label}" if label else "") + ("" if origin == run_id else f" (run {origin})")
            curves.append(figures.Curve(
                label=name, levels=[r["level"] for r in rows], scores=[r["score"] for r in rows],
                significant=[bool(r["significant"]) for r in rows], baseline=rows[0]["baseline_score"],
                kept=_kept_per_type(rows, heads_per_type) if scope == "global" else {},
            ))
            table += [{**r, "curve": name, "percent": 100.0 * r["level"]} for r in rows]
    return curves, table


def _kept_per_type(rows: list[dict], heads_per_type: dict[str, int]) -> dict[str, list[int]]:
    kept: dict[str, list[int]] = {a: [] for a in heads_per_type}
    for r in rows:
        masked = [h.split(":")[0] for h in r["heads_masked"] or []]
        for attention, total in heads_per_type.items():
            kept[attention].append(total - masked.count(attention))
    return kept


def _run_section(page: Page, con: duckdb.DuckDBPyConnection, run: dict, attention: bool = False) -> None:
    run_id = run["run_id"]
    config = json.loads(run["config"] or "{}")
    facts = json.loads(run["facts"] or "{}")
    inventory = json.loads(run["heads"] or "[]")
    order = list(dict.fromkeys(s["attention"] for s in inventory))
    heads_per_type: dict[str, int] = {}
    for s in inventory:
        heads_per_type[s["attention"]] = heads_per_type.get(s["attention"], 0) + s["num_heads"]
    metric = run["metric"]
    page.add(f'<h2 id="{html.escape(run_id)}">Run {html.escape(run_id)}: {html.escape(run["name"] or "")}</h2>')
    page.add(facts_table([
        ("status", shown_status(run["status"], run["facts"], run.get("age_s"))),
        ("model", run["model"]), ("data", run["dataset"]),
        ("metric", figures.metric_label(metric)),
        ("direction", "higher is better" if figures.higher_is_better(metric) else "lower is better"),
        ("ablation", _ablation_fact(run, facts)),
        ("baseline score", run["baseline_score"]), ("examples", run["n_examples"]),
        ("evaluations done / planned", f"{run['n_done']} / {run['n_planned']}"),
        ("heads", ", ".join(f"{a}: {n}" for a, n in heads_per_type.items())),
        ("created", run["created_at"]), ("updated", run["updated_at"]),
    ] + ([("error", run["error"])] if run["error"] else [])))

    checkpoints = _checkpoints(con, run_id)
    sig = config.get("significance", {})
    curves, table = _pruning_curves(con, run, checkpoints, heads_per_type)
    inputs = _inputs(con, run_id)
    if inputs is None:
        page.add('<p class="note">This store predates stored inputs (results schema version below 10): the '
                 "drill-downs show example ids, references and outputs but not the inputs themselves.</p>")
    for checkpoint, label in checkpoints:
        prefix = run_id + (f"-{label.split(' ')[0]}" if label else "")
        if label:
            page.add(f"<h3>Checkpoint {html.escape(label)}: {html.escape(checkpoint or '')}</h3>")
        explorer = Explorer(con, run, checkpoint, order, key=prefix)
        for part in explorer.heatmaps() + explorer.interactions():
            page.add(part)
        page.add(f'<div class="drill" id="drill-{html.escape(prefix)}" hidden></div>')
        page.scripts.append(figure_scripts(explorer.figures))
        extras = _attention(page, con, run, checkpoint, explorer) if attention else {}
        page.late.append(drill_script(prefix, explorer.drilldowns(_pruning_order(table, run_id, checkpoint),
                                                                     inputs, extras)))
    if curves:
        element = f"fig-{run_id}-pruning"
        figure = _pruning_plot(con, run, table)
        page.add(plot_div(element, figure))
        page.scripts.append(figure_scripts([(element, figure)]))

    page.add('<details><summary>Static figures and tables (PNG, for papers)</summary>')
    for checkpoint, label in checkpoints:
        prefix = run_id + (f"-{label.split(' ')[0]}" if label else "")
        if label:
            page.add(f"<h3>Checkpoint {html.escape(label)}: {html.escape(checkpoint or '')}</h3>")
        part = ReportPart(page, con, run, checkpoint, order, metric, prefix, sig)
        for kind in KINDS.values():  # each kind's part, in registration order
            kind.report(part)
    if curves:
        page.add("<h3>Pruning curves</h3>")
        page.add('<p class="note">At each level the least important heads (of the scope) are masked together; '
                 "circled points differ significantly from the baseline (adjusted p).</p>")
        page.figure(figures.pruning_figure(curves, metric, heads_per_type), f"{run_id}-pruning.png", "pruning curves")
        page.add(html_table(table, [("curve", "curve"), ("percent", "% pruned"), ("n_masked", "heads masked"),
                                score_column(metric), ("relative_score", "relative to baseline"),
                                ("p_adjusted", "adjusted p"), ("significant", "significant")]))
    page.add("</details>")
    _reproducibility(page, run, config, facts)


def _attention(page: Page, con: duckdb.DuckDBPyConnection, run: dict, checkpoint: str | None,
               explorer: Explorer) -> dict[str, dict]:
    """``--attention``: the most harmful heads' attention patterns and the scores their drill-downs recompute
    (a causal LM's token losses, a question's every choice: :mod:`~headsweep.sweep.reporting.drill_scores`); a model
    that cannot be loaded again is one warning line and a note on the page."""
    import logging
    import time

    from headsweep.sweep.reporting.attention_maps import MAX_HEADS, AttentionUnavailable, run_patterns

    shown = [h["name"] for h in sorted((h for h in explorer.heads if h["delta"] is not None),
                                       key=lambda h: (-figures.harm(run["metric"], h["delta"]), h["name"]))][:MAX_HEADS]
    start = time.perf_counter()
    losses: list = []
    try:
        patterns = run_patterns(con, run, checkpoint, shown, losses=losses, scored=TOP_EXAMPLES)
    except AttentionUnavailable as exc:
        logging.getLogger("headsweep").warning("%s", exc)
        page.add(f'<p class="note">{html.escape(str(exc))}</p>')
        return {}
    if not patterns and not losses:
        page.add('<p class="note">No attention patterns: the most harmful heads change no example for the worse.</p>')
        return {}
    heads = len({p.head for p in patterns} | {t.head for t in losses})
    what = "Attention patterns" if patterns else "Scores recomputed with the model"
    page.add(f'<p class="note">{what} of the {heads} most harmful head{"s" if heads != 1 else ""} on the examples '
             f"their removal harms most, in {time.perf_counter() - start:.1f} s (open a head's drill-down to see "
             "them).</p>")
    return attention_extras(patterns, losses)


def _inputs(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, str] | None:
    """The run's stored inputs by example id (None: a store written before schema version 10 kept none)."""
    found = fetch(con, "SELECT example_id, input FROM inputs WHERE run_id = ?", [run_id])
    return {e: t for e, t in found} if found else None


def _pruning_order(table: list[dict], run_id: str, checkpoint: str | None) -> dict[str, str]:
    """Per head, where this run's global pruning curve first masks it (``masked from 25% on, 3 heads masked``)."""
    order: dict[str, str] = {}
    rows = sorted((r for r in table if r["run_id"] == run_id and r["checkpoint"] == checkpoint
                   and r["scope"] == "global"), key=lambda r: r["level"])
    for r in rows:
        for name in r["heads_masked"] or []:
            order.setdefault(name, f"masked from the {100 * r['level']:.4g}% level on ({r['n_masked']} heads masked "
                                   f"there, {r['curve']})")
    return order


def _pruning_plot(con: duckdb.DuckDBPyConnection, run: dict, table: list[dict]) -> str:
    """The interactive pruning figure: each curve of the table with its levels' confidence bands."""
    intervals = {(r["run_id"], r["checkpoint"], tuple(r["heads_masked"] or []), r["level"]): (r["ci_low"], r["ci_high"])
                 for r in query_rows(con, "SELECT run_id, checkpoint, heads_masked, level, ci_low, ci_high FROM deltas "
                                          "WHERE level IS NOT NULL AND run_id IN (SELECT unnest(?::VARCHAR[]))",
                                     [sorted({r["run_id"] for r in table})])}
    curves: dict[str, list[plots.PruningPoint]] = {}
    for r in table:
        low, high = intervals.get((r["run_id"], r["checkpoint"], tuple(r["heads_masked"] or []), r["level"]),
                                  (None, None))
        curves.setdefault(r["curve"], []).append(plots.PruningPoint(
            level=r["level"], n_masked=r["n_masked"], score=r["score"], ci_low=low, ci_high=high,
            significant=bool(r["significant"]), p_adjusted=r["p_adjusted"], baseline=r["baseline_score"]))
    return plots.pruning(curves, run["baseline_score"], run["metric"])


def _ablation_fact(run: dict, facts: dict) -> str:
    """What a masked head left behind, with mean ablation's reference data and positions (``runs.facts``)."""
    label = ablation_label(run)
    ablation = facts.get("ablation") or {}
    if "reference" in ablation:
        reference = ablation["reference"]
        if isinstance(reference, dict):  # the files it names (all its settings are in the facts table)
            named = [k for k in ("path", "data_bin", "split", "source", "target") if k in reference] or list(reference)
            reference = ", ".join(f"{k}: {reference[k]}" for k in named)
        where = reference
        label += f" (means over {where}; positions: {ablation.get('positions')})"
    if ablation.get("keep_first"):
        label += ", first position kept"
    return label


def _reproducibility(page: Page, run: dict, config: dict, facts: dict) -> None:
    sig = config.get("significance", {})
    run_id = run["run_id"]
    config_file = f"{run_id}-config.yaml"
    page.file(config_file, yaml.safe_dump(config, sort_keys=True))
    page.add("<h3>Reproducibility</h3>")
    page.add(facts_table([
        ("config hash", run["config_hash"]), ("code version", run["code_version"]),
        ("results schema version", run["schema_version"]),
        ("seed (sweep)", config.get("seed")), ("significance seed", sig.get("seed")),
        ("bootstrap resamples", sig.get("n_resamples")), ("tests", sig.get("tests") or "default for the metric"),
        ("correction, alpha", f"{sig.get('correction')}, {sig.get('alpha')}"),
        ("sacrebleu signature", facts.get("sacrebleu_signature", "(not a BLEU run)")),
    ]))
    if facts:
        page.add("<p>Facts recorded by the workers:</p>")
        page.add(facts_table(sorted(facts.items())))
    page.add(f'<p>The run\'s resolved config, also as <a href="{html.escape(config_file)}">{html.escape(config_file)}'
             f"</a>, which loads back with the same config hash: <code>headsweep run {html.escape(config_file)}"
             "</code> repeats the run (model and data paths as they were).</p>")
    page.add(f"<pre>{html.escape(json.dumps(config, indent=2, sort_keys=True))}</pre>")


def default_report_dir(run_ids: Sequence[str]) -> Path:
    """``./headsweep-report/RUN_ID`` for one run, ``./headsweep-report`` for several."""
    return Path("headsweep-report", run_ids[0]) if len(run_ids) == 1 else Path("headsweep-report")


def _bundle() -> Path:
    """plotly.js as the installed plotly package ships it (minified, no network at view time)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


GLUE = Path(__file__).with_name("explorer.js")


def _check_weights(run: dict) -> None:
    """``--attention`` loads the run's model again: refused where its files hold other weights than the run's. A
    config that no longer loads here is left to the attention step, which says so on the page."""
    from headsweep.sweep.configuration.config import build_config

    try:
        cfg = build_config(json.loads(run["config"] or "{}"))
    except (HeadsweepError, ValueError):
        return
    check_run_weights(run, cfg, "--attention would recompute its drill-downs from weights that are not the run's "
                                "(leave out --attention for the page of what is stored)")


def write_report(store: ResultStore, run_ids: Sequence[str], out: str | Path, attention: bool = False,
                 force: bool = False, option: str = "--out") -> Path:
    """Write ``index.html``, its figures and the plotly.js bundle for ``run_ids`` under ``out``; returns the page's
    path.

    ``out`` follows the rule of every output (:mod:`headsweep.results.outputs`): a folder holding files headsweep did
    not write is refused unless ``force``, which writes beside them. Everything is written into a temporary folder
    beside ``out`` and put in place when complete, so a failure leaves no half-written report (and an earlier report
    in ``out`` stays until the new one replaces it). Kinds defined outside
    headsweep that the store's runs ran are registered first (their parts and views). ``attention``: load each
    run's model again for the drill-downs' attention patterns (:mod:`headsweep.sweep.reporting.attention_maps`)."""
    output = check_output(out, "folder", force=force, store=store, option=option)
    out = output.path
    register_stored_kinds(store)
    con = connect(store)
    try:
        runs = []
        for run_id in run_ids:
            # the baseline as `summary` gives it: the run row's, else its stored baseline evaluation's
            # and the status and count of stored evaluations as `runs` and `status` show them (one rule for all)
            rows = query_rows(con, "SELECT r.* REPLACE (s.baseline_score AS baseline_score, s.n_done AS n_done), "
                                   "epoch(now()) - epoch(r.updated_at) AS age_s FROM runs r "
                                   "JOIN summary s ON s.run_id = r.run_id WHERE r.run_id = ?", [run_id])
            if not rows:
                newest = query_rows(con, "SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 5")
                known = [r["run_id"] for r in newest]
                hint = f" (newest: {', '.join(known)})" if known else " (the store has no runs)"
                raise HeadsweepError(f"no run {run_id!r} in store {store.uri}{hint}")
            if attention:  # drill-downs recomputed from weights that are not the run's would be wrong, not late
                _check_weights(rows[0])
            runs.append(rows[0])
        with written_folder(output, "headsweep report") as work:
            _write_page(store, con, runs, work, attention)
    except duckdb.Error as exc:  # a damaged file of the run's: the line naming it, as every reading command says
        raise scan_error(store, exc) from None
    except OSError as exc:
        raise HeadsweepError(f"cannot create report folder {output.named}: {exc.strerror or exc}") from None
    finally:
        con.close()
    return out / "index.html"


def _write_page(store: ResultStore, con: duckdb.DuckDBPyConnection, runs: list[dict], work: Path,
                attention: bool) -> None:
    """The page of ``runs`` and its files, written into the folder ``work``."""
    page = Page(work)
    title = "headsweep report: " + ", ".join(f"{r['name'] or ''} ({r['run_id']})" for r in runs)
    page.add(f"<h1>{html.escape(title)}</h1>")
    page.add(f'<p class="note">Store: {html.escape(store.uri)}, read with results schema version '
             f"{SCHEMA_VERSION}. Delta = score with the heads masked minus the baseline score; negative "
             "means the heads were needed where higher is better (accuracy, BLEU), positive where lower is "
             "(perplexity). Hover a cell for its numbers; click it for the examples the head changes.</p>")
    for run in runs:
        _run_section(page, con, run, attention)
    shutil.copyfile(_bundle(), work / "plotly.min.js")
    index = work / "index.html"
    index.write_text(
        f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style><script src=\"plotly.min.js\"></script></head><body>\n"
        + "\n".join(page.parts) + "\n" + "\n".join(page.scripts)
        # the figures are drawn before the browser has parsed the drill-downs (read on the first click)
        + f"\n<script>{GLUE.read_text(encoding='utf-8')}</script>\n" + "\n".join(page.late)
        + "\n</body></html>\n", encoding="utf-8")
