"""What a head's drill-down recomputes with the run's model, for the examples it shows (``headsweep report
--attention``): a causal LM window's per-token losses, and every choice's log-likelihood of a multiple-choice question
(``data.task: multiple_choice``, and lm-eval tasks of output type ``multiple_choice``), with the head kept and with
it gated off as the run gated it.

Neither is stored (sizes measured in docs/results-tables.md): per-token losses would be 17 times a perplexity run's
``examples`` table, every choice's log-likelihood as much again as a multiple-choice run's; recomputed, they cost one
masked pass per shown head over at most 24 examples.

What a gated-off head leaves behind is the run's own fill (:func:`run_fill`): nothing for zero ablation (position 0
kept with ``ablation.keep_first``), the constants the run stored in ``ablation_values`` for mean and optimal
ablation. A method whose fill is another input's activations (resample, activation patching: donors drawn over the
whole evaluation set) is not recomputed, and the drill-down says so in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.registry import DEFAULT_METHOD

TOP_TOKENS = 8


@dataclass
class RunFill:
    """The run's fill for recomputing its masks (``fill``: None is zero), or ``note``: why nothing is recomputed."""

    fill: Any = None
    note: str | None = None


@dataclass
class TokenLosses:
    """Where in a window a head's removal raises the loss: the scored tokens whose NLL rises most, and the window's
    NLL summed over its scored tokens (baseline, masked: what the run stored as the window's first statistic)."""

    head: str
    example_id: str
    tokens: list[tuple[int, str, float, float]]  # (position in the window, token, NLL baseline, NLL masked)
    window_nll: tuple[float, float]


@dataclass
class ChoiceScores:
    """A multiple-choice question's every choice: its text and log-likelihood (nats) with the head kept
    (``baseline``) and gated off (``masked``); ``gold`` indexes the gold choice."""

    head: str
    example_id: str
    choices: list[str]
    gold: int
    baseline: list[float]
    masked: list[float]


@dataclass
class NotRecomputed:
    """A shown head whose scores are not recomputed, and why (one line)."""

    head: str
    note: str


def run_fill(con: duckdb.DuckDBPyConnection, run: dict, checkpoint: str | None) -> RunFill:
    """What the run's gated-off heads left behind, for model ``checkpoint``, as the report's adapter takes it."""
    from headsweep.sweep.ablation.values import values_from_rows
    from headsweep.sweep.configuration.config import build_config
    from headsweep.workers.ablation.registry import ablation_method
    from headsweep.workers.ablation.spec import AblationSpec
    from headsweep.workers.ablation.worker_fill import fill_of

    name = run.get("ablation") or DEFAULT_METHOD
    try:
        cfg = build_config(json.loads(run["config"]))
        # the settings the fill is built from (the reference data itself is not read again)
        spec = AblationSpec(method=cfg.sweep.ablation, per_position=cfg.ablation.positions == "per_position",
                            keep_first=cfg.ablation.keep_first)
        method = ablation_method(spec.method)
    except HeadsweepError as exc:
        return RunFill(note=f"Not recomputed: the run's {name} ablation cannot be set up here ({exc}).")
    if method.fill == "per_example":
        return RunFill(note=f"Not recomputed under {name} ablation: a gated-off head takes its output on another "
                            "input (donors drawn over the whole evaluation set), which the report does not draw "
                            "again; the stored per-example scores above are the run's.")
    if method.fill == "constant":
        rows = con.sql("SELECT * FROM ablation_values WHERE run_id = ? AND checkpoint IS NOT DISTINCT FROM ?",
                       params=[run["run_id"], checkpoint]).to_arrow_table().to_pylist()
        values = values_from_rows(rows, checkpoint)
        if not values:
            return RunFill(note=f"Not recomputed: the run stored no {name}-ablation values (ablation_values) for "
                                "this model.")
        return RunFill(fill_of(spec, values))
    return RunFill(method.worker_fill(spec))


def recomputes(adapter: Any) -> bool:
    """Whether ``adapter`` has scores a drill-down recomputes (a causal LM's windows or multiple-choice questions)."""
    return token_scores(adapter) or _choice_layout(adapter) is not None


def drill_scores(adapter: Any, fill: RunFill, picks: list[tuple[str, str, int]]) -> list[Any]:
    """Per (head, example id, row of ``adapter``'s examples) in ``picks``: its :class:`TokenLosses` or
    :class:`ChoiceScores` under the run's ``fill``, or one :class:`NotRecomputed` per head where the fill cannot be
    recomputed; nothing for an adapter with neither."""
    if not picks or not recomputes(adapter):
        return []
    if fill.note is not None:
        return [NotRecomputed(head, fill.note) for head in dict.fromkeys(h for h, _, _ in picks)]
    adapter.gates.set_fill(fill.fill)
    return token_losses(adapter, picks) + choice_scores(adapter, picks)


def token_scores(adapter: Any) -> bool:
    """Whether ``adapter``'s drill-down scores are a causal LM window's token losses (else a question's choices)."""
    return hasattr(adapter, "token_nll") and hasattr(adapter, "scored")


def token_losses(adapter: Any, picks: list[tuple[str, str, int]]) -> list[TokenLosses]:
    """Per (head, example id, row of ``adapter``'s windows): the ``TOP_TOKENS`` scored tokens whose NLL (nats)
    rises most with the head gated off (under the fill the adapter's gates hold), recomputed with the model: a
    causal LM's windows only."""
    import torch

    from headsweep.workers.core.heads import Head

    if not token_scores(adapter):
        return []
    out = []
    rows = sorted({r for _, _, r in picks})
    index = torch.tensor(rows, device=adapter.inputs.device)
    inputs, scored = adapter.inputs[index], adapter.scored[index.to(adapter.scored.device)]
    adapter.gates.clear()
    with torch.inference_mode():
        base = adapter.token_nll(inputs, scored).double().cpu()
        by_head: dict[str, torch.Tensor] = {}
        for name in dict.fromkeys(n for n, _, _ in picks):
            with adapter.gates.masked([Head.parse(name)]):
                by_head[name] = adapter.token_nll(inputs, scored).double().cpu()
    ids, real = inputs.cpu(), scored.cpu()
    for name, example, row in picks:
        r = rows.index(row)
        rise = torch.where(real[r], by_head[name][r] - base[r], torch.tensor(float("-inf"), dtype=base.dtype))
        top = torch.argsort(rise, descending=True)[:TOP_TOKENS].tolist()
        # position p of the NLL row predicts input token p + 1
        words = adapter.tokenizer.convert_ids_to_tokens([int(ids[r, p + 1]) for p in top])
        sums = (float((base[r] * real[r]).sum()), float((by_head[name][r] * real[r]).sum()))
        out.append(TokenLosses(name, example, [(p + 1, str(w), float(base[r, p]), float(by_head[name][r, p]))
                                               for p, w in zip(top, words, strict=True)], sums))
    return out


def _choice_layout(adapter: Any) -> dict[int, tuple[list[str], int, list[list[int]]]] | None:
    """Per question (row of the adapter's examples): its choices' texts, the gold's index and each choice's rows
    (whose log-likelihoods sum to the choice's); None for an adapter without multiple-choice questions."""
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_documents import gold_choice
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice import MultipleChoiceAdapter

    if isinstance(adapter, MultipleChoiceAdapter):
        return {q: (list(question.choices), int(adapter.gold[q]),
                    [[int(r)] for r in adapter.index[q] if r >= 0])
                for q, question in enumerate(adapter.questions)}
    if isinstance(adapter, LmEvalAdapter) and adapter.output_type == "multiple_choice":
        out: dict[int, tuple[list[str], int, list[list[int]]]] = {}
        for t, task in enumerate(adapter.tasks):
            for d, requests in enumerate(adapter.encoded.requests[t]):
                texts = [str(instance.args[1]) for instance in task.requests[d]]
                out[len(out)] = (texts, gold_choice(task, d, len(requests)), [list(r) for r in requests])
        return out
    return None


def choice_scores(adapter: Any, picks: list[tuple[str, str, int]]) -> list[ChoiceScores]:
    """Per (head, example id, question row of ``adapter``): every choice's log-likelihood with the head kept and
    gated off (under the fill the adapter's gates hold), from the adapter's own scoring pass; multiple-choice
    adapters only."""
    from headsweep.workers.core.heads import Head

    layout = _choice_layout(adapter)
    if layout is None:
        return []
    heads = list(dict.fromkeys(n for n, _, _ in picks))
    adapter.gates.clear()
    lls = np.asarray(adapter.loglikelihoods([[]] + [[Head.parse(n)] for n in heads]))
    if lls.ndim == 3:  # lm-eval's (log-likelihood, greedy) per row
        lls = lls[..., 0]
    out = []
    for name, example, row in picks:
        texts, gold, rows = layout[row]
        mask = 1 + heads.index(name)
        out.append(ChoiceScores(name, example, texts, gold, [float(sum(lls[0, r] for r in rs)) for rs in rows],
                                [float(sum(lls[mask, r] for r in rs)) for rs in rows]))
    return out
