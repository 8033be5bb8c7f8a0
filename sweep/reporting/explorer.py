"""The interactive part of a run's report: heat maps, pruning curves, interactions, the cheap-vs-exact scatter, and
a drill-down per head, for one model of one run.

Figures are plotly JSON (``plots``); the page draws them with the plotly.js bundle it carries (``explorer.js`` is
the glue: draw each figure, open a head's drill-down when a cell or point is clicked). Drill-downs are HTML
fragments rendered here, one per head, kept in a JSON block and shown on click: what a head's removal changes, on
which examples (``example_changes``), beside its statistics, importance rank, pruning order and roles.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb

from headsweep.sweep.report_parts.figures import harm, metric_name
from headsweep.sweep.report_parts.page import rows as query_rows
from headsweep.sweep.report_parts.page import same
from headsweep.sweep.reporting import plots
from headsweep.sweep.reporting.drill_scores import ChoiceScores, NotRecomputed, TokenLosses
from headsweep.sweep.reporting.example_changes import Changes, changes, top_changed, value_name
from headsweep.workers.ablation.registry import DEFAULT_METHOD
from headsweep.workers.core.metrics import higher_is_better

TOP_EXAMPLES = 5  # per direction, per head
MAX_TEXT = 600  # characters of an input or output shown in a drill-down (the store keeps all of it)
NAMED_HEADS = 5  # heads named under the cheap-vs-exact scatter (and labelled on it)

HEADS_SQL = f"""
SELECT h.*, d.ci_low, d.ci_high, d.eval_id, r.confidence, r.top_offset, r.top_offset_share, r.rare_share,
       r.rare_chance, r.roles, r.* EXCLUDE (run_id, checkpoint, attention, layer, head, n_tokens, confidence, entropy,
       top_offset, top_offset_share, rare_share, rare_sentences, rare_chance, roles)
FROM heads h
LEFT JOIN (SELECT * FROM deltas WHERE experiment = 'single_head') d
  ON d.run_id = h.run_id AND d.checkpoint IS NOT DISTINCT FROM h.checkpoint
     AND d.attention = h.attention AND d.layer = h.layer AND d.head = h.head
LEFT JOIN head_roles r
  ON r.run_id = h.run_id AND r.checkpoint IS NOT DISTINCT FROM h.checkpoint
     AND r.attention = h.attention AND r.layer = h.layer AND r.head = h.head
WHERE h.run_id = ? AND {same('h.checkpoint')}
ORDER BY h.attention, h.layer, h.head
"""


def heads_of(con: duckdb.DuckDBPyConnection, run_id: str, checkpoint: str | None) -> list[dict]:
    """Every head of one model of a run: the ``heads`` view with its single-head interval, eval id and roles."""
    return query_rows(con, HEADS_SQL, [run_id, checkpoint])


def siblings(con: duckdb.DuckDBPyConnection, run: dict) -> list[dict]:
    """The newest complete run per other ablation method of the same model, data, metric and heads (what
    ``headsweep compare`` pairs): the heat maps' method switch."""
    return query_rows(con, """
        SELECT * FROM (
            SELECT *, row_number() OVER (PARTITION BY coalesce(ablation, 'zero') ORDER BY created_at DESC) AS n
            FROM runs WHERE run_id <> ? AND model IS NOT DISTINCT FROM ? AND dataset IS NOT DISTINCT FROM ?
              AND metric IS NOT DISTINCT FROM ? AND heads IS NOT DISTINCT FROM ? AND status = 'complete'
              AND coalesce(ablation, 'zero') <> ?)
        WHERE n = 1 ORDER BY coalesce(ablation, 'zero')""",
                      [run["run_id"], run["model"], run["dataset"], run["metric"], run["heads"],
                       run.get("ablation") or DEFAULT_METHOD])


def _cut(text: object) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " ..."


@dataclass
class Explorer:
    """The interactive section of one model of one run; ``key`` names its elements on the page."""

    con: duckdb.DuckDBPyConnection
    run: dict
    checkpoint: str | None
    order: list[str]
    key: str

    def __post_init__(self) -> None:
        self.metric = self.run["metric"]
        self.heads = heads_of(self.con, self.run["run_id"], self.checkpoint)
        for h in self.heads:
            h["hover"] = plots.head_hover(h, self.metric)
        self.figures: list[tuple[str, str]] = []  # (element id, figure JSON)

    # -- the figures ---------------------------------------------------------------------
    def heatmaps(self) -> list[str]:
        """HTML of the heat maps that have values: single-head delta (with the method switch), all-but-one,
        importance, role confidence."""
        parts = []
        variants = [plots.Variant(f"{self.run.get('ablation') or 'zero'} ablation (this run)", self.heads)]
        for other in siblings(self.con, self.run):
            theirs = heads_of(self.con, other["run_id"], self.checkpoint)
            for h in theirs:
                h["hover"] = plots.head_hover(h, self.metric) + f"<br>run {other['run_id']}"
            if any(h["delta"] is not None for h in theirs):
                variants.append(plots.Variant(f"{other.get('ablation') or 'zero'} ablation (run {other['run_id']})",
                                              theirs))
        worse = "red = worse" + ("" if higher_is_better(self.metric) else f" ({metric_name(self.metric)} went up)")
        if any(h["delta"] is not None for h in self.heads):
            parts.append(self._figure("deltas", plots.heatmap(
                variants, self.order, lambda h: h["delta"], diverging=True,
                harm_positive=not higher_is_better(self.metric), colour_label=f"delta {metric_name(self.metric)}",
                title=f"Single-head ablation: change in {metric_name(self.metric)} with one head masked; x = "
                      f"significant (adjusted p); {worse}. Click a cell for its examples.")))
        if any(h["all_but_one_delta"] is not None for h in self.heads):
            parts.append(self._figure("all-but-one", plots.heatmap(
                variants[:1], self.order,
                lambda h: h["all_but_one_delta"], diverging=True, harm_positive=not higher_is_better(self.metric),
                colour_label=f"delta {metric_name(self.metric)}", marked=lambda h: False,
                title="All-but-one: change when every other head of the layer is masked and this one kept")))
        if any(h["importance"] is not None for h in self.heads):
            method = next((h["importance_method"] for h in self.heads if h["importance_method"]), "importance")
            normalized = any(h["importance_normalized"] is not None for h in self.heads)
            key = "importance_normalized" if normalized else "importance"
            parts.append(self._figure("importance", plots.heatmap(
                variants[:1], self.order, lambda h: h[key], diverging=False, marked=lambda h: False,
                colour_label=f"{method}" + (" (normalised per layer)" if normalized else ""),
                title=f"Head importance ({method}); hover for its rank (1 = most important)")))
        if any(h.get("confidence") is not None for h in self.heads):
            parts.append(self._figure("confidence", plots.heatmap(
                variants[:1], self.order, lambda h: h.get("confidence"), diverging=False,
                marked=lambda h: bool(h.get("roles")), colour_label="confidence (0-1)",
                title="Role confidence (mean largest attention weight); x = the head has a role (hover names it)")))
        if any(h["importance"] is not None and h["delta"] is not None for h in self.heads):
            method = next((h["importance_method"] for h in self.heads if h["importance_method"]), "importance")
            for h in self.heads:
                if h["delta"] is not None:
                    h["harm"] = harm(self.metric, h["delta"])
            found = plots.disagreement(self.heads, "importance", NAMED_HEADS)
            # where the two orders agree, the note (and the labels) name the most harmful of the compared heads
            named = found.named or sorted(found.compared, key=lambda h: (h["rank_harm"], h["name"]))[:NAMED_HEADS]
            parts.append(self._figure("cheap-vs-exact", plots.cheap_vs_exact(self.heads, "importance", method,
                                                                             self.metric, named)))
            parts.append(disagreement_note(found, named, method))
        return parts

    def interactions(self) -> list[str]:
        rows = query_rows(self.con, f"SELECT * FROM interactions WHERE run_id = ? AND {same('checkpoint')} "
                                    "ORDER BY head_i, head_j", [self.run["run_id"], self.checkpoint])
        types = [a for a in self.order if any(r["attention_i"] == r["attention_j"] == a for r in rows)]
        return [self._figure(f"pairs-{a}", plots.interactions(rows, a, self.metric)) for a in types]

    def _figure(self, name: str, figure: str) -> str:
        element = f"fig-{self.key}-{name}"
        self.figures.append((element, figure))
        return plot_div(element, figure, self.key)

    # -- the drill-downs -----------------------------------------------------------------
    def drilldowns(self, pruned_at: dict[str, str], inputs: dict[str, str] | None,
                   extras: dict[str, dict] | None = None) -> dict[str, dict]:
        """Per head name, its drill-down: ``html`` (the fragment) and ``figs`` (figure JSON texts: its role figure,
        its attention patterns from ``extras``, which may also add ``html``)."""
        found = changes(self.con, self.run["run_id"], self.checkpoint, self.metric)
        top = top_changed(found, TOP_EXAMPLES) if found is not None else {}
        filled = filled_columns(found) if found is not None else set()
        out = {}
        for h in self.heads:
            parts = [f"<h3>Head {html.escape(h['name'])}</h3>", self._facts(h, pruned_at.get(h["name"]))]
            if found is None:
                parts.append('<p class="note">This run stored no per-example rows for its baseline (an older store, '
                             "or a run stopped before its baseline): no examples to show.</p>")
            elif h.get("eval_id") is None:
                parts.append('<p class="note">This head was not ablated alone in this run: no examples.</p>')
            else:
                worse, better = top.get(h["eval_id"], ((), ()))
                parts.append(self._examples(found, worse, "Examples its removal makes worse", inputs, filled))
                parts.append(self._examples(found, better, "Examples its removal makes better", inputs, filled))
            more = (extras or {}).get(h["name"], {})
            if more.get("html"):
                parts.append(more["html"])
            role = plots.role_bars(h)
            out[h["name"]] = {"html": "\n".join(parts), "figs": ([role] if role else []) + more.get("figs", [])}
        return out

    def _facts(self, h: dict, pruned: str | None) -> str:
        rows = []
        if h["delta"] is not None:
            ci = f" [{plots.num(h['ci_low'])}, {plots.num(h['ci_high'])}]" if h.get("ci_low") is not None else ""
            rows += [("delta (95% interval)", f"{plots.num(h['delta'])}{ci}"),
                     ("score / baseline", f"{plots.num(h['score'])} / {plots.num(h['baseline_score'])}"),
                     ("test, p, adjusted p", f"{h['test']}, {plots.num(h['p_value'])}, {plots.num(h['p_adjusted'])}"
                                             f" ({h['correction'] or 'none'})"),
                     ("significant", "yes" if h["significant"] else "no")]
        if h["all_but_one_delta"] is not None:
            rows.append(("all-but-one delta (only this head kept in its layer)", plots.num(h["all_but_one_delta"])))
        if h["importance_rank"] is not None:
            rows.append(("importance rank", f"{h['importance_rank']} of {len(self.heads)} "
                                            f"({h['importance_method']}, 1 = most important)"))
        if pruned:
            rows.append(("pruning order", pruned))
        if h.get("confidence") is not None:
            rows.append(("confidence", plots.num(h["confidence"])))
            rows.append(("roles", ", ".join(h["roles"] or []) or "none"))
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td class=\"text\">{html.escape(str(v))}</td></tr>"
                        for k, v in rows)
        return f'<table class="facts">{cells}</table>'

    def _examples(self, found, indices: Sequence[int], title: str, inputs: dict[str, str] | None,
                  filled: set[str]) -> str:
        if len(indices) == 0:
            return f"<h4>{html.escape(title)}</h4><p class=\"note\">None: no example changed that way.</p>"
        name = value_name(self.metric)
        head = ["example", "input"]
        head += ["reference"] if "reference" in filled else []
        head += ["baseline output", "output with the head masked"] if "output" in filled else []
        head += [f"{name}, baseline", f"{name}, masked", "change"]
        # a pair's two answers: its stored answer NLL and logit difference give both log-probabilities (one softmax)
        pair = self.metric == "logit_diff" and found.loss is not None and found.base_loss is not None
        if pair:
            head += ["log p(answer), baseline", "log p(answer), masked", "log p(wrong answer), baseline",
                     "log p(wrong answer), masked"]
        elif found.loss is not None:  # a question's gold NLL, a classifier's loss
            head += ["loss, baseline", "loss, masked"]
        body = []
        for i in indices:
            example = str(found.example_ids[i])
            text = inputs.get(example) if inputs is not None else None
            cells = [example, _cut(text) if text is not None else "(not stored)"]
            if "reference" in filled:
                cells.append(_cut(found.reference[i]))
            if "output" in filled:
                flipped = found.output[i] != found.base_output[i]
                cells += [_cut(found.base_output[i]), _cut(found.output[i]) + (" (changed)" if flipped else "")]
            cells += [plots.num(float(found.base[i])), plots.num(float(found.value[i])),
                      plots.num(float(found.value[i] - found.base[i]))]
            if pair:
                answer = (-float(found.base_loss[i]), -float(found.loss[i]))
                cells += [plots.num(answer[0]), plots.num(answer[1]), plots.num(answer[0] - float(found.base[i])),
                          plots.num(answer[1] - float(found.value[i]))]
            elif found.loss is not None and found.base_loss is not None:
                cells += [plots.num(float(found.base_loss[i])), plots.num(float(found.loss[i]))]
            body.append('<tr class="example">' + "".join(f'<td class="text">{html.escape(c)}</td>' for c in cells)
                        + "</tr>")
        header = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        return f"<h4>{html.escape(title)}</h4><table class=\"examples\"><tr>{header}</tr>{''.join(body)}</table>"


def filled_columns(found: Changes) -> set[str]:
    """Which of the drill-downs' optional text columns the run's family fills anywhere: ``reference``, ``output``
    (the baseline's and the masked model's; a causal LM's perplexity windows have none). A column empty for every
    example of the run is left out of every drill-down, so each shows the same columns."""
    def any_text(*columns) -> bool:
        return any(v is not None and str(v) != "" for column in columns for v in column)

    return ({"reference"} if any_text(found.reference) else set()) | (
        {"output"} if any_text(found.output, found.base_output) else set())


def disagreement_note(found: plots.Disagreement, named: Sequence[dict], method: str) -> str:
    """The line under the cheap-vs-exact scatter: the heads whose two ranks differ most, or that the two orders
    agree, or that no head's exact effect stands out from noise; ranks count among the compared heads only."""
    listed = ", ".join(f"{html.escape(h['name'])} (#{h['rank_cheap']} by {html.escape(method)}, #{h['rank_harm']} by "
                       "harm)" for h in named)
    if found.named:
        text = (f"Heads where the cheap estimate and the exact answer disagree most, ranked among the "
                f"{len(found.compared)} heads whose exact effect is distinguishable from noise (significant, or a 95% "
                f"interval excluding zero; the others' harms are ties within noise): {listed}.")
    elif len(found.compared) == 1:
        text = (f"Nothing disagrees: only one head's exact effect is distinguishable from noise ({listed}), so there "
                "is no order for the cheap estimate to get wrong.")
    elif found.compared:
        text = (f"Nothing disagrees: the cheap estimate orders the {len(found.compared)} heads whose exact effect is "
                f"distinguishable from noise as the exact answer does (most harmful: {listed}).")
    else:
        text = ("Nothing to compare: no head's exact effect is distinguishable from noise (none significant, no 95% "
                "interval excluding zero), so no ranking by harm exists for the cheap estimate to disagree with.")
    return f'<p class="note disagreement">{text}</p>'


def attention_extras(patterns: Sequence, losses: Sequence) -> dict[str, dict]:
    """Per head, its attention-pattern figures and what its drill-down recomputed with the model
    (:mod:`~headsweep.sweep.reporting.drill_scores`): a causal LM window's tokens whose loss it raises most, a
    question's every choice's log-likelihood, or the line saying why nothing was recomputed."""
    out: dict[str, dict] = {}
    for p in patterns:
        out.setdefault(p.head, {"figs": [], "html": ""})["figs"].append(plots.attention_map(p))
    noted: set[str] = set()
    for t in losses:
        entry = out.setdefault(t.head, {"figs": [], "html": ""})
        if isinstance(t, NotRecomputed):
            if t.head not in noted:
                entry["html"] += f'<p class="note recomputed">{html.escape(t.note)}</p>'
                noted.add(t.head)
        elif isinstance(t, ChoiceScores):
            entry["html"] += _choice_table(t)
        else:
            entry["html"] += _token_table(t)
    return out


def _token_table(t: TokenLosses) -> str:
    rows = "".join(f"<tr><td>{pos}</td><td class=\"text\">{html.escape(word)}</td><td>{plots.num(a)}</td>"
                   f"<td>{plots.num(b)}</td><td>{plots.num(b - a)}</td></tr>" for pos, word, a, b in t.tokens)
    base, masked = t.window_nll
    return (f"<h4>Window {html.escape(t.example_id)}: the tokens whose loss rises most with the head masked "
            f"(recomputed with the model; window NLL {plots.num(base)} -> {plots.num(masked)} nats)</h4>"
            "<table class=\"tokens\"><tr><th>position</th><th>token</th><th>NLL baseline (nats)</th>"
            f"<th>NLL masked</th><th>rise</th></tr>{rows}</table>")


def _choice_table(t: ChoiceScores) -> str:
    def pick(values: list[float]) -> int:
        return max(range(len(values)), key=lambda c: (values[c], -c))  # the first maximum, as argmax

    picked = (pick(t.baseline), pick(t.masked))
    rows = "".join(
        f'<tr class="choice{" gold" if c == t.gold else ""}"><td>{c}{" (gold)" if c == t.gold else ""}</td>'
        f'<td class="text">{html.escape(_cut(text))}</td><td>{plots.num(a)}'
        f'{" *" if c == picked[0] else ""}</td><td>{plots.num(b)}{" *" if c == picked[1] else ""}</td>'
        f"<td>{plots.num(b - a)}</td></tr>"
        for c, (text, a, b) in enumerate(zip(t.choices, t.baseline, t.masked, strict=True)))
    return (f"<h4>Question {html.escape(t.example_id)}: every choice's log-likelihood (nats, recomputed with the "
            "model; * = the likeliest)</h4><table class=\"choices\"><tr><th>choice</th><th>text</th>"
            f"<th>baseline</th><th>head masked</th><th>change</th></tr>{rows}</table>")


def plot_div(element: str, figure: str, drill: str | None = None) -> str:
    """The element a figure is drawn into, as tall as the figure will be: figures drawn as they near the viewport
    then move nothing on the page."""
    height = json.loads(figure).get("layout", {}).get("height") or 450
    extra = f' data-drill="{html.escape(drill)}"' if drill else ""
    return f'<div class="plot" id="{html.escape(element)}" style="height: {int(height)}px"{extra}></div>'


def figure_scripts(figures: Sequence[tuple[str, str]]) -> str:
    """The figures as JSON blocks the glue draws (``</`` escaped so no figure text ends the block)."""
    return "\n".join(f'<script type="application/json" class="hs-figure" data-target="{html.escape(element)}">'
                     f"{safe_json(figure)}</script>" for element, figure in figures)


def safe_json(text: str) -> str:
    """JSON text that can sit inside a ``<script>`` element."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def drill_script(key: str, heads: dict[str, dict]) -> str:
    """The drill-downs of one model as a JSON block (read on the first click)."""
    return (f'<script type="application/json" class="hs-heads" data-key="{html.escape(key)}">'
            f"{safe_json(json.dumps(heads, separators=(',', ':')))}</script>")
