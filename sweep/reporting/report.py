"""``headsweep report``: one self-contained HTML page (inline style, no scripts, nothing fetched)
plus PNG figures, for one or more runs of a store.

Per run (and per training checkpoint when the run swept several): a layer x head heat map of
single-head deltas per attention type with significance marks, the heads whose removal hurts
most, the all-but-one table, an importance heat map; the run's pruning curves (global and per
attention type, with the curves of other runs of the same model and data whose pruning scope
differs); and the facts needed to reproduce it. Everything comes from the query views.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

import duckdb
import yaml

from headsweep.errors import HeadsweepError
from headsweep.results.query import connect
from headsweep.results.schema import SCHEMA_VERSION
from headsweep.results.store import ResultStore
from headsweep.sweep.reporting import figures, report_roles

TOP_HEADS = 10
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
"""


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence = ()) -> list[dict]:
    # Through Arrow: DuckDB's own Python conversion of time-zone timestamps needs pytz.
    return con.sql(sql, params=list(params)).to_arrow_table().to_pylist()


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """An HTML table of ``rows`` with (key, header) ``columns``; text cells align left."""
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for r in rows:
        cells = []
        for key, _ in columns:
            value = r.get(key)
            cls = ' class="text"' if isinstance(value, str) else ""
            cells.append(f"<td{cls}>{html.escape(_fmt(value))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _facts_table(pairs: Sequence[tuple[str, object]]) -> str:
    rows = "".join(f'<tr><th>{html.escape(k)}</th><td class="text">{html.escape(_fmt(v))}</td></tr>'
                   for k, v in pairs)
    return f"<table>{rows}</table>"


class _Page:
    """Collects HTML and the figures it names, all under one folder."""

    def __init__(self, out: Path):
        self.out = out
        self.parts: list[str] = []
        self.files: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig, name: str, alt: str) -> None:
        width, height = figures.save(fig, str(self.out / name))
        self.files.append(name)
        self.add(f'<img src="{html.escape(name)}" width="{width}" height="{height}" alt="{html.escape(alt)}">')

    def file(self, name: str, text: str) -> None:
        (self.out / name).write_text(text, encoding="utf-8")
        self.files.append(name)


def _checkpoints(con: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[str | None, str]]:
    """The run's checkpoints (None for a single model) with short labels like ``ckpt1 (epoch2)``."""
    rows = _rows(con, "SELECT checkpoint, min(eval_id) AS first FROM evaluations WHERE run_id = ? "
                      "GROUP BY checkpoint ORDER BY first", [run_id])
    if len(rows) <= 1:
        return [(rows[0]["checkpoint"] if rows else None, "")]
    return [(r["checkpoint"], f"{r['first'].split('/')[0]} ({Path(r['checkpoint'] or '').name})") for r in rows]


def _same(column: str) -> str:
    return f"{column} IS NOT DISTINCT FROM ?"


def _pruning_curves(con: duckdb.DuckDBPyConnection, run: dict, checkpoints: list[tuple[str | None, str]],
                    heads_per_type: dict[str, int]) -> tuple[list[figures.Curve], list[dict]]:
    """This run's pruning curves, plus the newest curve of each scope this run lacks from other
    complete runs of the same model, data, checkpoint and baseline score (Michel et al. prune each
    attention type on its own: with headsweep, one run per ``prune.attention``)."""
    run_id = run["run_id"]
    curves: list[figures.Curve] = []
    table: list[dict] = []
    for checkpoint, label in checkpoints:
        baseline = _rows(con, f"SELECT score FROM evaluations WHERE run_id = ? AND {_same('checkpoint')} "
                              "AND experiment = 'baseline'", [run_id, checkpoint])
        own = _rows(con, f"SELECT * FROM pruning WHERE run_id = ? AND {_same('checkpoint')} ORDER BY scope, level",
                    [run_id, checkpoint])
        others = _rows(con, f"""
            SELECT p.* FROM pruning p JOIN runs r USING (run_id)
            WHERE p.run_id <> ? AND {_same('p.checkpoint')} AND r.status = 'complete'
              AND {_same('r.model')} AND {_same('r.dataset')} AND {_same('r.metric')}
              AND abs(p.baseline_score - ?) <= {SAME_BASELINE}
            ORDER BY r.created_at DESC, p.run_id, p.scope, p.level""",
                       [run_id, checkpoint, run["model"], run["dataset"], run["metric"],
                        baseline[0]["score"] if baseline else None]) if own else []
        for r in own + others:  # L0 gates (Voita et al.) beside the importance curve of the same scope
            if r.get("method") == "l0":
                r["scope"] = f"L0 gates, {r['scope']}"
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


def _run_section(page: _Page, con: duckdb.DuckDBPyConnection, run: dict) -> None:
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
    page.add(_facts_table([
        ("status", run["status"]), ("model", run["model"]), ("data", run["dataset"]),
        ("metric", figures.metric_label(metric)),
        ("direction", "higher is better" if figures.higher_is_better(metric) else "lower is better"),
        ("baseline score", run["baseline_score"]), ("examples", run["n_examples"]),
        ("evaluations done / planned", f"{run['n_done']} / {run['n_planned']}"),
        ("heads", ", ".join(f"{a}: {n}" for a, n in heads_per_type.items())),
        ("created", run["created_at"]), ("updated", run["updated_at"]),
    ] + ([("error", run["error"])] if run["error"] else [])))

    checkpoints = _checkpoints(con, run_id)
    sig = config.get("significance", {})
    for checkpoint, label in checkpoints:
        prefix = run_id + (f"-{label.split(' ')[0]}" if label else "")
        if label:
            page.add(f"<h3>Checkpoint {html.escape(label)}: {html.escape(checkpoint or '')}</h3>")
        heads = _rows(con, f"SELECT * FROM heads WHERE run_id = ? AND {_same('checkpoint')} "
                           "ORDER BY attention, layer, head", [run_id, checkpoint])
        _single_head(page, heads, order, metric, sig, prefix)
        layers = _rows(con, f"SELECT * FROM layers WHERE run_id = ? AND {_same('checkpoint')}", [run_id, checkpoint])
        layers.sort(key=lambda r: (order.index(r["attention"]) if r["attention"] in order else 99, r["layer"]))
        if layers:
            page.add("<h4>All-but-one: the best head to keep alone in each layer</h4>")
            better = "highest" if figures.higher_is_better(metric) else "lowest"
            page.add('<p class="note">Every other head of the layer (same attention type) is masked; the best head '
                     f"is the one with the {better} {html.escape(figures.metric_name(metric))}; delta is "
                     "against the unmasked baseline.</p>")
            page.add(_table(layers, [("attention", "attention"), ("layer", "layer"), ("best_head", "best head"),
                                     _score_column(metric), ("delta", "delta"),
                                     ("p_adjusted", "adjusted p"), ("significant", "significant"),
                                     ("worst_delta", "worst delta in layer"), ("n_heads", "heads")]))
        if any(h["importance"] is not None for h in heads):
            page.add("<h4>Head importance</h4>")
            page.figure(figures.importance_heatmap([h for h in heads if h["importance"] is not None], order),
                        f"{prefix}-importance.png", "importance heat map")
        _roles(page, con, run_id, checkpoint, order, metric, prefix)
        _interactions(page, con, run_id, checkpoint, order, metric, prefix)

    curves, table = _pruning_curves(con, run, checkpoints, heads_per_type)
    if curves:
        page.add("<h3>Pruning curves</h3>")
        page.add('<p class="note">At each level the least important heads (of the scope) are masked together; '
                 "circled points differ significantly from the baseline (adjusted p).</p>")
        page.figure(figures.pruning_figure(curves, metric, heads_per_type), f"{run_id}-pruning.png", "pruning curves")
        page.add(_table(table, [("curve", "curve"), ("percent", "% pruned"), ("n_masked", "heads masked"),
                                _score_column(metric), ("relative_score", "relative to baseline"),
                                ("p_adjusted", "adjusted p"), ("significant", "significant")]))
    _reproducibility(page, run, config, facts)


def _interactions(page: _Page, con: duckdb.DuckDBPyConnection, run_id: str, checkpoint: str | None,
                  order: list[str], metric: str | None, prefix: str) -> None:
    """Pairwise interactions (the ``pairs`` kind): a heads x heads matrix per attention type, the strongest pairs."""
    rows = _rows(con, f"SELECT * FROM interactions WHERE run_id = ? AND {_same('checkpoint')} ORDER BY head_i, "
                      "head_j", [run_id, checkpoint])
    if not rows:
        return
    page.add("<h4>Pairwise interactions</h4>")
    page.add('<p class="note">Interaction = delta(i,j) - delta(i) - delta(j): zero where masking both heads costs '
             "what masking each alone adds up to; excess harm is positive where the pair hurts more (the heads "
             "back each other up). Paired bootstrap over the four evaluations, adjusted over the pairs.</p>")
    for attention in [a for a in order if any(r["attention_i"] == r["attention_j"] == a for r in rows)]:
        first = rows[0]
        page.figure(figures.interaction_matrix(rows, attention, metric, first["correction"], first["alpha"]),
                    f"{prefix}-interactions-{attention}.png", f"pairwise interactions, {attention} attention")
    strongest = sorted(rows, key=lambda r: (-abs(r["excess_harm"]), r["head_i"], r["head_j"]))[:TOP_HEADS]
    page.add(_table(strongest, [("head_i", "head i"), ("head_j", "head j"), ("delta_i", "delta i"),
                                ("delta_j", "delta j"), ("delta_ij", "delta both"), ("interaction", "interaction"),
                                ("excess_harm", "excess harm"), ("ci_low", "CI low"), ("ci_high", "CI high"),
                                ("p_adjusted", "adjusted p"), ("significant", "significant")]))


def _roles(page: _Page, con: duckdb.DuckDBPyConnection, run_id: str, checkpoint: str | None, order: list[str],
           metric: str | None, prefix: str) -> None:
    """What the heads do (the ``roles`` kind): confidence and role map, scatters, the share of heads with a role."""
    rows = _rows(con, f"SELECT * FROM roles WHERE run_id = ? AND {_same('checkpoint')} ORDER BY attention, layer, "
                      "head", [run_id, checkpoint])
    if not rows:
        return
    page.add("<h4>What the heads do (Voita et al. 2019)</h4>")
    page.figure(report_roles.confidence_role_map(rows, order), f"{prefix}-roles.png", "confidence and role map")
    fig, correlations = report_roles.scatter_panels(rows, metric)
    if fig is not None:
        page.figure(fig, f"{prefix}-roles-scatter.png", "confidence and importance against ablation harm")
        page.add(_table(correlations, [("x", "x"), ("y", "y"), ("rho", "Spearman rho"), ("p_value", "p"),
                                       ("n", "heads")]))
    levels = _rows(con, f"SELECT * FROM pruning WHERE run_id = ? AND {_same('checkpoint')}", [run_id, checkpoint])
    scopes = sorted({r["scope"] for r in levels}, key=lambda x: (x != "all", x))
    first = report_roles.pruned_first([r for r in levels if scopes and r["scope"] == scopes[0]])
    page.add('<p class="note">Of the heads whose single-head removal is significant, and of those the first '
             "pruning level removes, how many play a role; the first row is the base rate.</p>")
    page.add(_table(report_roles.role_shares(rows, first),
                    [("group", "heads"), ("heads", "n"), ("with_role", "with a role"), ("share", "share"),
                     ("positional", "positional"), ("rare_words", "rare words"), ("syntactic", "syntactic")]))


def _score_column(metric: str | None) -> tuple[str, str]:
    return "score", f"score ({figures.metric_name(metric)})"


def _single_head(page: _Page, heads: list[dict], order: list[str], metric: str | None, sig: dict,
                 prefix: str) -> None:
    evaluated = [h for h in heads if h["delta"] is not None]
    if not evaluated:
        return
    correction = next((h["correction"] for h in evaluated if h["correction"]), sig.get("correction"))
    alpha = next((h["alpha"] for h in evaluated if h["alpha"] is not None), sig.get("alpha"))
    page.add("<h4>Single-head ablation</h4>")
    page.figure(figures.delta_heatmap(heads, order, metric, correction, alpha), f"{prefix}-deltas.png",
                "single-head delta heat map")
    # Most harmful first, in the metric's direction (a head whose removal raises perplexity hurts).
    worst = sorted(evaluated, key=lambda h: (-figures.harm(metric, h["delta"]), h["name"]))[:TOP_HEADS]
    direction = "" if figures.higher_is_better(metric) else f"; lower {figures.metric_name(metric)} is better"
    page.add(f"<p>Heads whose removal hurts most ({len(evaluated)} heads evaluated{direction}, "
             f"{sum(bool(h['significant']) for h in evaluated)} significant at adjusted p &lt; {_fmt(alpha)}, "
             f"{html.escape(correction or 'no')} correction):</p>")
    page.add(_table(worst, [("name", "head"), _score_column(metric), ("delta", "delta"),
                            ("test", "test"), ("p_value", "p"), ("p_adjusted", "adjusted p"),
                            ("significant", "significant"), ("importance_rank", "importance rank")]))


def _reproducibility(page: _Page, run: dict, config: dict, facts: dict) -> None:
    sig = config.get("significance", {})
    run_id = run["run_id"]
    config_file = f"{run_id}-config.yaml"
    page.file(config_file, yaml.safe_dump(config, sort_keys=True))
    page.add("<h3>Reproducibility</h3>")
    page.add(_facts_table([
        ("config hash", run["config_hash"]), ("code version", run["code_version"]),
        ("results schema version", run["schema_version"]),
        ("seed (sweep)", config.get("seed")), ("significance seed", sig.get("seed")),
        ("bootstrap resamples", sig.get("n_resamples")), ("tests", sig.get("tests") or "default for the metric"),
        ("correction, alpha", f"{sig.get('correction')}, {sig.get('alpha')}"),
        ("sacrebleu signature", facts.get("sacrebleu_signature", "(not a BLEU run)")),
    ]))
    if facts:
        page.add("<p>Facts recorded by the workers:</p>")
        page.add(_facts_table(sorted(facts.items())))
    page.add(f'<p>The run\'s resolved config, also as <a href="{html.escape(config_file)}">{html.escape(config_file)}'
             f"</a>, which loads back with the same config hash: <code>headsweep run {html.escape(config_file)}"
             "</code> repeats the run (model and data paths as they were).</p>")
    page.add(f"<pre>{html.escape(json.dumps(config, indent=2, sort_keys=True))}</pre>")


def default_report_dir(run_ids: Sequence[str]) -> Path:
    """``./headsweep-report/RUN_ID`` for one run, ``./headsweep-report`` for several."""
    return Path("headsweep-report", run_ids[0]) if len(run_ids) == 1 else Path("headsweep-report")


def write_report(store: ResultStore, run_ids: Sequence[str], out: str | Path) -> Path:
    """Write ``index.html`` and its figures for ``run_ids`` under ``out``; returns the page's path."""
    out = Path(out)
    con = connect(store)
    try:
        runs = []
        for run_id in run_ids:
            # the baseline as `summary` gives it: the run row's, else its stored baseline evaluation's
            rows = _rows(con, "SELECT r.* REPLACE (s.baseline_score AS baseline_score) FROM runs r "
                              "JOIN summary s ON s.run_id = r.run_id WHERE r.run_id = ?", [run_id])
            if not rows:
                known = [r["run_id"] for r in _rows(con, "SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 5")]
                hint = f" (newest: {', '.join(known)})" if known else " (the store has no runs)"
                raise HeadsweepError(f"no run {run_id!r} in store {store.uri}{hint}")
            runs.append(rows[0])
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HeadsweepError(f"cannot create report folder {out}: {exc.strerror}") from None
        page = _Page(out)
        title = "headsweep report: " + ", ".join(f"{r['name'] or ''} ({r['run_id']})" for r in runs)
        page.add(f"<h1>{html.escape(title)}</h1>")
        page.add(f'<p class="note">Store: {html.escape(store.uri)}, read with results schema version '
                 f"{SCHEMA_VERSION}. Delta = score with the heads masked minus the baseline score; negative "
                 "means the heads were needed where higher is better (accuracy, BLEU), positive where lower is "
                 "(perplexity).</p>")
        for run in runs:
            _run_section(page, con, run)
    finally:
        con.close()
    index = out / "index.html"
    index.write_text(f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
                     f"</title><style>{STYLE}</style></head><body>\n" + "\n".join(page.parts) + "\n</body></html>\n",
                     encoding="utf-8")
    return index
