"""The report's part of the ``pairs`` kind: a heads x heads matrix of interactions per attention type, and the
strongest pairs."""

from __future__ import annotations

from headsweep.sweep.reporting import figures
from headsweep.sweep.reporting.page import TOP_HEADS, ReportPart


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
        page.figure(figures.interaction_matrix(rows, attention, part.metric, first["correction"], first["alpha"]),
                    f"{part.prefix}-interactions-{attention}.png", f"pairwise interactions, {attention} attention")
    strongest = sorted(rows, key=lambda r: (-abs(r["excess_harm"]), r["head_i"], r["head_j"]))[:TOP_HEADS]
    part.table(strongest, [("head_i", "head i"), ("head_j", "head j"), ("delta_i", "delta i"),
                           ("delta_j", "delta j"), ("delta_ij", "delta both"), ("interaction", "interaction"),
                           ("excess_harm", "excess harm"), ("ci_low", "CI low"), ("ci_high", "CI high"),
                           ("p_adjusted", "adjusted p"), ("significant", "significant")])
