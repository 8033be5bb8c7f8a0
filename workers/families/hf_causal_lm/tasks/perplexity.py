"""Evaluation adapter for transformers causal language models: perplexity of a text corpus.

The corpus is tokenised once and cut into windows (:func:`~.corpus.plan_windows`); all windows have
the same length, so batches need no padding and stay on the device. Several masks share one
forward pass: the batch is repeated once per mask and each copy carries its own gates. With
``sweep.reuse`` (the default) each mask's pass also starts at its first gated layer from cached baseline
states (:mod:`headsweep.workers.families.hf_causal_lm.reuse.prefix`); ``reuse: false`` runs every mask through
the whole model. Per window the statistics are ``[nll_sum, n_tokens]`` (natural log), so corpus
perplexity, bootstrap resamples and per-window mean NLL all come from the stored rows
(:data:`headsweep.workers.core.metrics.PERPLEXITY`). Under resample ablation each window batch's donors (other
windows, all of the same length) are recorded once before its masked passes (:mod:`headsweep.workers.ablation.donors`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.donors import donors_for, with_donors
from headsweep.workers.core.baseline_once import BaselineOnce
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Pass, grid_batches, mask_grid
from headsweep.workers.core.metrics import PERPLEXITY
from headsweep.workers.data.data_report import unknown_tokens
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_causal_lm.config import DEFAULT_WINDOW, CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.model.loading import GatedCausalLM, model_facts
from headsweep.workers.families.hf_causal_lm.model.scoring import (
    activation_bytes_per_row,
    backward_bytes_per_row,
    target_nll,
)
from headsweep.workers.families.hf_causal_lm.model.vocab_slices import SlicedHeadNLL
from headsweep.workers.families.hf_causal_lm.reuse.prefix import PrefixReuse, decoder_layout
from headsweep.workers.families.hf_causal_lm.tasks.corpus import Window, plan_windows, read_corpus
from headsweep.workers.families.hf_shared.loading import max_positions, resolve_positions
from headsweep.workers.families.hf_shared.reuse import PrefixReuseSwitch, repeat_rows
from headsweep.workers.families.hf_shared.tokenizer import bos_id, count_unknown
from headsweep.workers.hub.cache import model_label
from headsweep.workers.memory.backward_memory import backward_rows, pieces
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

LOSS_NAME = "token cross-entropy"


def resolve_window(requested: int | None, limit: int | None, model_dir: str) -> int:
    """``data.window`` (tokens per window, at least 2: one to condition on, one to score), against the model."""
    return resolve_positions("data.window", requested, limit, model_dir, DEFAULT_WINDOW, minimum=2)


class CausalLMAdapter(GatedCausalLM, PrefixReuseSwitch, BaselineOnce):
    """A gated causal LM with its corpus cut into windows (an ``EvalAdapter``); ``describe`` records the
    baseline's mean NLL."""

    metric = PERPLEXITY
    backward_budget: int | None = None  # bytes a loss batch's backward pass may keep (None: the device's budget)

    def __init__(self, model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions):
        data_cfg.check()
        text = read_corpus(data_cfg)
        self.load_gated(model_cfg, runtime)
        self.max_positions = max_positions(self.model.config)
        self.window = resolve_window(data_cfg.window, self.max_positions, model_cfg.path)
        self.add_bos = bool(data_cfg.add_bos)
        bos = bos_id(self.tokenizer) if self.add_bos else None
        ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        self.windows = plan_windows(len(ids), self.window, data_cfg.stride, self.add_bos)
        if not self.windows:
            text_per_window = self.window - (1 if self.add_bos else 0)
            raise HeadsweepError(
                f"data file {data_cfg.path} is too short: {len(ids)} tokens, fewer than one window of "
                f"{text_per_window} text tokens (data.window {self.window}{', with BOS' if self.add_bos else ''}); "
                "use more text or a smaller data.window"
            )
        available = len(self.windows)
        if data_cfg.max_windows is not None:
            self.windows = self.windows[: data_cfg.max_windows]
        self.windows = at_positions(self.windows, runtime.examples)
        self.inputs = self._window_inputs(ids, bos).to(self.device)
        # scored[w, j]: window w's position j + 1 is scored (predicted from positions 0..j)
        starts = torch.tensor([w.score_from for w in self.windows])
        self.scored = (torch.arange(1, self.window).unsqueeze(0) >= starts.unsqueeze(1)).to(self.device)
        self.n_tokens = self.scored.sum(dim=1).double().cpu().numpy()
        self.batches = [torch.arange(i, min(i + runtime.batch_size, len(self.windows)))
                        for i in range(0, len(self.windows), runtime.batch_size)]
        self._keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._head_nll = SlicedHeadNLL(self.model)
        self.donors = donors_for(runtime.ablation, self.gates, [self.window] * len(self.windows), what="windows",
                                 where=f"data file {data_cfg.path}", more="more text (or a larger data.max_windows)")
        self.model_name = model_label(model_cfg.path)
        self.dataset_name = data_cfg.name or Path(Path(data_cfg.path).name.removesuffix(".gz")).stem
        self.start_reuse(runtime.reuse, lambda: PrefixReuse(self.model, self.gates,
                                                            decoder_layout(self.model, self.gates.sites),
                                                            self.token_nll, cache_budget(self.device)),
                         "prefix: masks start at their first gated layer from cached baseline states "
                         "(layer outputs and per-head contexts per window batch)")
        scored_total = int(self.n_tokens.sum())
        self.data_facts = {
            "window": self.window, "stride": data_cfg.stride or self.window - (1 if self.add_bos else 0),
            "add_bos": self.add_bos, "max_positions": self.max_positions, "corpus_tokens": len(ids),
            "windows": len(self.windows), "windows_available": available, "scored_tokens": scored_total,
            "perplexity": "exp(sum of per-token NLL / scored tokens), natural log, over windows of data.window "
                          "positions (BOS included), tokens after each window's first scored once; last partial "
                          "window dropped; tokenised once without special tokens",
            "encoding": data_cfg.encoding,
            **unknown_tokens(f"data file {data_cfg.path}", *count_unknown(self.tokenizer, [ids]),
                             self.tokenizer.unk_token),
        }
        self._baseline: MaskOutput | None = None

    def _window_inputs(self, ids: list[int], bos: int | None) -> torch.Tensor:
        rows = [ids[w.start : w.start + w.length] for w in self.windows]
        if bos is not None:
            rows = [[bos, *row] for row in rows]
        return torch.tensor(rows, dtype=torch.long)

    # -- the adapter contract ------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        self.donors.check()  # patch on data without pairs refused here, before the run writes anything
        baseline = self.baseline()
        mean = float(baseline.stats[:, 0].sum() / baseline.stats[:, 1].sum())
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=[f"w{i}" for i in range(len(self.windows))],
            references=[self._span(w) for w in self.windows],
            inventory=self.gates.inventory,
            inputs=self.tokenizer.batch_decode(self.inputs.cpu().tolist()),  # each window's tokens, BOS included
            facts={**model_facts(self.model, self.gates.sites), "mean_nll_nats": mean, "reuse": self.reuse_note,
                   **self.data_facts},
        )

    def _span(self, window: Window) -> str:
        first, last = window.scored_tokens(self.add_bos)
        return f"tokens {first}-{last}"

    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Each window's NLL sum under each mask; under resample ablation with K draws its mean over the draws
        (:mod:`headsweep.workers.ablation.donors`)."""
        return self.donors.mean_over_draws(lambda: self.nll(masks))

    def run_donors(self, donors: np.ndarray) -> None:
        """One ungated forward pass over the windows ``donors`` (the per-batch donor pass of
        :class:`~headsweep.workers.ablation.donors.Donors`); only the last position's logits where the model allows
        it."""
        extra = {"logits_to_keep": 1} if self._keep_logits else {}
        self.model(input_ids=self.inputs[torch.as_tensor(donors, device=self.device)], use_cache=False, **extra)

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        stats = np.stack([values, self.n_tokens], axis=1)
        return MaskOutput(stats=stats, loss=values / self.n_tokens, outputs=[""] * len(self.windows),
                          score=self.metric.score(stats), seconds=seconds)

    @torch.inference_mode()
    def nll(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Summed NLL (nats) of each window's scored tokens under each mask: shape (n_masks, n_windows), float64."""
        return self.reused_or_plain(lambda: self._nll_reused(masks), lambda: self._nll_plain(masks))

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = idx.to(self.device)
        return self.inputs[rows], self.scored[rows]

    def _nll_reused(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Masks grouped by first gated layer; each group starts there from the batch's baseline states, the empty
        mask is the baseline itself (:meth:`~..reuse.prefix.PrefixReuse.start`)."""
        reuse = self._reuse

        def start(batch: GridBatch[torch.Tensor]) -> Pass:
            inputs, scored = self._batch(batch.inputs)
            forward = reuse.start(batch.key, inputs, scored)
            return lambda chunk: self._window_sums(forward(chunk), repeat_rows(scored, len(chunk)))

        return self._grid(masks, start, reuse.groups(masks))

    def _nll_plain(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """The reference: every mask (one copy of the batch each) runs the whole model."""

        def start(batch: GridBatch[torch.Tensor]) -> Pass:
            inputs, scored = self._batch(batch.inputs)

            def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
                stacked, stacked_scored = repeat_rows(inputs, len(chunk)), repeat_rows(scored, len(chunk))
                with self.gates.packed(chunk, batch.rows):
                    return self._window_sums(self.token_nll(stacked, stacked_scored), stacked_scored)

            return forward

        return self._grid(masks, start)

    def _grid(self, masks: Sequence[Sequence[Head]], start: Callable[[GridBatch[torch.Tensor]], Pass],
              groups: list[list[int]] | None = None) -> np.ndarray:
        """Every mask over every window batch (:func:`~headsweep.workers.core.mask_grid.mask_grid`): shape
        (n_masks, n_windows)."""
        out = np.empty((len(masks), len(self.windows)), dtype=np.float64)
        return mask_grid(masks, grid_batches(self.batches, lambda idx: idx), start, out,
                         masks_per_forward=lambda batch: self.masks_per_forward(batch.rows), donors=self.donors,
                         run_donors=self.run_donors, groups=groups)

    @staticmethod
    def _window_sums(token_nll: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """Each row's summed NLL over its scored tokens (float64)."""
        return (token_nll.double() * scored).sum(dim=1)

    def token_nll(self, inputs: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """Per-position NLL (nats; float32, or float64 for a float64 model) of ``inputs[:, 1:]`` given the
        positions before: shape (B, W - 1).

        Only the logits from the first scored position on are computed where the model allows it
        (``logits_to_keep``); positions before it come back as zeros and are never scored. On a CPU the LM head
        and loss go a slice of the vocabulary at a time (:mod:`~..model.vocab_slices`).
        """
        width = inputs.shape[1] - 1
        needed = width - int(scored.float().argmax(dim=1).min()) if bool(scored.any()) else 1
        extra = {"logits_to_keep": needed + 1} if self._keep_logits else {}
        nll = self._head_nll(inputs, needed, **extra)
        full = nll.new_zeros(inputs.shape[0], width)
        full[:, width - needed :] = nll
        return full

    def bytes_per_row(self) -> int:
        """Activation bytes of one window at the widest point (an estimate:
        :func:`~..model.scoring.activation_bytes_per_row`)."""
        return activation_bytes_per_row(self.model.config, self.model.dtype, self.window, self.window)

    def masks_per_forward(self, rows: int) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of a batch as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, max(1, rows), self.bytes_per_row(), self.device,
                                        tokens_per_row=self.window)

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The windows as summed NLL of their scored tokens (``label_smoothing`` does not apply: the
        training loss of a causal LM is plain token cross-entropy); every position is a real token. Under the run's
        per-example fill where it has one (:func:`~headsweep.workers.ablation.donors.with_donors`).

        Each batch is cut into pieces of as many windows as the backward pass's memory budget holds
        (:mod:`headsweep.workers.memory.backward_memory`; ``backward_budget`` bytes, None: the device's activation
        budget), the pieces of one batch sharing its ``group``."""
        recompute = not self.donors.active
        row = backward_bytes_per_row(self.model.config, self.model.dtype, self.window, checkpointed=recompute)
        size = backward_rows(row, self.device, self.backward_budget)
        cut = [(group, piece) for group, idx in enumerate(self.batches) for piece in pieces(idx, size)]
        batches = [self._loss_batch(piece, dtype, group, recompute) for group, piece in cut]
        return with_donors(LossBatches(batches, LOSS_NAME), self.donors, [piece for _, piece in cut], self.run_donors)

    def _loss_batch(self, idx: torch.Tensor, dtype: torch.dtype, group: int, recompute: bool) -> LossBatch:
        inputs = self.inputs[idx.to(self.device)]
        scored = self.scored[idx.to(self.device)]
        real = torch.ones(inputs.shape, dtype=torch.bool, device=inputs.device)

        def loss() -> torch.Tensor:
            logits = self.model(input_ids=inputs, use_cache=False).logits[:, :-1]
            return (target_nll(logits.to(dtype), inputs[:, 1:]) * scored).sum()

        def outputs() -> tuple[torch.Tensor, torch.Tensor]:
            return self.model(input_ids=inputs, use_cache=False).logits[:, :-1], scored.bool()

        return LossBatch({site.key: real for site in self.gates.sites}, int(idx.numel()), loss, outputs, group,
                         recompute)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` windows (cycled if there are fewer), cut to ``max_length`` tokens when given."""
        rows = torch.arange(batch_size) % len(self.windows)
        inputs = self.inputs[rows.to(self.device)]
        if max_length:
            inputs = inputs[:, :max_length]
        return Workload(batch_size, int(inputs.numel()), lambda model: model(input_ids=inputs, use_cache=False))
