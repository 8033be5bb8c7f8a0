"""What the tasks compute from a causal LM's token rows and logits: rows right-padded into batches, per-token NLL,
log-probabilities and greedy matches, the row sums lm-eval's HFLM takes, and the activation bytes a pass needs
(shared by perplexity, paired prompts, continuations and the context cache)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class TokenRow(Protocol):
    """A row a continuation task scores: ``inputs`` (at most the model's positions), of which the last
    ``len(targets)`` positions predict the continuation ``targets``."""

    @property
    def inputs(self) -> tuple[int, ...]: ...

    @property
    def targets(self) -> tuple[int, ...]: ...


def activation_bytes_per_row(config, dtype: torch.dtype, positions: int, logit_positions: int) -> int:
    """Activation bytes of one input row of ``positions`` tokens at the widest point (an estimate, see
    batch_budget): hidden states, queries/keys/values and outputs (~8 x hidden), the feed-forward activation
    (2 x intermediate), a row of attention scores per head (2 x heads x positions), and for each of the
    ``logit_positions`` positions whose logits are computed, the logits with their float32 copy and
    log-softmax (3 x vocabulary)."""
    hidden = int(getattr(config, "hidden_size", 0) or 768)
    inner = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 12)
    vocab = int(getattr(config, "vocab_size", 0) or 32000)
    itemsize = torch.finfo(dtype).bits // 8
    w = positions
    return w * itemsize * (8 * hidden + 2 * inner + 2 * heads * w) + logit_positions * 4 * 3 * vocab


def backward_bytes_per_row(config, dtype: torch.dtype, positions: int, checkpointed: bool) -> int:
    """What one row's loss keeps for a backward pass through the gates (an estimate, see
    :mod:`headsweep.workers.memory.backward_memory`): with the blocks ``checkpointed``, every layer's input (layers x
    hidden) and, twice over (activations and their gradients), one block's activations and the logits; without,
    every layer's activations and the logits twice."""
    layer = activation_bytes_per_row(config, dtype, positions, 0)
    logits = activation_bytes_per_row(config, dtype, positions, positions) - layer
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 12)
    hidden = int(getattr(config, "hidden_size", 0) or 768)
    itemsize = torch.finfo(dtype).bits // 8
    if checkpointed:
        return layers * positions * hidden * itemsize + 2 * (layer + logits)
    return layers * layer + 2 * logits


def target_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL (nats) of ``targets`` (shape ``S``) under ``logits`` (shape ``S + (vocab,)``).

    Computed in at least float32 (bfloat16 logits lose digits in log-softmax); a float64 model stays float64.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.view(targets.shape)


def target_logprobs(logits: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """As ``HFLM._loglikelihood_tokens`` scores a row: the log-softmax of ``logits`` (B, W, V) at ``positions``
    (B, K) in the logits' dtype, each ``targets`` (B, K) token's log-probability, and whether it is the argmax (as
    0/1), side by side: shape (B, 2K) (what :func:`row_sums` sums)."""
    logprobs = torch.log_softmax(torch.take_along_dim(logits, positions.unsqueeze(-1), dim=1), dim=-1)
    greedy = logprobs.argmax(dim=-1) == targets
    picked = torch.gather(logprobs, 2, targets.unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked, greedy.to(picked.dtype)], dim=1)


def length_batches(which: Sequence[int], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The rows ``which`` sorted by ``lengths[i]`` (little padding in each batch), ``batch_size`` rows a batch."""
    order = sorted(which, key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), max(1, batch_size))]


def right_padded(rows: Sequence[tuple[Sequence[int], Sequence[int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of (input ids, continuation ids) as one right-padded batch (padding id 0: masked out, and never read
    by a real token of a causal model): input ids and attention mask ``(n, width)``, then per row the positions whose
    logits predict its continuation, the continuation's ids and which of them are real, ``(n, keep)`` each, a
    shorter continuation right-aligned (position p predicts token p + 1: the last c positions predict c tokens)."""
    width = max(len(inputs) for inputs, _ in rows)
    keep = max(len(targets) for _, targets in rows)
    n = len(rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, keep, dtype=torch.long)
    targets = torch.zeros(n, keep, dtype=torch.long)
    scored = torch.zeros(n, keep, dtype=torch.bool)
    for b, (inputs, continuation) in enumerate(rows):
        length, c = len(inputs), len(continuation)
        input_ids[b, :length] = torch.tensor(inputs)
        attention[b, :length] = 1
        positions[b] = torch.arange(length - keep, length).clamp(min=0)
        targets[b, keep - c :] = torch.tensor(continuation)
        scored[b, keep - c :] = True
    return input_ids, attention, positions, targets, scored


def row_sums(logprobs: torch.Tensor, greedy: torch.Tensor, lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's continuation log-likelihood and greedy match: the last ``lengths[b]`` entries of row b, summed in
    the log-probabilities' dtype over a contiguous one-row tensor (the sum HFLM takes, in its order), then widened
    to float64 (exact)."""
    logprobs, greedy = logprobs.cpu(), greedy.cpu()
    keep = logprobs.shape[1]
    sums = np.empty(len(lengths), dtype=np.float64)
    matches = np.empty(len(lengths), dtype=np.float64)
    for b, c in enumerate(lengths):
        sums[b] = float(logprobs[b : b + 1, keep - c :].contiguous().sum())
        matches[b] = float(bool(greedy[b, keep - c :].all()))
    return sums, matches
