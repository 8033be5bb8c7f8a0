"""The report's part of the ``importance`` kind: a heat map of the heads' importance, cells labelled by rank."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from headsweep.sweep.report_parts import figures
from headsweep.sweep.report_parts.page import ReportPart


def importance_heatmap(rows: Sequence[dict], attention_order: Sequence[str]) -> Figure:
    """Head importance per (layer, head), each cell labelled with its rank (1 = most important)."""
    ranks = {(r["attention"], r["layer"], r["head"]): r["importance_rank"] for r in rows}
    normalized = any(r.get("importance_normalized") is not None for r in rows)
    key = "importance_normalized" if normalized else "importance"
    method = next((r["importance_method"] for r in rows if r.get("importance_method")), "importance")

    def text(attention: str, layer: int, head: int, value: float) -> str:
        rank = ranks.get((attention, layer, head))
        return "" if rank is None else f"#{rank}"

    if not normalized:
        label = "importance"
    elif method == "lrp":
        label = "LRP relevance (share of the layer's)"
    else:
        label = "importance (L2-normalised per layer)"
    return figures.heatmap(rows, key, attention_order, title=f"Head importance ({method})\n#rank: 1 = most important",
                           colour_label=label, text=text)


def importance_part(part: ReportPart) -> None:
    """A heat map of the heads' importance, where the run estimated it."""
    scored = [h for h in part.heads if h["importance"] is not None]
    if scored:
        part.page.add("<h4>Head importance</h4>")
        part.page.figure(importance_heatmap(scored, part.order), f"{part.prefix}-importance.png",
                         "importance heat map")
