"""``all_but_one`` (Michel et al. sec. 3.3): in one layer of one attention type, every head masked but one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.plan import attention_types
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context


class AllButOne(Experiment):
    """One evaluation per (layer, kept head), reported under the kept head; eval id ``all_but_one/<head>``."""

    name = "all_but_one"
    section = "sweep"  # sweep.attention

    def plan(self, ctx: Context) -> list[WorkUnit]:
        types = attention_types(ctx.cfg, ctx.inventory)
        units = []
        for shape in ctx.inventory.layers:
            if shape.attention not in types:
                continue
            heads = shape.heads()
            for kept in heads:
                masked = tuple(h for h in heads if h != kept)
                units.append(
                    WorkUnit(f"all_but_one/{kept}", "all_but_one", masked, kept.attention, kept.layer, kept.head)
                )
        return units

    def report(self, part: ReportPart) -> None:
        """Per layer, the best head to keep alone (the ``layers`` view)."""
        import html

        from headsweep.sweep.report_parts import figures
        from headsweep.sweep.report_parts.page import score_column

        order, metric = part.order, part.metric
        layers = part.of_model("layers")
        layers.sort(key=lambda r: (order.index(r["attention"]) if r["attention"] in order else 99, r["layer"]))
        if not layers:
            return
        part.page.add(f"<h4>All-but-one ({html.escape(part.ablation)}): the best head to keep alone in each layer</h4>")
        better = "highest" if figures.higher_is_better(metric) else "lowest"
        part.page.add('<p class="note">Every other head of the layer (same attention type) is masked; the best head '
                      f"is the one with the {better} {html.escape(figures.metric_name(metric))}; delta is "
                      "against the unmasked baseline.</p>")
        part.table(layers, [("attention", "attention"), ("layer", "layer"), ("best_head", "best head"),
                            score_column(metric), ("delta", "delta"), ("p_adjusted", "adjusted p"),
                            ("significant", "significant"), ("worst_delta", "worst delta in layer"),
                            ("n_heads", "heads")])


ALL_BUT_ONE = AllButOne()
