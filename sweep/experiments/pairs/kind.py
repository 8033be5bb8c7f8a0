"""``pairs``: pairwise head interactions, ``delta(i,j) - delta(i) - delta(j)``, into the ``interactions`` table.

The heads come from ``pairs.select`` (``all`` heads of ``sweep.attention``, the ``top_k`` ranked by
``importance`` or by single-head |delta| of this run or of ``pairs.from_run``, or a ``list``); the pairs
are all pairs among them (``pairs.scope: all``) or those within one layer (``layer``). Each pair is one
evaluation (eval id ``pairs/<head>,<head>``, experiment ``pairs``, tested against the baseline like any
mask); the single-head evaluations the pairs need are planned too (``single_head/<head>``, the
``single_head`` kind's units) unless this run evaluates them already. Then every pair's interaction is
tested with a paired bootstrap over the four evaluations resampled together
(``interactions.py``), adjusted over the pairs of one model with ``significance.correction``, and written to
``interactions``. The number of pairs is printed before the run; more than
``pairs.max_pairs`` is refused before anything is written.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment, GatedHeads
from headsweep.sweep.experiments.pairs.interactions import interaction_bootstrap
from headsweep.sweep.experiments.pairs.settings import PairsSection
from headsweep.sweep.experiments.pairs.tables import INTERACTIONS
from headsweep.sweep.experiments.plan import attention_types
from headsweep.sweep.experiments.registry import experiments_of
from headsweep.sweep.experiments.single_head import SINGLE_HEAD, single_head_unit
from headsweep.sweep.output.console import say as log
from headsweep.sweep.statistics.significance import adjust_pvalues
from headsweep.workers.core.heads import Head
from headsweep.workers.core.metrics import metric_by_name
from headsweep.workers.core.work import WorkUnit

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context

RANKED = ("importance", "single_head")


def pair_id(i: Head, j: Head) -> str:
    """Eval id of the evaluation that masks heads ``i`` and ``j`` together."""
    return f"pairs/{i},{j}"


def pairs_of(heads: list[Head], scope: str) -> list[tuple[Head, Head]]:
    """All pairs (i < j in model order) among ``heads``; with scope ``layer`` only those within one layer."""
    ordered = sorted(set(heads))
    return [(i, j) for i, j in itertools.combinations(ordered, 2) if scope == "all" or i.site == j.site]


class Pairs(Experiment):
    """Pair evaluations (and the single-head ones they need), then one interaction row per pair."""

    name = "pairs"
    whole_set = True  # interactions need every head's single-head evaluation on the whole set
    section = "pairs"
    settings = PairsSection
    table = "interactions"
    tables = (INTERACTIONS,)

    def check_settings(self, cfg: Config) -> None:
        """The ``pairs`` section is checked only for a run of pairs (``check_config``)."""

    def needs(self, cfg: Config) -> tuple[str, ...]:
        p = cfg.pairs
        return (p.select,) if p.select in RANKED and not p.from_run else ()

    def check_config(self, cfg: Config) -> None:
        cfg.pairs.check()

    def gated_attention(self, cfg: Config) -> list[GatedHeads]:
        # the other selections pair heads of sweep.attention's types
        return [GatedHeads("pairs.heads", named=tuple(cfg.pairs.heads or ()))] if cfg.pairs.select == "list" else []

    def validate(self, ctx: Context) -> None:
        p = ctx.cfg.pairs
        heads = self.fixed_heads(ctx)
        if heads is not None:
            count, what = len(pairs_of(heads, p.scope)), f"among {len(set(heads))} heads"
        else:  # ranked on this run's results: the heads are known once they are in
            count, what = ranked_bound(ctx, p.top_k, p.scope), f"at most, among the top {p.top_k} heads by {p.select}"
        if count > p.max_pairs:
            raise too_many(count, p.max_pairs)
        if count == 0:
            raise HeadsweepError(f"pairs: no pair of heads to evaluate ({p.select} heads, scope {p.scope})")
        log(f"pairs: {count} pairs {what} (scope {p.scope}), one evaluation each")

    def fixed_heads(self, ctx: Context) -> list[Head] | None:
        """The selected heads where they do not depend on this run's results (None where they do)."""
        p = ctx.cfg.pairs
        if p.select == "list":
            return [ctx.inventory.check(Head.parse(name)) for name in dict.fromkeys(p.heads or [])]
        if p.select == "all":
            types = attention_types(ctx.cfg, ctx.inventory)
            return [h for h in ctx.inventory.heads if h.attention in types]
        if p.from_run:
            return top_heads(self.scores(ctx), p.top_k)
        return None

    def scores(self, ctx: Context) -> dict[Head, float]:
        """Ranking scores (higher first) of the heads in ``sweep.attention``: importance, or |single-head delta|."""
        p = ctx.cfg.pairs
        source = p.from_run or ctx.run_id
        if p.from_run and ctx.store.run(p.from_run) is None:
            raise HeadsweepError(f"pairs.from_run: no run {p.from_run} in store {ctx.store.uri}")
        types = attention_types(ctx.cfg, ctx.inventory)
        if p.select == "importance" and not p.from_run:
            scores = ctx.shared.get("importance") or {}
        elif p.select == "importance":
            column = "score_normalized" if ctx.cfg.importance.normalize else "score"
            scores = {Head(r["attention"], r["layer"], r["head"]): r[column]
                      for r in ctx.store.read("importance", source).to_pylist() if r["checkpoint"] == ctx.checkpoint}
        else:
            columns = ["experiment", "attention", "layer", "head", "delta", "checkpoint"]
            scores = {Head(r["attention"], r["layer"], r["head"]): abs(r["delta"])
                      for r in ctx.store.read("evaluations", source, columns=columns).to_pylist()
                      if r["experiment"] == "single_head" and r["checkpoint"] == ctx.checkpoint}
        scores = {h: s for h, s in scores.items() if h.attention in types and s is not None and not math.isnan(s)}
        if len(scores) < 2:
            raise HeadsweepError(f"pairs.select {p.select}: run {source} has {p.select} scores for {len(scores)} "
                                 f"heads of {', '.join(types)}; pairs need at least two")
        return scores

    def run(self, ctx: Context) -> None:
        p = ctx.cfg.pairs
        heads = self.fixed_heads(ctx)
        ranked_here = heads is None
        if ranked_here:
            heads = top_heads(self.scores(ctx), p.top_k)
        pairs = pairs_of(heads, p.scope)
        if len(pairs) > p.max_pairs:  # validate bounded the count; a check that costs nothing
            raise too_many(len(pairs), p.max_pairs)
        if ranked_here:  # validate printed a bound; now the heads are known
            where = f" of {ctx.checkpoint}" if ctx.checkpoint else ""
            log(f"pairs: {len(pairs)} pairs among the top {len(set(heads))} heads{where} by {p.select}: "
                f"{', '.join(map(str, sorted(heads)))}")
        needed = sorted({h for pair in pairs for h in pair})
        # Single-head units another kind of this run plans are its own (they are stored by now);
        # planning them again would evaluate them twice.
        planned = set()
        if any(k.name == SINGLE_HEAD.name for k in experiments_of(ctx.cfg)):
            planned = {u.eval_id for u in SINGLE_HEAD.plan(ctx)}
        singles = [single_head_unit(h) for h in needed if single_head_unit(h).eval_id not in planned]
        units = singles + [WorkUnit(pair_id(i, j), self.name, (i, j)) for i, j in pairs]
        ctx.evaluate(units)
        ctx.flush()
        ctx.write(self.table, self.interaction_rows(ctx, needed, pairs), name=self.name)

    def interaction_rows(self, ctx: Context, heads: list[Head], pairs: list[tuple[Head, Head]]) -> list[dict]:
        """The ``interactions`` rows of ``pairs``, from the stored per-example statistics of this run."""
        ids = [single_head_unit(h).eval_id for h in heads] + [pair_id(i, j) for i, j in pairs]
        stats = stored_stats(ctx, [ctx.prefix + e for e in ids])
        position = {h: n for n, h in enumerate(heads)}
        sig = ctx.cfg.significance
        metric = metric_by_name(ctx.info.metric)
        base_score, base_stats = ctx.baseline
        result = interaction_bootstrap(
            base_stats, stats[: len(heads)], stats[len(heads):],
            np.array([position[i] for i, _ in pairs], dtype=np.int64),
            np.array([position[j] for _, j in pairs], dtype=np.int64),
            metric.score_from_stats, n_resamples=sig.n_resamples, seed=sig.seed,
        )
        adjusted = adjust_pvalues(result.p_value, sig.correction)
        rows = []
        for n, (i, j) in enumerate(pairs):
            rows.append({
                "eval_id": ctx.prefix + pair_id(i, j), "checkpoint": ctx.checkpoint, "metric": metric.name,
                "head_i": str(i), "attention_i": i.attention, "layer_i": i.layer, "index_i": i.head,
                "head_j": str(j), "attention_j": j.attention, "layer_j": j.layer, "index_j": j.head,
                "same_layer": i.site == j.site, "baseline_score": float(base_score),
                "delta_i": float(result.delta_i[n]), "delta_j": float(result.delta_j[n]),
                "delta_ij": float(result.delta_ij[n]), "interaction": float(result.interaction[n]),
                "excess_harm": float(metric.harm(result.interaction[n])) + 0.0,  # + 0.0: no -0.0
                "test": "paired_bootstrap", "ci_low": float(result.ci_low[n]), "ci_high": float(result.ci_high[n]),
                "p_value": float(result.p_value[n]), "p_adjusted": float(adjusted[n]), "correction": sig.correction,
                "alpha": sig.alpha, "significant": bool(adjusted[n] < sig.alpha),
                "n_resamples": result.n_resamples, "seed": result.seed,
            })
        return rows

    def report(self, part: ReportPart) -> None:
        from headsweep.sweep.experiments.pairs.report import interactions_part  # matplotlib: in the report only

        interactions_part(part)


def top_heads(scores: dict[Head, float], k: int) -> list[Head]:
    """The ``k`` heads with the highest scores (ties in model order)."""
    return sorted(scores, key=lambda h: (-scores[h], h))[:k]


def ranked_bound(ctx: Context, k: int, scope: str) -> int:
    """The most pairs ``k`` ranked heads can form: C(k, 2), or within layers, k heads packed into the largest."""
    types = attention_types(ctx.cfg, ctx.inventory)
    if scope == "all":
        return math.comb(min(k, sum(h.attention in types for h in ctx.inventory.heads)), 2)
    sizes = sorted((s.num_heads for s in ctx.inventory.layers if s.attention in types), reverse=True)
    total, left = 0, k
    for size in sizes:
        take = min(size, left)
        total, left = total + math.comb(take, 2), left - take
    return total


def too_many(count: int, limit: int) -> HeadsweepError:
    return HeadsweepError(f"pairs: {count} pairs is more than pairs.max_pairs={limit} (one evaluation each); "
                          "raise pairs.max_pairs, or select fewer heads (pairs.top_k, pairs.heads, pairs.scope layer)")


def stored_stats(ctx: Context, eval_ids: list[str]) -> np.ndarray:
    """Per-example statistics of ``eval_ids`` of this run, (E, N, k) in ``ctx.info.example_ids`` order."""
    import pyarrow.dataset as ds  # with pandas, 1 s of import that a refused config need not pay

    flt = (ds.field("run_id") == ctx.run_id) & ds.field("eval_id").isin(eval_ids)
    table = ctx.store.dataset("examples").to_table(columns=["eval_id", "example_id", "stats"], filter=flt)
    position = {e: n for n, e in enumerate(ctx.info.example_ids)}
    row_of = {e: n for n, e in enumerate(eval_ids)}
    k = len(ctx.baseline[1][0])
    out = np.full((len(eval_ids), len(position), k), np.nan)
    for e, x, s in zip(*(table.column(c).to_pylist() for c in ("eval_id", "example_id", "stats")), strict=True):
        out[row_of[e], position[x]] = s
    missing = [e for n, e in enumerate(eval_ids) if np.isnan(out[n]).any()]
    if missing:
        raise HeadsweepError(f"pairs: run {ctx.run_id} has no complete per-example statistics for {missing[0]}")
    return out


PAIRS = Pairs()
