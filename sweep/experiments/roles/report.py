"""The report's "what the heads do" part (Voita et al. 2019): confidence and roles beside the ablation results.

Per run and checkpoint with ``head_roles`` rows: a heat map of confidence per attention type whose cells name
each head's roles (the role map), scatters of confidence and of importance (LRP relevance or gradient
importance, whichever the run estimated) against the harm of the head's single-head ablation with Spearman's
rank correlation, and the paper's question in one table: of the heads whose removal is significant, how many
have a role; of the heads pruned first, how many; against the share among all heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from matplotlib.figure import Figure

from headsweep.sweep.report_parts import figures
from headsweep.sweep.report_parts.page import ReportPart

# Short cell labels: positional heads by offset, rare-word heads, syntactic heads by relation.
ROLE_CODES = {"rare_words": "R", "attention_sink": "B"}


def role_code(role: str) -> str:
    """``positional:-1`` -> ``P-1``, ``rare_words`` -> ``R``, ``attention_sink`` -> ``B`` (attends to the first
    position: BOS), ``syntactic:amod`` -> ``S:amod``."""
    if role in ROLE_CODES:
        return ROLE_CODES[role]
    kind, _, detail = role.partition(":")
    if kind == "positional":
        return "P" + (detail if detail.startswith("-") else f"+{detail}" if detail else "")
    if kind == "syntactic":
        return f"S:{detail}"
    return role


def confidence_role_map(rows: Sequence[dict], attention_order: Sequence[str]) -> Figure:
    """Confidence per (layer, head) per attention type, each cell labelled with the head's role codes."""
    labels = {(r["attention"], r["layer"], r["head"]): " ".join(role_code(x) for x in (r["roles"] or []))
              for r in rows}

    def text(attention: str, layer: int, head: int, _value: float) -> str:
        return labels.get((attention, layer, head), "")

    title = ("Head confidence (mean largest attention weight on a word) and roles\n"
             "P-1/P+1 positional, R rare words, B attention sink, S:rel syntactic")
    return figures.heatmap(rows, "confidence", attention_order, title=title,
                           colour_label="confidence (0-1)", text=text)


def spearman(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, int]:
    """Spearman's rho, its p-value and n over the pairs where both values are present (NaN below 3 pairs)."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a is not None and b is not None
             and not (math.isnan(a) or math.isnan(b))]
    if len(pairs) < 3 or len({a for a, _ in pairs}) < 2 or len({b for _, b in pairs}) < 2:
        return float("nan"), float("nan"), len(pairs)
    from scipy.stats import spearmanr  # 1.6 s of import that a report without roles need not pay

    result = spearmanr([a for a, _ in pairs], [b for _, b in pairs])
    return float(result.statistic), float(result.pvalue), len(pairs)


def scatter_panels(rows: Sequence[dict], metric: str | None) -> tuple[Figure | None, list[dict]]:
    """Confidence and importance against the harm of each head's ablation, and importance against confidence;
    returns the figure (None without two quantities to compare) and one table row per panel."""
    importance_name = next((f"importance ({r['importance_method']})" for r in rows if r.get("importance_method")),
                           "importance")
    quantity: dict[str, Callable[[dict], float | None]] = {
        "confidence": lambda r: r["confidence"],
        importance_name: lambda r: r["importance_normalized"] if r["importance_normalized"] is not None
        else r["importance"],
        f"harm of ablation ({figures.metric_name(metric)})": lambda r: None if r["delta"] is None
        else figures.harm(metric, r["delta"]),
    }
    names = list(quantity)
    panels = [(names[0], names[2]), (names[1], names[2]), (names[0], names[1])]
    present = [(a, b) for a, b in panels if sum(quantity[a](r) is not None and quantity[b](r) is not None
                                                for r in rows) >= 3]
    if not present:
        return None, []
    fig = Figure(figsize=(4.2 * len(present), 3.8), dpi=figures.DPI, layout="constrained")
    table = []
    for ax, (a, b) in zip(fig.subplots(1, len(present), squeeze=False).ravel(), present, strict=True):
        xs = [quantity[a](r) for r in rows]
        ys = [quantity[b](r) for r in rows]
        rho, p, n = spearman(xs, ys)
        significant = [bool(r.get("significant")) for r in rows]
        for flag, colour, label in ((False, "#4c72b0", "not significant"), (True, "#c44e52", "significant")):
            pts = [(x, y) for x, y, s in zip(xs, ys, significant, strict=True)
                   if s == flag and x is not None and y is not None]
            if pts:
                ax.scatter([x for x, _ in pts], [y for _, y in pts], s=18, c=colour, label=label)
        ax.set_xlabel(a)
        ax.set_ylabel(b)
        ax.set_title(f"Spearman rho = {rho:.2f} (p = {p:.2g}, n = {n})", fontsize=9)
        ax.legend(fontsize=7)
        table.append({"x": a, "y": b, "rho": rho, "p_value": p, "n": n})
    fig.suptitle("What the heads do against what removing them costs (red: ablation significant)")
    return fig, table


def role_shares(rows: Sequence[dict], pruned_first: set[tuple[str, int, int]]) -> list[dict]:
    """The paper's question: how many heads in each group have a role (any, and by kind)."""
    def count(group: list[dict]) -> dict:
        def has(kind: str) -> int:
            return sum(any(x.split(":")[0] == kind for x in (r["roles"] or [])) for r in group)
        with_role = sum(bool(r["roles"]) for r in group)
        return {"heads": len(group), "with_role": with_role,
                "share": with_role / len(group) if group else float("nan"), "positional": has("positional"),
                "rare_words": has("rare_words"), "syntactic": has("syntactic")}

    groups = [("all heads", list(rows)),
              ("removal significant", [r for r in rows if r.get("significant")])]
    if pruned_first:
        groups.append(("pruned first", [r for r in rows if (r["attention"], r["layer"], r["head"]) in pruned_first]))
    return [{"group": name, **count(group)} for name, group in groups]


def pruned_first(levels: Sequence[dict]) -> set[tuple[str, int, int]]:
    """The heads of the first pruning level that masks any (``pruning`` view rows of one curve)."""
    for level in sorted(levels, key=lambda r: r["level"]):
        if level["heads_masked"]:
            out = set()
            for name in level["heads_masked"]:
                attention, layer, head = name.split(":")
                out.add((attention, int(layer), int(head)))
            return out
    return set()


def roles_part(part: ReportPart) -> None:
    """What the heads do (the ``roles`` kind): confidence and role map, scatters, the share of heads with a role."""
    rows = part.of_model("roles", "attention, layer, head")
    if not rows:
        return
    page = part.page
    page.add("<h4>What the heads do (Voita et al. 2019)</h4>")
    page.figure(confidence_role_map(rows, part.order), f"{part.prefix}-roles.png", "confidence and role map")
    fig, correlations = scatter_panels(rows, part.metric)
    if fig is not None:
        page.figure(fig, f"{part.prefix}-roles-scatter.png", "confidence and importance against ablation harm")
        part.table(correlations, [("x", "x"), ("y", "y"), ("rho", "Spearman rho"), ("p_value", "p"), ("n", "heads")])
    levels = part.of_model("pruning")
    scopes = sorted({r["scope"] for r in levels}, key=lambda x: (x != "all", x))
    first = pruned_first([r for r in levels if scopes and r["scope"] == scopes[0]])
    page.add('<p class="note">Of the heads whose single-head removal is significant, and of those the first '
             "pruning level removes, how many play a role; the first row is the base rate.</p>")
    part.table(role_shares(rows, first),
               [("group", "heads"), ("heads", "n"), ("with_role", "with a role"), ("share", "share"),
                ("positional", "positional"), ("rare_words", "rare words"), ("syntactic", "syntactic")])
