"""``single_head`` (Michel et al. sec. 3.2): every head masked alone, in the attention types of ``sweep.attention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.plan import attention_types
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context


def single_head_unit(h: Head) -> WorkUnit:
    """The evaluation of head ``h`` masked alone (other kinds plan it under this id to share a stored one)."""
    return WorkUnit(f"single_head/{h}", "single_head", (h,), h.attention, h.layer, h.head)


class SingleHead(Experiment):
    """One evaluation per head, reported under that head; eval id ``single_head/<head>``."""

    name = "single_head"
    screened = True
    section = "sweep"  # sweep.attention

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        return [single_head_unit(h) for h in ctx.inventory.heads if h.attention in types]

    def report(self, part: ReportPart) -> None:
        """A layer x head heat map of the deltas per attention type, and the heads whose removal hurts most."""
        import html

        from headsweep.sweep.report_parts import figures
        from headsweep.sweep.report_parts.page import TOP_HEADS, fmt, score_column

        heads, metric, sig = part.heads, part.metric, part.significance
        evaluated = [h for h in heads if h["delta"] is not None]
        if not evaluated:
            return
        correction = next((h["correction"] for h in evaluated if h["correction"]), sig.get("correction"))
        alpha = next((h["alpha"] for h in evaluated if h["alpha"] is not None), sig.get("alpha"))
        part.page.add(f"<h4>Single-head ablation ({html.escape(part.ablation)})</h4>")
        part.page.figure(figures.delta_heatmap(heads, part.order, metric, correction, alpha, part.ablation),
                         f"{part.prefix}-deltas.png", "single-head delta heat map")
        # Most harmful first, in the metric's direction (a head whose removal raises perplexity hurts).
        worst = sorted(evaluated, key=lambda h: (-figures.harm(metric, h["delta"]), h["name"]))[:TOP_HEADS]
        direction = "" if figures.higher_is_better(metric) else f"; lower {figures.metric_name(metric)} is better"
        part.page.add(f"<p>Heads whose removal hurts most ({len(evaluated)} heads evaluated{direction}, "
                      f"{sum(bool(h['significant']) for h in evaluated)} significant at adjusted p &lt; {fmt(alpha)}, "
                      f"{html.escape(correction or 'no')} correction):</p>")
        part.table(worst, [("name", "head"), score_column(metric), ("delta", "delta"), ("test", "test"),
                           ("p_value", "p"), ("p_adjusted", "adjusted p"), ("significant", "significant"),
                           ("importance_rank", "importance rank")])


SINGLE_HEAD = SingleHead()
