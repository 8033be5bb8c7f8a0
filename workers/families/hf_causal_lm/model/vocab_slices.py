"""A causal LM's per-token NLL with its LM head computed a slice of the vocabulary at a time (on a CPU).

A pass's logits are rows x vocabulary floats (400 MB for 2,048 rows of SmolLM2's 49,152 words), written by the LM
head's product, read again by the loss's log-softmax and written once more: on a CPU that traffic leaves the
caches. Taking ``CPU_VOCAB_SLICE`` columns at a time (the LM head's product, its log-sum-exp and the targets'
logits, then one log-sum-exp over the slices) keeps each slice in cache: ``bench/vocab_slices.py`` on an AMD EPYC
(AVX2) timed the LM head and loss of SmolLM2-135M, GPT-2 small, Qwen2.5-0.5B and Llama-3.2-1B 1.03-1.16x faster at
508 and 2,032 rows, one and two threads, except Llama's 2,032 rows at two threads (0.99: the widest product, the
least traffic per FLOP); a whole SmolLM2-135M pass 3-7% (bench/README.md). The NLL is the same sum in another
order: within float32 rounding of the loss over whole logits, not bit for bit, and every route of a run (plain,
reuse, packed) takes the same one.

The model's own forward still runs with its LM head passed through, so whatever the model does before the head
(final norm, ``logits_to_keep``) stays its own. The first pass checks that the model returns its LM head's output
unchanged (a logit soft-cap or scale after the head, a head that is not an ``nn.Linear`` or is called more than
once: the whole logits are used from then on, as before).

The activation estimate packing reads (:func:`~.scoring.activation_bytes_per_row`) still counts whole logits: on a
CPU it over-counts a sliced pass, which can only pack fewer masks where memory binds, never more; the packing
choices measured before the slices stay as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headsweep.workers.families.hf_causal_lm.model.scoring import shifted_nll
from headsweep.workers.memory.replay import pass_through, replaced_forwards

#: Vocabulary columns per slice on a CPU: of 256 to 4,096, no width was best on every shape; 512 was never more
#: than 6% behind the best (bench/README.md).
CPU_VOCAB_SLICE = 512


def sliced_nll(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, columns: int) -> torch.Tensor:
    """Per-position NLL (nats) of ``targets`` (shape ``S``) under ``head(hidden)`` (``hidden``: ``S + (in,)``),
    ``columns`` vocabulary entries at a time; in at least float32, as :func:`~.scoring.target_nll`."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    rows = hidden.reshape(-1, hidden.shape[-1])
    wanted = targets.reshape(-1)
    vocab = head.weight.shape[0]
    if wanted.numel() and int(wanted.max()) >= vocab:
        raise IndexError(f"target id {int(wanted.max())} is outside the LM head's {vocab} words")
    sums = []
    picked = torch.full(wanted.shape, float("nan"), dtype=dtype, device=hidden.device)
    for start in range(0, vocab, columns):
        stop = min(vocab, start + columns)
        bias = None if head.bias is None else head.bias[start:stop]
        logits = F.linear(rows, head.weight[start:stop], bias).to(dtype)
        sums.append(torch.logsumexp(logits, dim=1))
        here = ((wanted >= start) & (wanted < stop)).nonzero().squeeze(1)
        picked[here] = logits[here, wanted[here] - start]
    return (torch.logsumexp(torch.stack(sums, dim=1), dim=1) - picked).view(targets.shape)


class SlicedHeadNLL:
    """``model``'s per-token NLL over windows, its LM head a slice of the vocabulary at a time on a CPU
    (module docstring); the whole logits elsewhere, or where the first pass finds the model changing them."""

    def __init__(self, model: nn.Module, columns: int = CPU_VOCAB_SLICE):
        self.model, self.columns = model, columns
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        self.head = head if isinstance(head, nn.Linear) else None
        self.sliced: bool | None = None if self.head is not None else False  # None: not checked yet

    def __call__(self, inputs: torch.Tensor, needed: int, **extra) -> torch.Tensor:
        """NLL of ``inputs[:, -needed:]`` (B, needed), each position from the ones before it; ``extra``: the
        model's keyword arguments (``logits_to_keep``)."""
        if self.sliced is False or inputs.device.type != "cpu":
            return shifted_nll(self._logits(inputs, extra)[:, -(needed + 1) :], inputs)
        if self.sliced is None:
            hidden, logits = self._checked(inputs, extra)
            if hidden is None:
                return shifted_nll(logits[:, -(needed + 1) :], inputs)
        else:
            with replaced_forwards({self.head: pass_through}):
                hidden = self._logits(inputs, extra)  # the head passed through: its input
        # The last position predicts no token of the window.
        return sliced_nll(hidden[:, -(needed + 1) : -1], self.head, inputs[:, -needed:], self.columns)

    def _logits(self, inputs: torch.Tensor, extra: dict) -> torch.Tensor:
        return self.model(input_ids=inputs, use_cache=False, **extra).logits

    def _checked(self, inputs: torch.Tensor, extra: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The first pass, whole: (the LM head's input when the model returned the head's output unchanged, and
        slicing is on from now, else None and off; the model's logits)."""
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        handle = self.head.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
        try:
            logits = self._logits(inputs, extra)
        finally:
            handle.remove()
        same = (len(seen) == 1 and seen[0][1].dtype == logits.dtype and seen[0][1].shape == logits.shape
                and bool(torch.equal(seen[0][1], logits)))
        self.sliced = same
        return (seen[0][0] if same else None), logits
