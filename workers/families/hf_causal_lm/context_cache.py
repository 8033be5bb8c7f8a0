"""Choices that continue from their question's context (``sweep.context_cache``): a multiple-choice question's
context runs once per mask, and each choice reads the context's key/value cache instead of running it again.

A request row (:class:`~.lm_eval_requests.TokenRow`: ``inputs``, of which the last ``c = len(targets)`` positions
predict the ``targets``) splits into its **context**, ``inputs[:len(inputs) - c + 1]`` (up to and including the
position that predicts the first target), and its **continuation**, the ``c - 1`` tokens after it. The rows of one
question share the context token for token (lm-eval encodes the context once per choice, the same way), so per
batch of contexts and per chunk of masks two forward passes run:

1. the contexts, left-padded to one width (position ids counted from each context's first real token, as
   ``generate`` counts them), the batch repeated once per mask, keeping the key/value cache and the logits of
   the last position only (they predict every choice's first target);
2. the continuations, right-padded, each row with its context's cache (the cache's rows selected per choice),
   its position ids following its context, an attention mask hiding the context's padding.

Each row's log-likelihood and greedy match are then taken as ``HFLM._loglikelihood_tokens`` takes them
(:func:`~.model.row_sums`). A 4-choice question with a context of n tokens and choices of m costs
``n + 4m`` token positions per mask instead of ``4(n + m)``.

Not bit for bit: the continuation's matrix products have fewer rows than the whole row's (a few tokens against
the context and the choice), and the CPU's kernels sum other blockings then; the log-likelihoods equal the plain
path's within the float32 rounding bound (tests/tolerances.py), measured at a few 1e-5 nats on the benchmark's
model. So it is off by default (``sweep.context_cache: false``): the plain and prefix-reuse paths give lm-eval's
floats exactly. The first batch is checked against the plain path (:meth:`ContextCache.verify`); a model that
ignores the cache or the position ids gives differences of whole nats, not rounding, and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.lm_eval_requests import TokenRow
from headsweep.workers.families.hf_causal_lm.model import activation_bytes_per_row, row_sums
from headsweep.workers.memory.replay import ReuseUnsupported

CONTEXT_NOTE = ("context cache (sweep.context_cache): each question's context runs once per mask and its choices "
                "continue from the context's key/value cache; equal to the plain path within float32 rounding, "
                "not bit for bit")


def split_row(row: TokenRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A row's context (the positions up to the one predicting its first target) and its continuation inputs."""
    cut = len(row.inputs) - len(row.targets) + 1
    return row.inputs[:cut], row.inputs[cut:]


@dataclass
class ContextBatch:
    """Some questions' contexts and the rows that continue from them, on the device.

    ``rows[r]`` is the adapter's row r of this batch (the order of every per-row output), ``group[r]`` its
    context; ``targets`` are right-aligned as in :class:`~.lm_eval_adapter.RowBatch` (row r's last
    ``lengths[r]`` columns)."""

    rows: torch.Tensor  # (R,) the adapter's row indices (CPU)
    context_ids: torch.Tensor  # (G, Wc) left-padded
    context_mask: torch.Tensor | None  # (G, Wc); None where no context is padded
    context_positions: torch.Tensor  # (G, Wc)
    context_lengths: torch.Tensor  # (G,)
    group: torch.Tensor  # (R,) each row's context
    continuation_ids: torch.Tensor  # (R, Wk) right-padded; Wk = the longest continuation (0: every choice 1 token)
    continuation_mask: torch.Tensor  # (R, Wk)
    targets: torch.Tensor  # (R, K), K = Wk + 1
    lengths: list[int]

    @property
    def contexts(self) -> int:
        return int(self.context_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.context_ids.shape[1])


def context_batches(rows: Sequence[TokenRow], which: Sequence[int], contexts_per_batch: int,
                    device: torch.device) -> list[ContextBatch]:
    """The rows ``which`` grouped by context, contexts sorted by length (little padding), ``contexts_per_batch``
    contexts a batch."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i in which:
        by_context.setdefault(split_row(rows[i])[0], []).append(i)
    ordered = sorted(by_context.items(), key=lambda item: len(item[0]))
    per = max(1, contexts_per_batch)
    return [_batch(rows, ordered[i : i + per], device) for i in range(0, len(ordered), per)]


def _batch(rows: Sequence[TokenRow], groups: list[tuple[tuple[int, ...], list[int]]],
           device: torch.device) -> ContextBatch:
    width = max(len(ctx) for ctx, _ in groups)
    g = len(groups)
    context_ids = torch.zeros(g, width, dtype=torch.long)
    context_mask = torch.zeros(g, width, dtype=torch.long)
    members = [(n, i) for n, (_, which) in enumerate(groups) for i in which]
    rest = [split_row(rows[i])[1] for _, i in members]
    wk = max(len(r) for r in rest)
    keep = wk + 1
    continuation_ids = torch.zeros(len(members), wk, dtype=torch.long)
    continuation_mask = torch.zeros(len(members), wk, dtype=torch.long)
    targets = torch.zeros(len(members), keep, dtype=torch.long)
    for n, (ctx, _) in enumerate(groups):
        context_ids[n, width - len(ctx):] = torch.tensor(ctx)
        context_mask[n, width - len(ctx):] = 1
    for r, ((_, i), tokens) in enumerate(zip(members, rest, strict=True)):
        continuation_ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        continuation_mask[r, : len(tokens)] = 1
        targets[r, keep - len(rows[i].targets):] = torch.tensor(rows[i].targets)
    lengths = context_mask.sum(dim=1)
    # generate's position ids for left padding: counted from each row's first real token (padding at 1, unread)
    positions = (context_mask.cumsum(dim=1) - 1).clamp(min=0)
    padded = bool((context_mask == 0).any())
    return ContextBatch(
        rows=torch.tensor([i for _, i in members]), context_ids=context_ids.to(device),
        context_mask=context_mask.to(device) if padded else None, context_positions=positions.to(device),
        context_lengths=lengths.to(device), group=torch.tensor([n for n, _ in members], device=device),
        continuation_ids=continuation_ids.to(device), continuation_mask=continuation_mask.to(device),
        targets=targets.to(device), lengths=[len(rows[i].targets) for _, i in members])


def _repeat(t: torch.Tensor, k: int) -> torch.Tensor:
    return t if k == 1 else t.repeat(k, *([1] * (t.dim() - 1)))


class ContextCache:
    """The two passes of the module docstring over one :class:`ContextBatch` under a chunk of masks."""

    def __init__(self, model: nn.Module, gates: HeadGates):
        self.model, self.gates = model, gates
        self.verified = False

    def logprobs(self, batch: ContextBatch, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Per row of the batch repeated once per mask (mask-major): the log-probabilities of its targets (K,
        right-aligned, in the logits' dtype) and whether each is the argmax (K, as 0/1), side by side: (k*R, 2K),
        the layout of the plain path's ``packed_pass``."""
        k, g, r = len(masks), batch.contexts, int(batch.rows.numel())
        mask = None if batch.context_mask is None else _repeat(batch.context_mask, k)
        with self.gates.packed(masks, g):
            out = self.model(input_ids=_repeat(batch.context_ids, k), attention_mask=mask,
                             position_ids=_repeat(batch.context_positions, k), use_cache=True, logits_to_keep=1)
        # row r of mask m reads context m * G + group[r]
        select = (torch.arange(k, device=batch.group.device).unsqueeze(1) * g + batch.group.unsqueeze(0)).reshape(-1)
        first = out.logits[:, -1][select].unsqueeze(1)  # (k*R, 1, V): predicts each row's first target
        wk = batch.continuation_ids.shape[1]
        if wk:
            cache = out.past_key_values
            cache.batch_select_indices(select)
            context_mask = (torch.ones(g, batch.width, dtype=torch.long, device=select.device)
                            if batch.context_mask is None else batch.context_mask)
            attention = torch.cat([context_mask[batch.group], batch.continuation_mask], dim=1)
            positions = (batch.context_lengths[batch.group].unsqueeze(1)
                         + torch.arange(wk, device=select.device).unsqueeze(0))
            with self.gates.packed(masks, r):
                rest = self.model(input_ids=_repeat(batch.continuation_ids, k), attention_mask=_repeat(attention, k),
                                  position_ids=_repeat(positions, k), past_key_values=cache,
                                  use_cache=True).logits
            logits = torch.cat([first, rest], dim=1)  # (k*R, K, V): position j predicts target j
        else:
            logits = first
        # right-align: row r's c targets in the last c columns, as the plain path keeps them
        keep = logits.shape[1]
        c = torch.tensor(batch.lengths, device=logits.device).repeat(k).unsqueeze(1)
        column = (torch.arange(keep, device=logits.device).unsqueeze(0) - (keep - c)).clamp(min=0)
        logprobs = torch.log_softmax(torch.take_along_dim(logits, column.unsqueeze(-1), dim=1), dim=-1)
        targets = _repeat(batch.targets, k)
        greedy = logprobs.argmax(dim=-1) == targets
        picked = torch.gather(logprobs, 2, targets.unsqueeze(-1)).squeeze(-1)
        return torch.cat([picked, greedy.to(picked.dtype)], dim=1)

    def start(self, batch: ContextBatch, plain: Callable[[], np.ndarray], dtype: torch.dtype, depth: int,
              width: int) -> Callable[[list[Sequence[Head]]], np.ndarray]:
        """The batch's pass for the mask-grid loop: a chunk of masks -> per row, mask-major, (loglikelihood, greedy)
        as HFLM sums them (:func:`~.model.row_sums`); shape (k*R, 2).

        Until a batch has been checked, its unmasked log-likelihoods are compared first with ``plain()`` (the plain
        path's, one per row of the batch): within the float32 summation-order bound of tests/tolerances.py (6 x
        ``depth`` x ``width`` x eps x the log-likelihood's size), else :class:`ReuseUnsupported` (a model that
        ignores its cache or its position ids is whole nats off)."""
        lengths = batch.lengths

        def forward(chunk: list[Sequence[Head]]) -> np.ndarray:
            values = self.logprobs(batch, chunk)
            keep = values.shape[1] // 2
            return np.stack(row_sums(values[:, :keep], values[:, keep:].bool(), lengths * len(chunk)), axis=1)

        if not self.verified:
            self.gates.clear()
            mine, theirs = forward([()])[:, 0], plain()
            eps = torch.finfo(dtype).eps
            far = np.abs(mine - theirs) > 6 * depth * width * eps * np.maximum(np.abs(theirs), 1.0) + eps
            if bool(far.any()):
                worst = int(np.argmax(np.abs(mine - theirs)))
                raise ReuseUnsupported(
                    f"continuing choices from the context's key/value cache gives log-likelihood {mine[worst]:.6g} "
                    f"where the whole row gives {theirs[worst]:.6g}: beyond rounding (the model ignores its cache "
                    "or position ids)")
            self.verified = True
        return forward


def bytes_per_mask(config, dtype: torch.dtype, batch: ContextBatch) -> int:
    """Activation bytes of one copy of ``batch`` (one mask): each context's pass keeping one position's logits,
    and each continuation's pass, its logits, and its copy of the context's keys and values."""
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 12)
    heads = int(getattr(config, "num_attention_heads", 0) or 12)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    hidden = int(getattr(config, "hidden_size", 0) or 768)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    itemsize = torch.finfo(dtype).bits // 8
    wk = int(batch.continuation_ids.shape[1])
    rows = int(batch.rows.numel())
    cache = 2 * layers * kv * head_dim * itemsize * (batch.width + wk)
    return (batch.contexts * (activation_bytes_per_row(config, dtype, batch.width, 1) + cache)
            + rows * (activation_bytes_per_row(config, dtype, max(1, wk), wk + 1) + cache))


def context_width(config, batch: ContextBatch) -> int:
    """The longest inner product of a pass over ``batch``: the model's width, or the attention's keys (a context
    and a continuation) where longer; what the rounding bound of :meth:`ContextCache.start` counts."""
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    return max(hidden, batch.width + int(batch.continuation_ids.shape[1]))
