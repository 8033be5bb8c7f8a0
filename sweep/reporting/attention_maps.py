"""Attention patterns for the drill-downs (``headsweep report RUN --attention``, ``Store.attention``).

The run's model is loaded again from its config (in this process, no Ray) on only the examples shown, and read as
the roles experiment reads it (``ModelFamily.attention_reader``: the weights captured at the attention modules, on
the unfused path that computes them per head, so never a map of zeros from a fused kernel). Budget: the
``MAX_HEADS`` most harmful heads, on the ``EXAMPLES`` examples each of their removals harms most (at most 24
examples, one forward pass over them), each map cut to its first ``MAX_TOKENS`` real query and key tokens; time is
one model load plus that pass. A model that cannot be loaded (the folder moved, the hub cache was cleared) is one
line (``AttentionUnavailable``), and the rest of the report is written without the patterns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.sweep.reporting.drill_scores import drill_scores, recomputes, run_fill, token_scores
from headsweep.sweep.reporting.example_changes import changes, fetch, one, top_changed

MAX_HEADS = 8
EXAMPLES = 3
MAX_TOKENS = 48


class AttentionUnavailable(HeadsweepError):
    """The run's model could not be loaded again: no attention patterns (one line saying why)."""


@dataclass
class Pattern:
    """One head's attention on one example: ``weights[q, k]`` from query token ``queries[q]`` to key ``keys[k]``."""

    head: str
    example_id: str
    queries: list[str]
    keys: list[str]
    weights: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        return {"head": self.head, "example_id": self.example_id, "queries": self.queries, "keys": self.keys,
                "weights": self.weights}


def _model_path(cfg: Any) -> str | None:
    model = cfg.model
    for name in ("path", "checkpoint", "checkpoint_path"):
        value = getattr(model, name, None)
        if value:
            return str(value)
    return None


def load_adapter(config_json: str, positions: list[int]) -> Any:
    """The run's model and data (from its stored config) on the evaluation examples at ``positions``."""
    from headsweep.sweep.configuration.config import build_config
    from headsweep.workers.families.registry import model_family

    try:
        cfg = build_config(json.loads(config_json))
    except HeadsweepError as exc:
        raise AttentionUnavailable(f"--attention: the run's config no longer loads here: {exc}") from None
    where = _model_path(cfg) or cfg.model.kind
    if Path(where).is_absolute() and not Path(where).exists():  # a hub id is no absolute path: the loader says
        raise AttentionUnavailable(f"--attention: the run's model folder {where} is not there any more (moved or "
                                   "deleted): the page has no attention patterns; the rest of it is written")
    try:
        family = model_family(cfg.model.kind)
        # the family's own options (fairseq's carry more), on CPU, plain path, only the examples shown
        runtime = family.runtime(device="cpu", threads=1, reuse=False, examples=tuple(positions))
        return family.load(cfg.model, cfg.data, runtime)
    except (HeadsweepError, OSError, ValueError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AttentionUnavailable(f"--attention: cannot load the run's model from {where} ({line}): the page has "
                                   "no attention patterns; the rest of it is written") from None


def _tokens(adapter: Any, vocab: str, ids: list[int]) -> list[str]:
    tokenizer = getattr(adapter, "tokenizer", None)
    if tokenizer is not None:
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    dictionary = getattr(adapter, "tgt_dict" if vocab == "target" else "src_dict", None)
    if dictionary is not None:
        return [dictionary[i] for i in ids]
    return [str(i) for i in ids]


def read_patterns(adapter: Any, kind: str, wanted: dict[int, list[tuple[str, int, int, str]]]) -> list[Pattern]:
    """The maps of ``wanted[row]`` = [(head name, site layer, head index, example id)] for each row (example) of
    ``adapter``'s data, read in one pass of its unmasked model."""
    from headsweep.workers.families.registry import model_family

    reader = model_family(kind).attention_reader(adapter)
    found: list[Pattern] = []
    batch = {"n": 0}

    def sink(key: Any, site: Any) -> None:
        attention, layer = key
        rows = site.queries.examples if site.queries.examples is not None else site.keys.examples
        if rows is None:  # the reader does not say: the adapter's batches, in order
            rows = adapter.batches[batch["n"]]
            rows = rows[0] if isinstance(rows, tuple) else rows["id"] if isinstance(rows, dict) else rows
        rows = [int(r) for r in rows]
        for b, row in enumerate(rows):
            for name, at_layer, head, example_id in wanted.get(row, []):
                if name.split(":")[0] != attention or at_layer != layer:
                    continue
                q = site.queries.real[b].nonzero().flatten()[:MAX_TOKENS]
                k = site.keys.real[b].nonzero().flatten()[:MAX_TOKENS]
                w = site.weights[b, head].float()[q][:, k].cpu().numpy()
                queries = _tokens(adapter, site.queries.vocab, site.queries.ids[b, q].tolist())
                keys = _tokens(adapter, site.keys.vocab, site.keys.ids[b, k].tolist())
                found.append(Pattern(name, example_id, queries, keys, w))

    for _ in reader.read(sink):
        batch["n"] += 1
    return found


def run_patterns(con: duckdb.DuckDBPyConnection, run: dict, checkpoint: str | None, heads: list[str],
                 per_head: int = EXAMPLES, losses: list[Any] | None = None, scored: int = 0) -> list[Pattern]:
    """Attention patterns of ``heads`` of one model of a run on the ``per_head`` examples each one's removal harms
    most (from the store's per-example rows); raises :class:`AttentionUnavailable` when the model is gone. With
    ``losses``, what the drill-downs recompute on those examples under the run's fill is appended to it
    (:func:`~headsweep.sweep.reporting.drill_scores.drill_scores`: a causal LM window's token losses, a question's
    choice scores; a question's on the ``scored`` examples its removal changes most in either direction, what the
    drill-down lists), and a model whose examples the roles reader does not read
    (multiple-choice questions) gives no patterns rather than an error."""
    wanted_evals = {r[0]: r[1] for r in fetch(con,
        "SELECT attention || ':' || layer || ':' || head, eval_id FROM evaluations WHERE run_id = ? AND "
        "experiment = 'single_head' AND checkpoint IS NOT DISTINCT FROM ?", [run["run_id"], checkpoint])}
    evals = [wanted_evals[h] for h in heads if h in wanted_evals]
    found = changes(con, run["run_id"], checkpoint, run["metric"], eval_ids=evals)
    if found is None or not evals:
        return []
    top = top_changed(found, per_head)
    both = top_changed(found, scored) if losses is not None and scored > per_head else top
    positions = dict(fetch(con, "SELECT example_id, position FROM inputs WHERE run_id = ?", [run["run_id"]]))
    if not positions:  # before stored inputs: the baseline's rows are in example order
        base = fetch(con, "SELECT example_id FROM examples WHERE run_id = ? AND eval_id = (SELECT min(eval_id) FROM "
                          "evaluations WHERE run_id = ? AND experiment = 'baseline' AND checkpoint IS NOT DISTINCT "
                          "FROM ?)", [run["run_id"], run["run_id"], checkpoint])
        positions = {e: i for i, (e,) in enumerate(base)}
    picks: list[tuple[str, str]] = []
    score_picks: list[tuple[str, str]] = []
    for name in heads:
        worse, _ = top.get(wanted_evals.get(name, ""), ((), ()))
        picks += [(name, str(found.example_ids[i])) for i in worse]
        worse, better = both.get(wanted_evals.get(name, ""), ((), ()))
        score_picks += [(name, str(found.example_ids[i])) for i in [*worse, *better]]
    score_picks = list(dict.fromkeys(picks + score_picks))
    used = sorted({positions[e] for _, e in score_picks if e in positions})
    if not used:
        return []
    config = run["config"]
    if checkpoint is not None:  # the model of this checkpoint
        from headsweep.sweep.configuration.config import build_config
        from headsweep.workers.families.registry import model_family

        data = json.loads(config)
        key = model_family(build_config(data).model.kind).checkpoint_key
        data["model"][key] = checkpoint
        data.pop("checkpoints", None)
        config = json.dumps(data)
    adapter = load_adapter(config, used)
    row_of = {p: n for n, p in enumerate(used)}
    wanted: dict[int, list[tuple[str, int, int, str]]] = {}
    for name, example in picks:
        attention, layer, head = name.split(":")
        if example in positions:
            wanted.setdefault(row_of[positions[example]], []).append((name, int(layer), int(head), example))
    kind = json.loads(config)["model"]["kind"]
    if losses is None:
        return read_patterns(adapter, kind, wanted)
    # a window's tokens whose loss rises: the examples a head harms; a question's choices: both directions
    scored_picks = picks if token_scores(adapter) else score_picks
    shown = [(n, e, row_of[positions[e]]) for n, e in scored_picks if e in positions]
    if recomputes(adapter):
        losses += drill_scores(adapter, run_fill(con, run, checkpoint), shown)
    from headsweep.workers.families.registry import model_family

    try:
        model_family(kind).attention_reader(adapter)
    except HeadsweepError:  # the family's roles reader refuses these examples: the recomputed scores alone
        return []
    return read_patterns(adapter, kind, wanted)


def head_patterns(con: duckdb.DuckDBPyConnection, run_id: str, name: str, examples: int = EXAMPLES,
                  checkpoint: str | None = None) -> list[dict[str, Any]]:
    """``Store.attention``: head ``name``'s patterns on the ``examples`` examples its removal harms most, on model
    ``checkpoint`` (default: the run's first)."""
    run = one(con, "SELECT run_id, metric, config, ablation FROM runs WHERE run_id = ?", [run_id])
    if run is None:
        raise HeadsweepError(f"no run {run_id!r} in the store (headsweep runs lists them)")
    known = {r[0] for r in fetch(con, "SELECT name FROM heads WHERE run_id = ?", [run_id])}
    if name not in known:
        raise HeadsweepError(f"no head {name!r} in run {run_id} (names are attention:layer:head)")
    if checkpoint is None:
        first = one(con, "SELECT checkpoint FROM evaluations WHERE run_id = ? ORDER BY eval_id LIMIT 1", [run_id])
        checkpoint = first[0] if first else None
    row = {"run_id": run[0], "metric": run[1], "config": run[2], "ablation": run[3]}
    return [p.as_dict() for p in run_patterns(con, row, checkpoint, [name], examples)]
