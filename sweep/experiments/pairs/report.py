"""The report's part of the ``pairs`` kind: a heads x heads matrix of interactions per attention type, and the
strongest pairs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from headsweep.sweep.report_parts import figures
from headsweep.sweep.report_parts.page import TOP_HEADS, ReportPart
from headsweep.workers.core.metrics import higher_is_better


def interaction_matrix(rows: Sequence[dict], attention: str, metric: str | None, correction: str | None,
                       alpha: float | None) -> Figure:
    """Pairwise interactions of one attention type: a heads x heads matrix (symmetric, model order).

    ``rows`` are rows of the ``interactions`` table of one run and checkpoint; pairs across attention
    types are left out. Cells hold ``delta_ij - delta_i - delta_j``; red where the pair hurts more than its
    heads alone add up to (in the metric's direction), grey where no pair was evaluated, ``*`` where the
    interaction is significant. Lines mark layer boundaries.
    """
    mine = [r for r in rows if r["attention_i"] == attention and r["attention_j"] == attention]
    heads = sorted({(r["layer_i"], r["index_i"]) for r in mine} | {(r["layer_j"], r["index_j"]) for r in mine})
    at = {h: n for n, h in enumerate(heads)}
    grid = np.full((len(heads), len(heads)), np.nan)
    marks = set()
    for r in mine:
        i, j = at[(r["layer_i"], r["index_i"])], at[(r["layer_j"], r["index_j"])]
        grid[i, j] = grid[j, i] = r["interaction"]
        if r.get("significant"):
            marks |= {(i, j), (j, i)}
    span = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-(span or 1e-9), vmax=span or 1e-9)
    cmap = colormaps["RdBu" if higher_is_better(metric) else "RdBu_r"].with_extremes(bad=figures.NOT_EVALUATED)
    side = max(4.0, min(figures.MAX_WIDTH - 2.0, 0.32 * len(heads) + 2.0))
    fig = Figure(figsize=(side + 1.6, side + 0.8), dpi=figures.DPI, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="equal")
    labels = [f"{layer}:{head}" for layer, head in heads]
    ax.set_xticks(range(len(heads)), labels, rotation=90, fontsize=7 if len(heads) > 24 else 8)
    ax.set_yticks(range(len(heads)), labels, fontsize=7 if len(heads) > 24 else 8)
    ax.set_xlabel("head (layer:head)")
    ax.set_ylabel("head (layer:head)")
    for n in range(1, len(heads)):
        if heads[n][0] != heads[n - 1][0]:  # a new layer starts: mark the boundary on both axes
            ax.axhline(n - 0.5, color="black", linewidth=0.8)
            ax.axvline(n - 0.5, color="black", linewidth=0.8)
    for i, j in marks:
        dark = abs(norm(grid[i, j]) - 0.5) > 0.3
        ax.text(j, i, figures.SIGNIFICANT_MARK, ha="center", va="center", fontsize=11, fontweight="bold",
                color="white" if dark else "black")
    fig.colorbar(image, ax=ax, shrink=0.85).set_label(f"interaction, {figures.metric_label(metric)}", fontsize=9)
    test = f"adjusted p < {alpha:g} ({correction})" if alpha is not None else "adjusted p"
    fig.suptitle(f"Pairwise interactions, {attention} attention: delta(i,j) - delta(i) - delta(j)\n"
                 f"red = the pair hurts more than its heads alone; {figures.SIGNIFICANT_MARK} = significant, {test}",
                 fontsize=10)
    return fig


def interactions_part(part: ReportPart) -> None:
    """Pairwise interactions of one model of a run (nothing where it has none)."""
    rows = part.of_model("interactions", "head_i, head_j")
    if not rows:
        return
    page = part.page
    page.add("<h4>Pairwise interactions</h4>")
    page.add('<p class="note">Interaction = delta(i,j) - delta(i) - delta(j): zero where masking both heads costs '
             "what masking each alone adds up to; excess harm is positive where the pair hurts more (the heads "
             "back each other up). Paired bootstrap over the four evaluations, adjusted over the pairs.</p>")
    for attention in [a for a in part.order if any(r["attention_i"] == r["attention_j"] == a for r in rows)]:
        first = rows[0]
        page.figure(interaction_matrix(rows, attention, part.metric, first["correction"], first["alpha"]),
                    f"{part.prefix}-interactions-{attention}.png", f"pairwise interactions, {attention} attention")
    strongest = sorted(rows, key=lambda r: (-abs(r["excess_harm"]), r["head_i"], r["head_j"]))[:TOP_HEADS]
    part.table(strongest, [("head_i", "head i"), ("head_j", "head j"), ("delta_i", "delta i"),
                           ("delta_j", "delta j"), ("delta_ij", "delta both"), ("interaction", "interaction"),
                           ("excess_harm", "excess harm"), ("ci_low", "CI low"), ("ci_high", "CI high"),
                           ("p_adjusted", "adjusted p"), ("significant", "significant")])
