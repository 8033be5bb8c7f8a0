"""Choices that continue from their question's context (``sweep.context_cache``): a multiple-choice question's
context runs once per mask, and each choice reads the context's key/value cache instead of running it again.

A request row (:class:`~..model.scoring.TokenRow`: ``inputs``, of which the last ``c = len(targets)`` positions
predict the ``targets``) splits into its **context**, ``inputs[:len(inputs) - c + 1]`` (up to and including the
position that predicts the first target), and its **continuation**, the ``c - 1`` tokens after it. The rows of one
question share the context token for token (lm-eval encodes the context once per choice, the same way), so per
batch of contexts (all of one length: no padding, so no attention mask and the attention's causal kernel) and per
chunk of masks two forward passes run:

1. the contexts, the batch repeated once per mask, keeping the key/value cache and the logits of the last position
   only (they predict every choice's first target). With a decoder layout prefix reuse knows
   (:func:`.prefix.decoder_layout`), the pass starts at the chunk's first gated layer from the batch's unmasked
   states kept once (:class:`ContextStates`: that layer's input, and the keys and values of the layers below it,
   put into the cache afterwards), as prefix reuse starts a window's pass;
2. the continuations, right-padded (the padding follows every real token, so a causal model never reads it), each
   row with its context's cache (the cache's rows selected per choice) and its position ids following its context.

Each row's log-likelihood and greedy match are then taken as ``HFLM._loglikelihood_tokens`` takes them
(:func:`~..model.scoring.row_sums`). A 4-choice question with a context of n tokens and choices of m costs
``n + 4m`` token positions per mask instead of ``4(n + m)``.

Not bit for bit: the continuation's matrix products have fewer rows than the whole row's (a few tokens against
the context and the choice), and the CPU's kernels sum other blockings then; the log-likelihoods equal the plain
path's within the rounding bound (tests/tolerances.py), measured at a few 1e-5 nats on the benchmark's model. So
it is off by default (``sweep.context_cache: false``): the plain and prefix-reuse paths give lm-eval's floats
exactly. The first batch is checked against the plain path (:meth:`ContextCache.start`); a model that ignores the
cache or the position ids gives differences of whole nats, not rounding, and the run falls back to the plain path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Out, Pass, grid_batches, mask_grid
from headsweep.workers.families.hf_causal_lm.config import CausalLMRuntime
from headsweep.workers.families.hf_causal_lm.model.scoring import (
    TokenRow,
    activation_bytes_per_row,
    row_sums,
    target_logprobs,
)
from headsweep.workers.families.hf_causal_lm.reuse.prefix import DecoderLayout, decoder_layout
from headsweep.workers.families.hf_shared.reuse import PrefixReuseSwitch, repeat_rows, start_at_layer
from headsweep.workers.memory.batch_budget import cache_budget, masks_per_forward
from headsweep.workers.memory.replay import (
    RecordedBaselines,
    ReuseUnsupported,
    by_first_gated_layer,
    first_gated_layer,
    replaced_forwards,
)

CONTEXT_NOTE = ("context cache (sweep.context_cache): each question's context runs once per mask and its choices "
                "continue from the context's key/value cache; equal to the plain path within float32 rounding, "
                "not bit for bit")


def split_row(row: TokenRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A row's context (the positions up to the one predicting its first target) and its continuation inputs."""
    cut = len(row.inputs) - len(row.targets) + 1
    return row.inputs[:cut], row.inputs[cut:]


@dataclass
class ContextBatch:
    """Some questions' contexts, all of one length, and the rows that continue from them, on the device.

    ``rows[r]`` is the adapter's row r of this batch (the order of every per-row output), ``group[r]`` its
    context; ``targets`` are right-aligned as in :class:`~..tasks.continuations.scorer.RowBatch` (row r's last
    ``lengths[r]`` columns)."""

    key: int  # its position in the adapter's context batches (what the kept states are keyed on)
    rows: torch.Tensor  # (R,) the adapter's row indices (CPU)
    context_ids: torch.Tensor  # (G, Wc): no padding
    group: torch.Tensor  # (R,) each row's context
    continuation_ids: torch.Tensor  # (R, Wk) right-padded; Wk = the longest continuation (0: every choice 1 token)
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
    """The rows ``which`` grouped by context, at most ``contexts_per_batch`` contexts a batch, and only contexts of
    one length in a batch: the context pass then runs unpadded, with no attention mask, so the attention takes its
    causal kernel (a padding mask costs it the fused path: about twice the attention's time on the CPU), and masks
    packed into one pass give it its rows."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i in which:
        by_context.setdefault(split_row(rows[i])[0], []).append(i)
    by_length: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}
    for item in by_context.items():
        by_length.setdefault(len(item[0]), []).append(item)
    per = max(1, contexts_per_batch)
    parts = [same[i : i + per] for _, same in sorted(by_length.items()) for i in range(0, len(same), per)]
    return [_batch(key, rows, part, device) for key, part in enumerate(parts)]


def _batch(key: int, rows: Sequence[TokenRow], groups: list[tuple[tuple[int, ...], list[int]]],
           device: torch.device) -> ContextBatch:
    members = [(n, i) for n, (_, which) in enumerate(groups) for i in which]
    rest = [split_row(rows[i])[1] for _, i in members]
    wk = max(len(r) for r in rest)
    continuation_ids = torch.zeros(len(members), wk, dtype=torch.long)
    targets = torch.zeros(len(members), wk + 1, dtype=torch.long)
    for r, ((_, i), tokens) in enumerate(zip(members, rest, strict=True)):
        # padding id 0 after a row's continuation: read by no real token of a causal model
        continuation_ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        targets[r, wk + 1 - len(rows[i].targets):] = torch.tensor(rows[i].targets)
    return ContextBatch(
        key=key, rows=torch.tensor([i for _, i in members]),
        context_ids=torch.tensor([ctx for ctx, _ in groups]).to(device),
        group=torch.tensor([n for n, _ in members], device=device), continuation_ids=continuation_ids.to(device),
        targets=targets.to(device), lengths=[len(rows[i].targets) for _, i in members])


@dataclass
class ContextStates:
    """One context batch's unmasked pass: what a mask first gated at layer l starts from (the output of layer
    l - 1, the keys and values of the layers below l) and the embeddings' output shape and dtype."""

    hidden: dict[int, torch.Tensor]  # output of layer i, for every i = site.layer - 1 >= 0
    keys: list[torch.Tensor]  # per layer: (G, key/value heads, Wc, head dim)
    values: list[torch.Tensor]
    embedding_shape: tuple[int, ...] | None
    embedding_dtype: torch.dtype | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.hidden.values(), *self.keys, *self.values])


class ContextCache(RecordedBaselines[ContextStates]):
    """The two passes of the module docstring over one :class:`ContextBatch` under a chunk of masks, each chunk's
    context pass started at its masks' first gated layer (``layout`` given: :mod:`.prefix`'s decoder layouts)."""

    def __init__(self, model: nn.Module, gates: HeadGates, layout: DecoderLayout | None, budget_bytes: int):
        super().__init__(budget_bytes)
        self.model, self.gates, self.layout = model, gates, layout
        self.verified = False

    def groups(self, masks: Sequence[Sequence[Head]]) -> list[list[int]]:
        """The positions of ``masks`` that may share a pass: one first gated layer each (all, without a layout)."""
        if self.layout is None:
            return [list(range(len(masks)))]
        return list(by_first_gated_layer(masks, self.gates.inventory).values())

    def record(self, batch: ContextBatch) -> ContextStates:
        """The batch's contexts through the ungated model once: the layer outputs masks start from and every
        layer's keys and values."""
        lay = self.layout
        assert lay is not None
        keep = {s.layer - 1 for s in lay.sites if s.layer > 0}
        hidden: dict[int, torch.Tensor] = {}
        embedded: list = []
        handles = [lay.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: hidden.__setitem__(i, out)) for i in keep]
        if lay.embeddings is not None:
            handles.append(lay.embeddings.register_forward_hook(
                lambda _m, _a, out: embedded.append((tuple(out.shape), out.dtype) if torch.is_tensor(out) else None)))
        self.gates.clear()
        try:
            cache = self.model(input_ids=batch.context_ids, use_cache=True, logits_to_keep=1).past_key_values
        finally:
            for h in handles:
                h.remove()
        if any(not torch.is_tensor(out) for out in hidden.values()):
            raise ReuseUnsupported("a decoder layer does not return one tensor")
        layers = [cache.layers[i] for i in range(len(lay.layers))]
        shape, dtype = embedded[0] if len(embedded) == 1 and embedded[0] is not None else (None, None)
        return ContextStates(hidden, [layer.keys for layer in layers], [layer.values for layer in layers],
                             shape, dtype)

    def _contexts(self, batch: ContextBatch, masks: Sequence[Sequence[Head]]):
        """The context pass of ``masks`` (one first gated layer): (logits of the last position, key/value cache)."""
        k = len(masks)
        layer = first_gated_layer(masks[0]) if self.layout is not None else None
        if not layer:  # the empty mask, layer 0, or no layout: the whole model
            with self.gates.packed(masks, batch.contexts):
                out = self.model(input_ids=repeat_rows(batch.context_ids, k), use_cache=True, logits_to_keep=1)
            return out.logits, out.past_key_values
        lay = self.layout
        states = self.states(batch.key, batch)
        replacements = start_at_layer(lay.layers, layer, states.hidden, k, lay.embeddings, states.embedding_shape,
                                      states.embedding_dtype)
        with replaced_forwards(replacements), self.gates.packed(masks, batch.contexts):
            out = self.model(input_ids=repeat_rows(batch.context_ids, k), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for i in range(layer):  # the layers below the first gated one never ran: the unmasked keys and values
            cache.update(repeat_rows(states.keys[i], k), repeat_rows(states.values[i], k), i)
        return out.logits, cache

    def logprobs(self, batch: ContextBatch, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Per row of the batch repeated once per mask (mask-major): the log-probabilities of its targets (K,
        right-aligned, in the logits' dtype) and whether each is the argmax (K, as 0/1), side by side: (k*R, 2K),
        the layout of the plain path's ``packed_pass``."""
        k, g, r = len(masks), batch.contexts, int(batch.rows.numel())
        context_logits, cache = self._contexts(batch, masks)
        # row r of mask m reads context m * G + group[r]
        select = (torch.arange(k, device=batch.group.device).unsqueeze(1) * g + batch.group.unsqueeze(0)).reshape(-1)
        first = context_logits[:, -1][select].unsqueeze(1)  # (k*R, 1, V): predicts each row's first target
        wk = batch.continuation_ids.shape[1]
        if wk:
            cache.batch_select_indices(select)
            positions = batch.width + torch.arange(wk, device=select.device).unsqueeze(0).expand(k * r, wk)
            with self.gates.packed(masks, r):
                rest = self.model(input_ids=repeat_rows(batch.continuation_ids, k), position_ids=positions,
                                  past_key_values=cache, use_cache=True).logits
            logits = torch.cat([first, rest], dim=1)  # (k*R, K, V): position j predicts target j
        else:
            logits = first
        # right-align: row r's c targets in the last c columns, as the plain path keeps them
        keep = logits.shape[1]
        c = torch.tensor(batch.lengths, device=logits.device).repeat(k).unsqueeze(1)
        column = (torch.arange(keep, device=logits.device).unsqueeze(0) - (keep - c)).clamp(min=0)
        return target_logprobs(logits, column, repeat_rows(batch.targets, k))

    def start(self, batch: ContextBatch, plain: Callable[[Sequence[Head]], np.ndarray], dtype: torch.dtype,
              depth: int, width: int) -> Callable[[list[Sequence[Head]]], np.ndarray]:
        """The batch's pass for the mask-grid loop: a chunk of masks (one first gated layer) -> per row,
        mask-major, (loglikelihood, greedy) as HFLM sums them (:func:`~..model.scoring.row_sums`); shape (k*R, 2).

        The first batch is checked against ``plain(mask)`` (the plain path's log-likelihoods of the batch's rows
        under ``mask``), unmasked and, with a layout, under a head of the deepest layer (the pass started there):
        within :func:`rounding_bound`, else :class:`ReuseUnsupported` (a model that ignores its cache or its
        position ids is whole nats off)."""
        lengths = batch.lengths

        def forward(chunk: list[Sequence[Head]]) -> np.ndarray:
            values = self.logprobs(batch, chunk)
            keep = values.shape[1] // 2
            return np.stack(row_sums(values[:, :keep], values[:, keep:].bool(), lengths * len(chunk)), axis=1)

        if not self.verified:
            site = self.gates.sites[-1]
            checks: list[Sequence[Head]] = [()] + ([[Head(site.attention, site.layer, 0)]] if self.layout else [])
            for mask in checks:
                self.gates.clear()
                mine, theirs = forward([mask])[:, 0], plain(mask)
                far = np.abs(mine - theirs) > rounding_bound(theirs, dtype, depth, width)
                if bool(far.any()):
                    worst = int(np.argmax(np.abs(mine - theirs)))
                    raise ReuseUnsupported(
                        f"continuing choices from the context's key/value cache (mask {[str(h) for h in mask]}) gives "
                        f"log-likelihood {mine[worst]:.6g} where the whole row gives {theirs[worst]:.6g}: beyond "
                        "rounding (the model ignores its cache or position ids)")
            self.verified = True
        return forward


def rounding_bound(reference: np.ndarray, dtype: torch.dtype, depth: int, width: int) -> np.ndarray:
    """How far two summation orders may take each value of ``reference`` apart: the bound tests/tolerances.py
    derives (Higham; for 16-bit models, products summed in float32 and rounded once): ``6 x depth x width x eps x
    scale + eps``, or ``6 x depth x (2 eps + width x eps_float32) x scale + eps``, the scale a value's size (at
    least 1)."""
    info = torch.finfo(dtype)
    per_layer = (2 * info.eps + width * torch.finfo(torch.float32).eps) if info.bits == 16 else width * info.eps
    return 6 * depth * per_layer * np.maximum(np.abs(reference), 1.0) + info.eps


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


def tokens_per_mask(batch: ContextBatch) -> int:
    """Positions one copy of ``batch`` (one mask) computes: each context's, then each continuation's."""
    return batch.contexts * batch.width + int(batch.rows.numel()) * int(batch.continuation_ids.shape[1])


def context_width(config, batch: ContextBatch) -> int:
    """The longest inner product of a pass over ``batch``: the model's width, or the attention's keys (a context
    and a continuation) where longer; what the rounding bound of :meth:`ContextCache.start` counts."""
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    return max(hidden, batch.width + int(batch.continuation_ids.shape[1]))


def context_cache(model: nn.Module, gates: HeadGates, budget_bytes: int) -> ContextCache:
    """The strategy for ``model``: with prefix reuse where its decoder layout allows it
    (:func:`.prefix.decoder_layout`), else whole context passes."""
    try:
        layout = decoder_layout(model, gates.sites)
    except ReuseUnsupported:
        layout = None
    return ContextCache(model, gates, layout, budget_bytes)


class ContextCacheSwitch(PrefixReuseSwitch):
    """An adapter of multiple-choice rows (:class:`~..model.scoring.TokenRow` s) that runs the context cache
    when ``sweep.context_cache`` asks for it, else its prefix reuse (the adapter holds ``model``, ``gates``,
    ``device`` and ``runtime``)."""

    model: nn.Module
    gates: HeadGates
    device: torch.device
    runtime: RuntimeOptions
    context_grid: list[GridBatch[ContextBatch]]

    def start_context_or_prefix(self, rows: Sequence[TokenRow], runtime: RuntimeOptions, applies: bool,
                                prefix: Callable[[], Any], prefix_note: str) -> None:
        """The context cache over ``rows`` where the run asks for it and it ``applies`` (rows share contexts),
        else prefix reuse (``prefix()`` builds it; :meth:`start_reuse`)."""
        self.context_grid = []
        if applies and CausalLMRuntime.of(runtime).context_cache:
            self.context_grid = grid_batches(context_batches(rows, range(len(rows)), runtime.batch_size, self.device),
                                             lambda b: b.rows)
            self.start_reuse(runtime.reuse, lambda: context_cache(self.model, self.gates, cache_budget(self.device)),
                             CONTEXT_NOTE)
        else:
            self.start_reuse(runtime.reuse, prefix, prefix_note)

    def reused_grid(self, masks: Sequence[Sequence[Head]], out: Out, start: Callable[[GridBatch[ContextBatch]], Pass],
                    prefix: Callable[[], Out], plain: Callable[[], Out]) -> Out:
        """Every mask's values in ``out``: through the context batches (``start`` their pass) while the context
        cache runs, else ``prefix()`` while prefix reuse runs, else (or once either turns out not to fit the
        model) ``plain()``."""
        if not isinstance(self._reuse, ContextCache):
            return self.reused_or_plain(prefix, plain)
        cached: ContextCache = self._reuse
        return self.reused_or_plain(lambda: mask_grid(
            masks, self.context_grid, start, out, groups=cached.groups(masks), masks_per_forward=lambda batch: (
                masks_per_forward(self.runtime.masks_per_batch, 1, bytes_per_mask(
                    self.model.config, self.model.dtype, batch.inputs), self.device,
                    tokens_per_row=tokens_per_mask(batch.inputs)))), plain)
