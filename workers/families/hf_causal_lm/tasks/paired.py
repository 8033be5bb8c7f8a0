"""Paired prompts scored by logit difference (``data.task: paired``): what activation patching evaluates.

The data are clean / corrupted prompt pairs (:mod:`.paired_tokens`, the format).
Per pair the statistic is ``logit_diff``: the logit of the answer token minus that of the wrong answer at the
prompt's last position (:data:`headsweep.workers.core.metrics.LOGIT_DIFF`; the corpus score is the mean, so the paired
bootstrap and t-test run on it as on any metric).

Which prompt is evaluated: the clean one, except under ``sweep.ablation: patch`` with ``ablation.direction:
denoising``, where it is the corrupted one. So the baseline (the empty mask) is the unpatched clean run under
noising (and every other method) and the unpatched corrupted run under denoising; under patching a gated-off head
takes its output on the other prompt of the pair (:mod:`headsweep.workers.ablation.donors`). ``describe`` records both
unpatched means (``logit_diff_clean``, ``logit_diff_corrupted``) in the run's facts: the normalised patching score
``(patched - corrupted) / (clean - corrupted)`` is computed from them.

Pairs are batched by token length (a batch holds prompts of one length: no padding, the last position is the last
real token, and resample ablation's same-length donors exist whenever a length has two pairs). Several masks share
one forward pass and prefix reuse runs as for perplexity (:mod:`headsweep.workers.families.hf_causal_lm.reuse.prefix`),
with the per-pair values in place of the per-token NLL.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.donors import donors_for, with_donors
from headsweep.workers.ablation.registry import method_of
from headsweep.workers.core.baseline_once import BaselineOnce
from headsweep.workers.core.family import DatasetInfo, LossBatch, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Pass, grid_batches, mask_grid
from headsweep.workers.core.metrics import LOGIT_DIFF
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.data.paired_data import read_pairs
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.model.loading import GatedCausalLM, model_facts
from headsweep.workers.families.hf_causal_lm.model.scoring import activation_bytes_per_row, target_nll
from headsweep.workers.families.hf_causal_lm.reuse.prefix import PrefixReuse, decoder_layout
from headsweep.workers.families.hf_causal_lm.tasks.paired_tokens import encode_pairs
from headsweep.workers.families.hf_shared.loading import max_positions
from headsweep.workers.families.hf_shared.paired import paired_sides
from headsweep.workers.families.hf_shared.reuse import PrefixReuseSwitch
from headsweep.workers.families.hf_shared.tokenizer import bos_id
from headsweep.workers.hub.cache import model_label
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward

LOSS_NAME = "cross-entropy of the answer token at the last position"
CONVENTION = ("logit_diff: logit of the answer token minus that of the wrong answer at the prompt's last position "
              "(prompts and answers encoded without special tokens, BOS before each prompt with data.add_bos; the "
              "answers one token each); corpus score: the mean over pairs")


class PairedAdapter(GatedCausalLM, PrefixReuseSwitch, BaselineOnce):
    """A gated causal LM with clean / corrupted prompt pairs (an ``EvalAdapter``); ``describe`` records the
    unpatched clean and corrupted mean logit differences."""

    metric = LOGIT_DIFF

    def __init__(self, model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions):
        data_cfg.check()
        pairs = read_pairs(data_cfg)  # a bad line costs no model load
        self.load_gated(model_cfg, runtime)
        available = len(pairs)
        if data_cfg.max_pairs is not None:
            pairs = pairs[: data_cfg.max_pairs]
        self.pairs = at_positions(pairs, runtime.examples)
        bos = bos_id(self.tokenizer) if data_cfg.add_bos else None
        encoded = encode_pairs(self.tokenizer, self.pairs, bos, data_cfg.path)
        self.max_positions = max_positions(self.model.config)
        longest = max(encoded, key=lambda e: len(e.clean))
        if self.max_positions and len(longest.clean) > self.max_positions:
            line = self.pairs[encoded.index(longest)].line
            raise HeadsweepError(f"data file {data_cfg.path}: line {line}: the prompts are {len(longest.clean)} "
                                 f"tokens, more than the model's {self.max_positions} positions: shorten them")
        self.spec = runtime.ablation
        self.sides = paired_sides(self.spec)
        clean = [e.clean for e in encoded]
        # The prompts each mask is evaluated on, and the other prompt of each pair (what patching fills from).
        self.prompts, self.others = self.sides.arrange(clean, [e.corrupted for e in encoded])
        self.evaluated = self.sides.evaluated
        self.answers = torch.tensor([[e.answer, e.wrong_answer] for e in encoded], device=self.device)
        self.lengths = [len(p) for p in clean]
        self.batches = self._batches(runtime.batch_size)
        self._keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._donor_prompts = self.sides.donor_side(self.prompts, self.others)
        self.donors = donors_for(self.spec, self.gates, self.lengths, paired=True, what="pairs",
                                 where=f"data file {data_cfg.path}", more="more pairs (or a larger data.max_pairs)")
        self.model_name = model_label(model_cfg.path)
        self.dataset_name = data_cfg.name or Path(data_cfg.path).stem
        self.start_reuse(runtime.reuse, lambda: PrefixReuse(self.model, self.gates,
                                                            decoder_layout(self.model, self.gates.sites),
                                                            self.pair_values, cache_budget(self.device)),
                         "prefix: masks start at their first gated layer from cached baseline states "
                         "(layer outputs and per-head contexts per batch of pairs)")
        templates = Counter(p.template for p in self.pairs if p.template)
        self.data_facts = {
            "task": "paired", "pairs": len(self.pairs), "pairs_available": available, "add_bos": bos is not None,
            "prompt_lengths": dict(sorted(Counter(self.lengths).items())), "templates": dict(templates),
            "evaluated_prompt": self.evaluated, "convention": CONVENTION, "encoding": data_cfg.encoding,
        }
        self.data_facts.update(method_of(self.spec).data_facts(self.spec))  # patch: its direction
        self._baseline: MaskOutput | None = None

    def _batches(self, batch_size: int) -> list[torch.Tensor]:
        """Pair indices, by length: every batch holds prompts of one length (no padding), at most ``batch_size``."""
        batches = []
        for length in sorted(set(self.lengths)):
            members = [i for i, n in enumerate(self.lengths) if n == length]
            batches += [torch.tensor(members[i : i + batch_size]) for i in range(0, len(members), max(1, batch_size))]
        return batches

    def _inputs(self, prompts: Sequence[Sequence[int]], rows) -> torch.Tensor:
        return torch.tensor([prompts[int(i)] for i in rows], dtype=torch.long, device=self.device)

    # -- the adapter contract ------------------------------------------------------------------------------------
    def describe(self) -> DatasetInfo:
        baseline = self.baseline()
        other = float(self._unmasked(self.others)[:, 0].mean())
        evaluated = float(baseline.stats[:, 0].mean())
        clean, corrupted = self.sides.clean_and_corrupted(evaluated, other)
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=[f"p{i}" for i in range(len(self.pairs))],
            references=[p.answer for p in self.pairs],
            inventory=self.gates.inventory,
            inputs=[f"clean: {p.clean} | corrupted: {p.corrupted} (answer {p.answer}, wrong {p.wrong_answer})"
                    for p in self.pairs],  # for the run's inputs table
            facts={**model_facts(self.model, self.gates.sites), "reuse": self.reuse_note, **self.data_facts,
                   "logit_diff_clean": clean, "logit_diff_corrupted": corrupted},
        )

    @torch.inference_mode()
    def _unmasked(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Per pair ``[logit_diff, answer NLL]`` of the ungated model on ``prompts`` (one of the two sides)."""
        out = np.empty((len(self.pairs), 2), dtype=np.float64)
        self.gates.clear()
        for idx in self.batches:
            out[idx.numpy()] = self.pair_values(self._inputs(prompts, idx), self.answers[idx.to(self.device)]
                                                ).double().cpu().numpy()
        return out

    def values(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Per mask and pair ``[logit_diff, answer NLL]``: shape (n_masks, n_pairs, 2); under resample ablation with
        K draws the mean over the draws (:mod:`headsweep.workers.ablation.donors`)."""
        return self.donors.mean_over_draws(lambda: self.logit_diffs(masks))

    def output(self, values: np.ndarray, seconds: float) -> MaskOutput:
        stats = values[:, :1].copy()
        return MaskOutput(stats=stats, loss=values[:, 1].copy(), outputs=[""] * len(self.pairs),
                          score=self.metric.score(stats), seconds=seconds)

    def run_donors(self, donors: np.ndarray) -> None:
        """One ungated forward pass over the donor prompts of pairs ``donors`` (the other prompt under patching,
        the evaluated prompt of another pair under resample): the per-batch donor pass of
        :class:`~headsweep.workers.ablation.donors.Donors`."""
        extra = {"logits_to_keep": 1} if self._keep_logits else {}
        self.model(input_ids=self._inputs(self._donor_prompts, donors), use_cache=False, **extra)

    @torch.inference_mode()
    def logit_diffs(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        """Per mask and pair ``[logit_diff, answer NLL]`` (float64): the current donor draw only."""
        return self.reused_or_plain(lambda: self._reused(masks), lambda: self._plain(masks))

    def _reused(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        reuse = self._reuse

        def start(batch: GridBatch[torch.Tensor]) -> Pass:
            return reuse.start(batch.key, *self._batch(batch.inputs))

        return self._grid(masks, start, reuse.groups(masks))

    def _plain(self, masks: Sequence[Sequence[Head]]) -> np.ndarray:
        def start(batch: GridBatch[torch.Tensor]) -> Pass:
            inputs, answers = self._batch(batch.inputs)

            def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
                with self.gates.packed(chunk, batch.rows):
                    return self.pair_values(inputs.repeat(len(chunk), 1), answers.repeat(len(chunk), 1))

            return forward

        return self._grid(masks, start)

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluated prompts of pairs ``idx`` and their answer ids, on the device."""
        return self._inputs(self.prompts, idx), self.answers[idx.to(self.device)]

    def _grid(self, masks: Sequence[Sequence[Head]], start: Callable[[GridBatch[torch.Tensor]], Pass],
              groups: list[list[int]] | None = None) -> np.ndarray:
        """Per mask and pair ``[logit_diff, answer NLL]`` over every batch
        (:func:`~headsweep.workers.core.mask_grid.mask_grid`), float64."""
        out = np.empty((len(masks), len(self.pairs), 2), dtype=np.float64)
        return mask_grid(masks, grid_batches(self.batches, lambda idx: idx), start, out,
                         masks_per_forward=lambda batch: self.masks_per_forward(self._inputs(self.prompts,
                                                                                              batch.inputs)),
                         donors=self.donors, run_donors=self.run_donors, groups=groups)

    def last_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits at the last position of every row, ``(B, V)``, with the gates as they are set (only that
        position's logits where the model allows it)."""
        extra = {"logits_to_keep": 1} if self._keep_logits else {}
        return self.model(input_ids=inputs, use_cache=False, **extra).logits[:, -1]

    def pair_values(self, inputs: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """Per row ``[logit_diff, answer NLL]`` (``answers``: ``(B, 2)`` answer and wrong-answer ids), in at least
        float32: the logits at the last position, answer minus wrong answer, and the answer's cross-entropy."""
        logits = self.last_logits(inputs)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        diff = logits.gather(1, answers[:, :1]) - logits.gather(1, answers[:, 1:])
        return torch.cat([diff, target_nll(logits, answers[:, 0]).unsqueeze(1)], dim=1)

    def bytes_per_row(self, inputs: torch.Tensor) -> int:
        """Activation bytes of one row of ``inputs`` (see :func:`~..model.scoring.activation_bytes_per_row`)."""
        return activation_bytes_per_row(self.model.config, self.model.dtype, inputs.shape[1],
                                        1 if self._keep_logits else inputs.shape[1])

    def masks_per_forward(self, inputs: torch.Tensor) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of ``inputs`` as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, max(1, inputs.shape[0]),
                                        self.bytes_per_row(inputs), self.device, tokens_per_row=inputs.shape[1])

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The evaluated prompts as the summed cross-entropy of their answer token at the last position
        (``label_smoothing`` does not apply); every position is a real token. Under the run's per-example fill where
        it has one (:func:`~headsweep.workers.ablation.donors.with_donors`)."""
        return with_donors(LossBatches([self._loss_batch(idx, dtype) for idx in self.batches], LOSS_NAME),
                           self.donors, self.batches, self.run_donors)

    def _loss_batch(self, idx: torch.Tensor, dtype: torch.dtype) -> LossBatch:
        inputs, answers = self._batch(idx)
        real = torch.ones(inputs.shape, dtype=torch.bool, device=self.device)

        def loss() -> torch.Tensor:
            return target_nll(self.last_logits(inputs).to(dtype), answers[:, 0]).sum()

        def outputs() -> tuple[torch.Tensor, torch.Tensor]:
            return self.last_logits(inputs).unsqueeze(1), real[:, :1]

        return LossBatch({site.key: real for site in self.gates.sites}, int(idx.numel()), loss, outputs)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` prompts of the median batch (cycled if there are fewer), cut to ``max_length`` tokens when
        given."""
        idx = median_batch(self.batches, lambda b: int(b.numel()))
        inputs = take_rows(self._inputs(self.prompts, idx), int(idx.numel()), batch_size)
        if max_length:
            inputs = inputs[:, :max_length]
        return Workload(batch_size, int(inputs.numel()), lambda model: model(input_ids=inputs, use_cache=False))
