"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Each function takes rows of the results views and returns a ``Figure`` of a fixed size in
inches (``save`` writes it at ``DPI``), so the PNG's pixel size is known in advance. Heat maps
of deltas use a diverging colour scale centred on zero; every axis names its quantity and unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure

from headsweep.workers.core.metrics import higher_is_better

DPI = 100
SIGNIFICANT_MARK = "*"
# Cells carry their value as text while it stays legible.
MAX_ANNOTATED_HEADS = 16
NOT_EVALUATED = "#d9d9d9"  # grey cells: heads the run did not evaluate

METRIC_NAMES = {"accuracy": "accuracy", "accuracy_norm": "length-normalised accuracy", "bleu": "BLEU",
                "perplexity": "perplexity"}
METRIC_UNITS = {"accuracy": "fraction correct, 0-1", "accuracy_norm": "fraction correct, 0-1",
                "bleu": "sacrebleu, 0-100",
                "perplexity": "exp(mean NLL per token), lower is better"}


def metric_name(metric: str | None) -> str:
    """The metric as people write it (``BLEU``)."""
    return METRIC_NAMES.get(metric or "", metric or "score")


def harm(metric: str | None, delta: float) -> float:
    """How much worse than the baseline a score is (positive: the masked heads were needed)."""
    return -delta if higher_is_better(metric) else delta


def metric_label(metric: str | None) -> str:
    """The metric with its unit, for axis and colour-bar labels."""
    unit = METRIC_UNITS.get(metric or "")
    return f"{metric_name(metric)} ({unit})" if unit else metric_name(metric)


def _grid(rows: Sequence[dict], attention: str, key: str) -> np.ndarray:
    mine = [r for r in rows if r["attention"] == attention]
    layers = max(r["layer"] for r in mine) + 1
    heads = max(r["head"] for r in mine) + 1
    grid = np.full((layers, heads), np.nan)
    for r in mine:
        if r.get(key) is not None:
            grid[r["layer"], r["head"]] = r[key]
    return grid


def _order(rows: Sequence[dict], attention_order: Sequence[str]) -> list[str]:
    present = {r["attention"] for r in rows}
    return [a for a in attention_order if a in present] + sorted(present - set(attention_order))


MAX_WIDTH = 16.0  # inches; wider rows of heat maps are stacked instead


def heatmap_size(grids: Sequence[tuple[int, int]]) -> tuple[float, float, bool]:
    """Figure size in inches for one heat map per (layers, heads) grid plus a colour bar, and
    whether the maps are stacked (one per row) rather than side by side."""
    widths = [max(2.4, 0.55 * heads + 1.0) for _, heads in grids]
    heights = [max(1.3, 0.45 * layers + 0.9) for layers, _ in grids]
    side_by_side = sum(widths) + 1.6
    if side_by_side <= MAX_WIDTH or len(grids) == 1:
        return round(max(6.0, side_by_side), 2), round(max(heights) + 1.2, 2), False
    return round(max(6.0, max(widths) + 1.6), 2), round(sum(heights) + 1.2, 2), True


def _heatmaps(rows: Sequence[dict], key: str, attention_order: Sequence[str], *, title: str, colour_label: str,
              centred: bool, text: callable, harm_positive: bool = False) -> Figure:
    """One heat map per attention type. Diverging maps are red where a value means harm: negative values,
    or positive ones with ``harm_positive`` (deltas of a metric where lower is better)."""
    types = _order(rows, attention_order)
    grids = [_grid(rows, a, key) for a in types]
    values = np.concatenate([g[~np.isnan(g)] for g in grids]) if grids else np.array([])
    diverging = centred or bool(values.size and values.min() < 0)
    if diverging:
        # Centred on zero so that white means "no change" and the two signs are equally intense.
        span = float(np.abs(values).max()) if values.size else 0.0
        span = span if span > 0 else 1e-9
        norm = TwoSlopeNorm(vcenter=0.0, vmin=-span, vmax=span)
        cmap = colormaps["RdBu_r" if harm_positive else "RdBu"]
    else:
        top = float(values.max()) if values.size and values.max() > 0 else 1.0
        norm, cmap = Normalize(vmin=0.0, vmax=top), colormaps["viridis"]
    cmap = cmap.with_extremes(bad=NOT_EVALUATED)

    def dark(value: float) -> bool:
        if np.isnan(value):
            return False
        return abs(norm(value) - 0.5) > 0.3 if diverging else norm(value) < 0.45

    width, height, stacked = heatmap_size([g.shape for g in grids] or [(1, 1)])
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    n = max(1, len(grids))
    axes = fig.subplots(n if stacked else 1, 1 if stacked else n, squeeze=False).ravel()
    image = None
    for ax, attention, grid in zip(axes, types, grids, strict=False):
        layers, heads = grid.shape
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="equal")
        ax.set_title(f"{attention} attention")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
        if heads <= MAX_ANNOTATED_HEADS:
            small = 7 if heads > 8 else 8
            for layer in range(layers):
                for head in range(heads):
                    label = text(attention, layer, head, grid[layer, head])
                    if label:
                        alone = label == SIGNIFICANT_MARK  # a bare mark: big enough to spot
                        ax.text(head, layer, label, ha="center", va="center", fontsize=13 if alone else small,
                                fontweight="bold" if alone else "normal",
                                color="white" if dark(grid[layer, head]) else "black")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.9).set_label(colour_label, fontsize=9)
    fig.suptitle(title)
    return fig


def delta_heatmap(rows: Sequence[dict], attention_order: Sequence[str], metric: str | None,
                  correction: str | None, alpha: float | None, ablation: str = "zero ablation") -> Figure:
    """Single-head ablation: delta per (layer, head) per attention type, ``*`` where significant.

    ``rows`` are rows of the ``heads`` view for one run and checkpoint; ``ablation``: what the masked head left
    behind (``mean ablation``...), named in the title.
    """
    marks = {(r["attention"], r["layer"], r["head"]) for r in rows if r.get("significant")}

    def text(attention: str, layer: int, head: int, value: float) -> str:
        mark = SIGNIFICANT_MARK if (attention, layer, head) in marks else ""
        if math.isnan(value):
            return mark
        return (f"{value:+.2g}" if value else "0") + mark if len(rows) <= 64 else mark

    test = f"adjusted p < {alpha:g} ({correction})" if alpha is not None else "adjusted p"
    worse = "red = worse" + ("" if higher_is_better(metric) else f" ({metric_name(metric)} went up)")
    title = (f"Single-head ablation ({ablation}): change in {metric_name(metric)} when one head is masked\n"
             f"{SIGNIFICANT_MARK} = significant, {test}; {worse}")
    return _heatmaps(rows, "delta", attention_order, title=title, colour_label=f"delta {metric_label(metric)}",
                     centred=True, text=text, harm_positive=not higher_is_better(metric))


def heatmap(rows: Sequence[dict], key: str, attention_order: Sequence[str], *, title: str, colour_label: str,
            text: callable) -> Figure:
    """One sequential heat map of ``key`` per attention type, each cell labelled by ``text(attention, layer,
    head, value)``: the shape of the importance map, for other per-head quantities."""
    return _heatmaps(rows, key, attention_order, title=title, colour_label=colour_label, centred=False, text=text)


@dataclass
class Curve:
    """One pruning curve: scores at levels, which levels are significant, and its baseline."""

    label: str
    levels: list[float]
    scores: list[float]
    significant: list[bool]
    baseline: float | None
    kept: dict[str, list[int]] = field(default_factory=dict)  # attention type -> heads left per level


PRUNING_SIZE = (11.0, 4.4)


def pruning_figure(curves: Sequence[Curve], metric: str | None, heads_per_type: dict[str, int]) -> Figure:
    """Score against the share of heads pruned, with the baseline and significant levels marked.

    A second panel shows, for global curves of a model with several attention types, how many
    heads of each type are left at each level.
    """
    with_types = [c for c in curves if c.kept] if len(heads_per_type) > 1 else []
    fig = Figure(figsize=PRUNING_SIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 2 if with_types else 1, squeeze=False)[0]
    ax = axes[0]
    colours = [f"C{i}" for i in range(10)]
    baselines_drawn: set[float] = set()
    several = len({round(c.baseline, 12) for c in curves if c.baseline is not None}) > 1
    for i, c in enumerate(curves):
        colour = colours[i % len(colours)]
        x = [100.0 * p for p in c.levels]
        ax.plot(x, c.scores, marker="o", color=colour, label=c.label)
        sig = [(xi, s) for xi, s, flag in zip(x, c.scores, c.significant, strict=True) if flag]
        if sig:
            ax.scatter(*zip(*sig, strict=True), s=140, facecolors="none", edgecolors="red", linewidths=1.5, zorder=3)
        if c.baseline is not None and round(c.baseline, 12) not in baselines_drawn:
            baselines_drawn.add(round(c.baseline, 12))
            ax.axhline(c.baseline, color=colour if several else "black", linestyle="--", linewidth=1,
                       label=f"baseline, {c.label}" if several else "baseline (no head masked)")
    if any(any(c.significant) for c in curves):
        ax.scatter([], [], s=140, facecolors="none", edgecolors="red", label="significant vs baseline (adjusted p)")
    ax.set_xlabel("heads pruned (% of the heads in scope, least important first)")
    ax.set_ylabel(metric_label(metric))
    ax.set_xlim(-3, 103)
    ax.set_title("Pruning curve" + ("" if higher_is_better(metric) else f" (lower {metric_name(metric)} is better)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if with_types:
        ax2 = axes[1]
        for j, c in enumerate(with_types):
            for k, (attention, left) in enumerate(c.kept.items()):
                share = [100.0 * n / heads_per_type[attention] for n in left]
                label = attention if len(with_types) == 1 else f"{attention} ({c.label})"
                # Types often go at the same pace: distinct markers and dashes keep overlapping lines visible.
                ax2.plot([100.0 * p for p in c.levels], share, linestyle=["-", "--", ":", "-."][(j + k) % 4],
                         marker="osD^v"[k % 5], markersize=6 - k, color=f"C{k}", label=label)
        ax2.set_xlabel("heads pruned, all types together (%)")
        ax2.set_ylabel("heads left in the attention type (%)")
        ax2.set_xlim(-3, 103)
        ax2.set_ylim(-3, 103)
        ax2.set_title("Which attention types global pruning removes")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8, loc="best")
    return fig


def save(fig: Figure, path: str) -> tuple[int, int]:
    """Write ``fig`` as a PNG at ``DPI``; returns its (width, height) in pixels."""
    fig.savefig(path, dpi=DPI, format="png")
    width, height = fig.get_size_inches()
    return round(width * DPI), round(height * DPI)
