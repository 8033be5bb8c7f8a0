"""The explorer's interactive figures, drawn with plotly (``plotly.graph_objects``), returned as JSON text.

Each function takes rows of the results views and returns one figure's JSON (``plotly.io.to_json``) for the page to
draw with the plotly.js bundle it carries. Cells and points carry the head's name as ``customdata``: clicking one
opens its drill-down (``explorer.js``). Hover text is built here, so what a reader sees on hover is what the store
holds, formatted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from headsweep.sweep.report_parts.figures import metric_label, metric_name
from headsweep.workers.core.metrics import higher_is_better

SIGNIFICANT_SYMBOL = "x-thin"
NOT_EVALUATED = "rgba(0,0,0,0)"  # plotly leaves NaN cells empty; the plot background (grey) shows through
GREY = "#d9d9d9"


def num(value: object, digits: int = 4) -> str:
    """A number as the page shows it (4 significant digits), ``n/a`` for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def head_hover(h: dict, metric: str | None) -> str:
    """The hover text of one head: its single-head delta with interval, test, raw and adjusted p, importance rank
    and roles (what the store holds; absent values say so)."""
    lines = [f"<b>{h['name']}</b>"]
    if h.get("score") is not None:
        lines.append(f"score {num(h['score'])} ({metric_name(metric)})")
    if h.get("delta") is not None:
        ci = (f" [{num(h.get('ci_low'))}, {num(h.get('ci_high'))}]" if h.get("ci_low") is not None else "")
        lines.append(f"delta {num(h['delta'])}{ci}")
        correction = h.get("correction") or "none"
        lines.append(f"p {num(h.get('p_value'))}, adjusted {num(h.get('p_adjusted'))} ({correction})")
        lines.append(f"test {h.get('test') or 'n/a'}" + (", <b>significant</b>" if h.get("significant") else ""))
    if h.get("all_but_one_delta") is not None:
        lines.append(f"all-but-one delta {num(h['all_but_one_delta'])}")
    if h.get("importance_rank") is not None:
        lines.append(f"importance rank {h['importance_rank']} ({h.get('importance_method') or 'importance'})")
    if h.get("confidence") is not None:
        lines.append(f"confidence {num(h['confidence'])}")
    roles = h.get("roles")
    lines.append("role " + (", ".join(roles) if roles else "none"))
    return "<br>".join(lines)


@dataclass
class Variant:
    """One set of heads shown on a heat map: this run's, or a sibling run's under another ablation method."""

    label: str
    heads: list[dict]


def _types(heads: Sequence[dict], order: Sequence[str]) -> list[str]:
    present = {h["attention"] for h in heads}
    return [a for a in order if a in present] + sorted(present - set(order))


def _grid(heads: Sequence[dict], attention: str, value: Callable[[dict], float | None], shape: tuple[int, int]
          ) -> tuple[np.ndarray, list[list[str]], list[list[str]]]:
    z = np.full(shape, np.nan)
    names = [["" for _ in range(shape[1])] for _ in range(shape[0])]
    text = [["" for _ in range(shape[1])] for _ in range(shape[0])]
    for h in heads:
        if h["attention"] != attention:
            continue
        v = value(h)
        if v is not None:
            z[h["layer"], h["head"]] = v
        names[h["layer"]][h["head"]] = h["name"]
        text[h["layer"]][h["head"]] = h["hover"]
    return z, names, text


def heatmap(variants: Sequence[Variant], order: Sequence[str], value: Callable[[dict], float | None], *,
            title: str, colour_label: str, diverging: bool, harm_positive: bool = False,
            marked: Callable[[dict], bool] = lambda h: bool(h.get("significant"))) -> str:
    """Heat maps of ``value`` per (layer, head), one panel per attention type, significant cells marked with an
    ``x``; with several ``variants`` (ablation methods) a switch above the figure shows one at a time. Heads
    carry their hover text under ``hover``."""
    base = variants[0].heads
    types = _types(base, order)
    shapes = {a: (max(h["layer"] for h in base if h["attention"] == a) + 1,
                  max(h["head"] for h in base if h["attention"] == a) + 1) for a in types}
    values = [v for var in variants for h in var.heads if (v := value(h)) is not None and not math.isnan(v)]
    span = max((abs(v) for v in values), default=0.0) or 1e-9
    if diverging:
        scale = "RdBu_r" if harm_positive else "RdBu"
        zrange = {"zmin": -span, "zmax": span, "zmid": 0.0}
    else:
        scale = "Viridis"
        zrange = {"zmin": min(values, default=0.0), "zmax": max(values, default=1.0)}
    fig = make_subplots(rows=1, cols=len(types), subplot_titles=[f"{a} attention" for a in types],
                        horizontal_spacing=0.06)
    visible_of: list[int] = []
    for n, var in enumerate(variants):
        for col, attention in enumerate(types, start=1):
            z, names, text = _grid(var.heads, attention, value, shapes[attention])
            fig.add_trace(go.Heatmap(
                z=z, customdata=names, text=text, hovertemplate="%{text}<extra></extra>", colorscale=scale,
                **zrange, showscale=col == len(types), colorbar={"title": {"text": colour_label, "side": "right"}},
                visible=n == 0, name=f"{var.label}: {attention}", xgap=1, ygap=1,
            ), row=1, col=col)
            visible_of.append(n)
            sig = [h for h in var.heads if h["attention"] == attention and marked(h)]
            fig.add_trace(go.Scatter(
                x=[h["head"] for h in sig], y=[h["layer"] for h in sig], mode="markers",
                marker={"symbol": SIGNIFICANT_SYMBOL, "size": 9, "color": "black", "line": {"width": 2}},
                customdata=[h["name"] for h in sig], text=[h["hover"] for h in sig],
                hovertemplate="%{text}<extra></extra>", visible=n == 0, showlegend=False,
                name=f"{var.label}: significant",
            ), row=1, col=col)
            visible_of.append(n)
            fig.update_xaxes(title_text="head", dtick=1 if shapes[attention][1] <= 16 else None, row=1, col=col,
                             range=[-0.5, shapes[attention][1] - 0.5], showgrid=False, zeroline=False)
            fig.update_yaxes(title_text="layer" if col == 1 else None, autorange="reversed", row=1, col=col,
                             dtick=1 if shapes[attention][0] <= 16 else None, showgrid=False, zeroline=False)
    if len(variants) > 1:
        fig.update_layout(updatemenus=[{
            "type": "buttons", "direction": "right", "x": 0, "xanchor": "left", "y": 1.22, "yanchor": "bottom",
            "showactive": True, "active": 0,
            "buttons": [{"label": var.label, "method": "restyle",
                         "args": [{"visible": [m == n for m in visible_of]}]} for n, var in enumerate(variants)],
        }])
    rows = max(s[0] for s in shapes.values())
    fig.update_layout(title={"text": title, "x": 0, "xanchor": "left", "font": {"size": 14}},
                      height=min(900, max(300, 22 * rows + 190)), margin={"l": 60, "r": 20, "t": 110, "b": 50},
                      plot_bgcolor=GREY, clickmode="event")
    return pio.to_json(fig, validate=False, engine="json")


@dataclass
class PruningPoint:
    """One level of a pruning curve: its score, the interval of its delta and the baseline that delta is from."""

    level: float
    n_masked: int
    score: float
    ci_low: float | None
    ci_high: float | None
    significant: bool
    p_adjusted: float | None
    baseline: float | None = None


def pruning(curves: dict[str, list[PruningPoint]], baseline: float | None, metric: str | None) -> str:
    """Score against the share of heads pruned, per curve: the line, the bootstrap confidence band of each level
    (baseline + the delta's interval), significant levels circled, and the baseline as a dashed line."""
    fig = go.Figure()
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for n, (label, points) in enumerate(curves.items()):
        colour = palette[n % len(palette)]
        x = [100.0 * p.level for p in points]
        # each level's interval is of its delta from its own model's baseline (checkpoints differ)
        bases = [p.baseline if p.baseline is not None else baseline for p in points]
        lows = [None if p.ci_low is None or b is None else b + p.ci_low for p, b in zip(points, bases, strict=True)]
        highs = [None if p.ci_high is None or b is None else b + p.ci_high for p, b in zip(points, bases, strict=True)]
        if any(v is not None for v in lows):
            fig.add_trace(go.Scatter(x=x + x[::-1], y=highs + lows[::-1], fill="toself", fillcolor=colour,
                                     opacity=0.18, line={"width": 0}, hoverinfo="skip", showlegend=True,
                                     name=f"{label}: 95% interval", legendgroup=label))
        hover = [f"{label}<br>{num(100 * p.level)}% pruned ({p.n_masked} heads)<br>score {num(p.score)}"
                 + (f" [{num(lo)}, {num(hi)}]" if lo is not None else "")
                 + f"<br>adjusted p {num(p.p_adjusted)}" + (" <b>significant</b>" if p.significant else "")
                 for p, lo, hi in zip(points, lows, highs, strict=True)]
        fig.add_trace(go.Scatter(x=x, y=[p.score for p in points], mode="lines+markers", name=label,
                                 line={"color": colour}, text=hover, hovertemplate="%{text}<extra></extra>",
                                 legendgroup=label))
        sig = [(xi, p.score) for xi, p in zip(x, points, strict=True) if p.significant]
        if sig:
            fig.add_trace(go.Scatter(x=[a for a, _ in sig], y=[b for _, b in sig], mode="markers",
                                     marker={"size": 16, "color": "rgba(0,0,0,0)", "line": {"color": "red",
                                                                                            "width": 2}},
                                     name=f"{label}: significant vs baseline", hoverinfo="skip",
                                     legendgroup=label))
    if baseline is not None:
        fig.add_hline(y=baseline, line_dash="dash", line_color="black",
                      annotation_text="baseline (no head masked)", annotation_position="top right")
    direction = "" if higher_is_better(metric) else f" (lower {metric_name(metric)} is better)"
    fig.update_layout(title={"text": "Pruning curves" + direction, "x": 0, "xanchor": "left"}, height=420,
                      xaxis_title="heads pruned (% of the scope's heads, least important first)",
                      yaxis_title=metric_label(metric), margin={"l": 60, "r": 20, "t": 50, "b": 50})
    return pio.to_json(fig, validate=False, engine="json")


def interactions(rows: Sequence[dict], attention: str, metric: str | None) -> str:
    """Pairwise interactions of one attention type: heads x heads, symmetric, significant pairs marked."""
    mine = [r for r in rows if r["attention_i"] == attention and r["attention_j"] == attention]
    heads = sorted({(r["layer_i"], r["index_i"]) for r in mine} | {(r["layer_j"], r["index_j"]) for r in mine})
    at = {h: n for n, h in enumerate(heads)}
    labels = [f"{attention}:{layer}:{head}" for layer, head in heads]
    z = np.full((len(heads), len(heads)), np.nan)
    text = [["" for _ in heads] for _ in heads]
    sig_x, sig_y = [], []
    for r in mine:
        i, j = at[(r["layer_i"], r["index_i"])], at[(r["layer_j"], r["index_j"])]
        z[i, j] = z[j, i] = r["interaction"]
        hover = (f"<b>{r['head_i']} + {r['head_j']}</b><br>interaction {num(r['interaction'])} "
                 f"[{num(r['ci_low'])}, {num(r['ci_high'])}]<br>delta i {num(r['delta_i'])}, j {num(r['delta_j'])},"
                 f" both {num(r['delta_ij'])}<br>adjusted p {num(r['p_adjusted'])}"
                 + (" <b>significant</b>" if r.get("significant") else ""))
        text[i][j] = text[j][i] = hover
        if r.get("significant"):
            sig_x += [labels[j], labels[i]]
            sig_y += [labels[i], labels[j]]
    span = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1e-9
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=labels, text=text, hovertemplate="%{text}<extra></extra>",
                               colorscale="RdBu" if higher_is_better(metric) else "RdBu_r", zmid=0,
                               zmin=-span, zmax=span, xgap=1, ygap=1,
                               colorbar={"title": {"text": f"interaction ({metric_name(metric)})", "side": "right"}}))
    if sig_x:
        fig.add_trace(go.Scatter(x=sig_x, y=sig_y, mode="markers", hoverinfo="skip", showlegend=False,
                                 marker={"symbol": SIGNIFICANT_SYMBOL, "size": 9, "color": "black",
                                         "line": {"width": 2}}))
    side = min(900, 24 * len(heads) + 200)
    fig.update_layout(title={"text": f"Pairwise interactions, {attention} attention: delta(i,j) - delta(i) - delta(j)"
                             " (x = significant)", "x": 0, "xanchor": "left"}, height=side, plot_bgcolor=GREY,
                      yaxis={"autorange": "reversed"}, margin={"l": 90, "r": 20, "t": 50, "b": 90})
    return pio.to_json(fig, validate=False, engine="json")


def distinguishable(h: dict) -> bool:
    """Whether a head's exact single-head effect stands out from noise: significant (adjusted p), or its 95%
    interval excludes zero."""
    if h.get("significant"):
        return True
    low, high = h.get("ci_low"), h.get("ci_high")
    return (low is not None and low > 0) or (high is not None and high < 0)


def _ranks(heads: Sequence[dict], value: Callable[[dict], float]) -> dict[str, int]:
    """Competition ranks, largest first: equal values share the best rank (1, 2, 2, 4), so a tie never reads as a
    difference of ranks."""
    values = sorted((value(h) for h in heads), reverse=True)
    first = {}
    for rank, v in enumerate(values, start=1):
        first.setdefault(v, rank)
    return {h["name"]: first[value(h)] for h in heads}


@dataclass
class Disagreement:
    """The cheap estimate against the exact answer, on the heads whose exact effect is distinguishable from noise.

    ``compared``: those heads (ranked among themselves: ``rank_cheap`` by the cheap estimate, most first;
    ``rank_harm`` by exact harm, most harmful first; both set on each head's dict); ``named``: the up to ``n`` of
    them whose two ranks differ most (most first, ties by name), none where both orders agree."""

    compared: list[dict]
    named: list[dict]


def disagreement(heads: Sequence[dict], key: str, n: int) -> Disagreement:
    """Where pruning by the cheap estimate (``key``) would go wrong: among the heads with both a cheap estimate and
    an exact harm whose exact effect is :func:`distinguishable` from noise, the ``n`` whose rank by ``key`` is
    farthest from their rank by harm. Heads within noise are left out: their harms are ties of zero, and the ranks
    of ties say nothing."""
    compared = [h for h in heads if h.get(key) is not None and h.get("harm") is not None and distinguishable(h)]
    by_cheap, by_harm = _ranks(compared, lambda h: h[key]), _ranks(compared, lambda h: h["harm"])
    for h in compared:
        h["rank_cheap"], h["rank_harm"] = by_cheap[h["name"]], by_harm[h["name"]]
    apart = [h for h in compared if h["rank_cheap"] != h["rank_harm"]]
    return Disagreement(compared, sorted(apart, key=lambda h: (-abs(h["rank_cheap"] - h["rank_harm"]), h["name"]))[:n])


# Labels on the scatter: one text line at LABEL_FONT px is about 14 px tall; LABEL_GAP px between label centres
# keeps them apart on a plot area as short as PLOT_MIN_HEIGHT px (the figure is 440 px tall with 130 px of margins,
# more where plotly's automatic margins grow; a taller plot only spreads them further).
LABEL_FONT = 10
LABEL_GAP = 22
PLOT_MIN_HEIGHT = 260
# Sideways, a label is about CHAR_WIDTH px per character; on a plot area PLOT_MIN_WIDTH px wide (narrower than the
# page's at any desktop width) it is placed where it covers no point, trying these shifts (shares of the x range).
CHAR_WIDTH = 6.2
PLOT_MIN_WIDTH = 800
LABEL_SHIFTS = (0.04, 0.1, 0.2)  # farther, the arrow grows too long to read


def _padded(values: Sequence[float], share: float) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * share or abs(hi) * share or 1.0
    return lo - pad, hi + pad


def label_slots(ys: Sequence[float], lo: float, hi: float, gap: float) -> list[float]:
    """Heights for labels of points at ``ys`` on an axis from ``lo`` to ``hi``: each as near its point as it can
    be while every two are at least ``gap`` apart and all stay inside (``len(ys) * gap`` must fit in the range)."""
    order = sorted(range(len(ys)), key=lambda i: -ys[i])  # top first
    slots = [0.0] * len(ys)
    ceiling = hi - gap / 2
    for i in order:  # push each down below the one above it
        slots[i] = min(ys[i], ceiling)
        ceiling = slots[i] - gap
    floor = lo + gap / 2
    for i in reversed(order):  # then up, where the bottom ones fell out of the range
        slots[i] = max(slots[i], floor)
        floor = slots[i] + gap
    return slots


@dataclass
class Frame:
    """The data ranges of a plot area and its smallest expected size in pixels: where a label lands."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def per_px(self) -> tuple[float, float]:
        return (self.x_hi - self.x_lo) / PLOT_MIN_WIDTH, (self.y_hi - self.y_lo) / PLOT_MIN_HEIGHT


def _near_segment(q: tuple[float, float], a: tuple[float, float], b: tuple[float, float], dx: float, dy: float
                  ) -> bool:
    """Whether point ``q`` is within 5 px of the segment from ``a`` to ``b`` (data coordinates; ``dx``, ``dy``: data
    per pixel)."""
    (qx, qy), (ax, ay), (bx, by) = ((x / dx, y / dy) for x, y in (q, a, b))
    vx, vy = bx - ax, by - ay
    t = max(0.0, min(1.0, ((qx - ax) * vx + (qy - ay) * vy) / ((vx * vx + vy * vy) or 1.0)))
    return math.hypot(qx - ax - t * vx, qy - ay - t * vy) <= 5


def label_place(point: tuple[float, float], heights: Sequence[float], text: str,
                points: Sequence[tuple[float, float]], frame: Frame) -> tuple[float, float, bool]:
    """Where a label of ``text`` for ``point`` goes: (x where it starts, its height, whether it runs rightwards from
    there). Of ``heights`` (its own slot first) and sideways shifts (the nearest first, toward the middle first), the
    first whose box stays inside ``frame``, covers none of ``points`` (markers, 7 px) and whose arrow runs over none;
    where every one does, the one that does least."""
    dx, dy = frame.per_px()
    width, half = len(text) * CHAR_WIDTH * dx, 9 * dy
    toward_right = point[0] <= (frame.x_lo + frame.x_hi) / 2
    best: tuple[int, float, float, bool] | None = None
    for height in heights:
        for shift in LABEL_SHIFTS:
            for rightwards in (toward_right, not toward_right):
                start = point[0] + (1 if rightwards else -1) * shift * (frame.x_hi - frame.x_lo)
                left, right = (start, start + width) if rightwards else (start - width, start)
                if not (frame.x_lo <= left and right <= frame.x_hi):
                    continue
                # a point under the label is hidden (2); one the arrow runs over only looks labelled (1)
                covered = sum(2 if left - 5 * dx <= x <= right + 5 * dx and abs(y - height) <= half + 5 * dy else
                              _near_segment((x, y), point, (start, height), dx, dy)
                              for x, y in points if (x, y) != point)
                if best is None or covered < best[0]:
                    best = (covered, start, height, rightwards)
                if covered == 0:
                    return start, height, rightwards
    if best is None:  # wider than the plot at every shift: the nearest one, toward the middle
        start = point[0] + (1 if toward_right else -1) * LABEL_SHIFTS[0] * (frame.x_hi - frame.x_lo)
        return start, heights[0], toward_right
    return best[1], best[2], best[3]


def cheap_vs_exact(heads: Sequence[dict], key: str, method: str, metric: str | None, named: Sequence[dict]) -> str:
    """Each head's cheap importance (gradient or LRP) against its exact single-head harm, in three groups
    (significant; interval excluding zero; within noise). Only ``named`` heads carry labels, each at its own
    height so that no two overlap (arrows point at their heads); the rest say who they are on hover."""
    both = [h for h in heads if h.get(key) is not None and h.get("harm") is not None]
    fig = go.Figure()
    groups = [("significant (adjusted p)", "#d62728", lambda h: bool(h.get("significant"))),
              ("95% interval excludes zero", "#1f77b4", lambda h: not h.get("significant") and distinguishable(h)),
              ("within noise (not ranked)", "#a6a6a6", lambda h: not distinguishable(h))]
    for label, colour, member in groups:
        mine = [h for h in both if member(h)]
        if not mine:
            continue
        fig.add_trace(go.Scatter(
            x=[h[key] for h in mine], y=[h["harm"] for h in mine], mode="markers", name=label,
            customdata=[h["name"] for h in mine], hovertemplate="%{text}<extra></extra>",
            text=[h["hover"] + (f"<br>rank by {method}: {h['rank_cheap']}, by harm: {h['rank_harm']}"
                                if h.get("rank_cheap") is not None else "<br>not ranked: exact effect within noise")
                  for h in mine],
            marker={"color": colour, "size": 7}))
    xs, ys = [h[key] for h in both], [h["harm"] for h in both]
    (x_lo, x_hi), (y_lo, y_hi) = _padded(xs, 0.05), _padded(ys, 0.08)
    frame = Frame(x_lo, x_hi, y_lo, y_hi)
    gap = (y_hi - y_lo) * LABEL_GAP / PLOT_MIN_HEIGHT
    slots = label_slots([h["harm"] for h in named], y_lo, y_hi, gap)
    points = list(zip(xs, ys, strict=True))
    placed: list[float] = []
    for i, (h, slot) in enumerate(zip(named, slots, strict=True)):
        text = f"{h['name']} (#{h['rank_cheap']} vs #{h['rank_harm']})"
        # its slot, or a step above or below where that stays clear of the other labels (placed ones where they
        # went, the rest at their slots) and of the edges
        others = placed + list(slots[i + 1:])
        heights = [slot] + [y for y in (slot + gap, slot - gap) if y_lo + gap / 2 <= y <= y_hi - gap / 2
                            and all(abs(y - o) >= gap for o in others)]
        start, height, rightwards = label_place((h[key], h["harm"]), heights, text, points, frame)
        placed.append(height)
        fig.add_annotation(x=h[key], y=h["harm"], ax=start, ay=height, axref="x", ayref="y",
                           xanchor="left" if rightwards else "right", showarrow=True, arrowhead=1, arrowcolor="#444",
                           font={"size": LABEL_FONT}, bgcolor="rgba(255,255,255,0.8)", text=text)
    fig.update_layout(title={"text": f"Cheap estimate ({method}) against exact single-head harm; labelled: the heads "
                                     "named below (#rank by it vs #rank by harm); hover for the others",
                             "x": 0, "xanchor": "left", "font": {"size": 13}},
                      xaxis={"title": {"text": f"{method} importance"}, "range": [x_lo, x_hi]},
                      yaxis={"title": {"text": f"harm of masking the head alone ({metric_name(metric)}, positive = "
                                               "worse)"}, "range": [y_lo, y_hi]},
                      height=440, legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
                      margin={"l": 60, "r": 20, "t": 80, "b": 50})
    return pio.to_json(fig, validate=False, engine="json")


def role_bars(h: dict) -> str | None:
    """A head's role figures from ``head_roles``: its top offset's share, its rare-word share against chance, its
    syntactic accuracy per relation against the most-frequent-offset baseline (None where the run has no roles)."""
    if h.get("confidence") is None:
        return None
    names, values, baselines = [], [], []
    if h.get("top_offset_share") is not None:
        names.append(f"offset {h['top_offset']:+d}" if h.get("top_offset") is not None else "top offset")
        values.append(h["top_offset_share"])
        baselines.append(None)
    if h.get("rare_share") is not None:
        names.append("rare word")
        values.append(h["rare_share"])
        baselines.append(h.get("rare_chance"))
    for key in sorted(k for k in h if k.endswith("_dep2gov") or k.endswith("_gov2dep")):
        if h.get(key) is not None:
            names.append(key.replace("_", " "))
            values.append(h[key])
            baselines.append(h.get(f"{key}_baseline"))
    if h.get("sink_share") is not None:
        names.append("first position (sink)")
        values.append(h["sink_share"])
        baselines.append(None)
    fig = go.Figure([go.Bar(x=names, y=values, name="this head"),
                     go.Bar(x=names, y=[b if b is not None else 0 for b in baselines], name="baseline / chance",
                            marker_color=GREY)])
    fig.update_layout(title={"text": f"{h['name']}: what it attends to (share of its attention)", "x": 0,
                             "xanchor": "left", "font": {"size": 12}}, height=280, barmode="group",
                      yaxis={"range": [0, 1], "title": "share"}, margin={"l": 50, "r": 10, "t": 40, "b": 60})
    return pio.to_json(fig, validate=False, engine="json")


def attention_map(pattern) -> str:
    """One head's attention on one example: a query x key heat map of the model's own weights (rows sum to 1 over
    every key; the map shows the first tokens only, see ``attention_maps.MAX_TOKENS``)."""
    queries = [f"{i}:{t}" for i, t in enumerate(pattern.queries)]
    keys = [f"{i}:{t}" for i, t in enumerate(pattern.keys)]
    fig = go.Figure(go.Heatmap(z=np.round(pattern.weights, 4), x=keys, y=queries, colorscale="Blues", zmin=0, zmax=1,
                               hovertemplate="query %{y}<br>key %{x}<br>weight %{z}<extra></extra>",
                               colorbar={"title": {"text": "weight", "side": "right"}}))
    side = min(640, 14 * max(len(queries), len(keys)) + 160)
    fig.update_layout(title={"text": f"{pattern.head} on example {pattern.example_id}: attention (query x key)",
                             "x": 0, "xanchor": "left", "font": {"size": 12}}, height=side, width=side + 80,
                      yaxis={"autorange": "reversed", "tickfont": {"size": 9}}, xaxis={"tickfont": {"size": 9}},
                      margin={"l": 90, "r": 10, "t": 40, "b": 90})
    return pio.to_json(fig, validate=False, engine="json")
