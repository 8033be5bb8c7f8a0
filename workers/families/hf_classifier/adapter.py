"""Evaluation adapter for transformers sequence classifiers (BERT, RoBERTa, MiniLM, DistilBERT).

The data are tokenised once, sorted by length into batches, and kept on the device. Several
masks share one forward pass: the batch is repeated once per mask and each copy carries its
own gates (per-example gates), which keeps small models busy. With ``sweep.reuse`` (the
default) each mask's pass also starts at its first gated layer from cached baseline states
(:mod:`headsweep.workers.families.hf_classifier.reuse`); ``reuse: false`` runs every mask through the whole model.
Under resample ablation each batch's donors (examples of the same token length, from any batch) are padded as the
batch and recorded once before its masked passes (:mod:`headsweep.workers.ablation.donors`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.donors import donors_for, with_donors
from headsweep.workers.core.family import DatasetInfo, LossBatches, MaskOutput, RuntimeOptions, Workload
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.core.mask_grid import GridBatch, Pass, mask_grid
from headsweep.workers.core.metrics import ACCURACY, LOGIT_DIFF
from headsweep.workers.core.workload import median_batch, take_rows
from headsweep.workers.data.data_report import Finding, merge, report, unknown_tokens
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.families.hf_classifier.data import findings, label_ids, read_examples
from headsweep.workers.families.hf_classifier.model import load_classifier_model, resolve_max_length
from headsweep.workers.families.hf_classifier.reuse import PrefixReuse, classifier_layout
from headsweep.workers.families.hf_classifier.training_loss import classifier_loss_batches, cut_batches
from headsweep.workers.families.hf_shared.loading import max_positions
from headsweep.workers.families.hf_shared.paired import paired_sides
from headsweep.workers.families.hf_shared.reuse import PrefixReuseSwitch, repeat_rows
from headsweep.workers.families.hf_shared.shared_layers import shared_facts
from headsweep.workers.families.hf_shared.sites import check_sites, find_sites
from headsweep.workers.families.hf_shared.tokenizer import count_unknown
from headsweep.workers.hub.cache import model_label
from headsweep.workers.memory.backward_memory import backward_rows
from headsweep.workers.memory.batch_budget import cache_budget
from headsweep.workers.memory.batch_budget import masks_per_forward as budget_masks_per_forward


class ClassifierAdapter(PrefixReuseSwitch):
    """A gated classifier with its tokenised evaluation set (an ``EvalAdapter``)."""

    metric = ACCURACY
    backward_budget: int | None = None  # bytes a loss batch's backward pass may keep (None: the device's budget)

    def __init__(self, model_cfg: ClassifierModel, data_cfg: ClassifierData, runtime: RuntimeOptions):
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        self.device = torch.device(runtime.device)
        self.runtime = runtime
        examples = at_positions(read_examples(data_cfg), runtime.examples)
        loaded = load_classifier_model(model_cfg, runtime.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.gates = HeadGates(_sites_or_error(self.model))
        id2label = {int(k): v for k, v in self.model.config.id2label.items()}
        self.labels = torch.tensor(label_ids(examples.labels, id2label, data_cfg.path, examples.row),
                                   device=self.device)
        # Paired inputs (data.task: paired): the metric is the logit difference; which input of a pair is evaluated
        # and which fills is the run's choice of sides (hf_shared/paired.py), `other` each pair's other input.
        self.paired = data_cfg.paired
        self.metric = LOGIT_DIFF if self.paired else ACCURACY
        spec = runtime.ablation
        self.sides = paired_sides(spec)
        self.evaluated, other = "clean", None
        if self.paired:
            assert examples.corrupted is not None and examples.wrong_labels is not None and examples.lines is not None
            self.wrong = torch.tensor(label_ids(examples.wrong_labels, id2label, data_cfg.path, examples.row),
                                      device=self.device)
            same = (self.labels == self.wrong).nonzero()
            if len(same):
                raise HeadsweepError(f"data file {data_cfg.path}: line {examples.lines[int(same[0])]}: answer and "
                                     "wrong_answer are the same label: their logit difference is always 0")
            self.evaluated = self.sides.evaluated
            texts, other = self.sides.arrange(examples.texts, examples.corrupted)
            examples = dataclasses.replace(examples, texts=texts)
        self.examples = examples
        self._label_text = _label_text(examples.labels, id2label)
        self.max_positions = max_positions(self.model.config)
        self.max_length = resolve_max_length(data_cfg.max_length, self.max_positions, model_cfg.path)
        self.encoding = self.encode(self.max_length)
        self.batches = self.tokenise(self.max_length, runtime.batch_size, self.encoding)
        lengths = [len(ids) for ids in self.encoding["input_ids"]]
        self._donor_encoding = self.encoding
        if other is not None:
            self.other_encoding = self.tokenizer(other, truncation=True, max_length=self.max_length)
            self._check_pair_lengths(lengths, data_cfg.path)
            self._donor_encoding = self.sides.donor_side(self.encoding, self.other_encoding)
        self.donors = donors_for(spec, self.gates, lengths, paired=self.paired, where=f"data file {data_cfg.path}",
                                 more="more examples (a larger data.max_examples, or a larger file)")
        whole = self.tokenizer(examples.texts, examples.text_pairs, verbose=False)["input_ids"]  # not truncated
        subject = f"data file {data_cfg.path}"
        self.data_facts = {"encoding": data_cfg.encoding, "max_length": self.max_length,
                           "max_positions": self.max_positions,
                           **merge(report(subject, [*findings(examples), self.truncated(whole)]),
                                   unknown_tokens(subject, *count_unknown(self.tokenizer, whole),
                                                  self.tokenizer.unk_token))}
        self.model_name = model_label(model_cfg.path)
        self.dataset_name = data_cfg.name or Path(data_cfg.path).stem
        self.start_reuse(runtime.reuse, lambda: PrefixReuse(self.model, self.gates,
                                                            classifier_layout(self.model, self.gates.sites),
                                                            cache_budget(self.device)),
                         "prefix: masks start at their first gated layer from cached baseline states")

    def encode(self, max_length: int):
        """The evaluation set's encodings (token ids per example, unpadded), truncated to ``max_length``."""
        ex = self.examples
        return self.tokenizer(ex.texts, ex.text_pairs, truncation=True, max_length=max_length)

    def tokenise(self, max_length: int, batch_size: int, enc=None) -> list[tuple[torch.Tensor, dict]]:
        """The evaluation set as batches of ``(example indices, inputs on the device)``, sorted by length
        (``enc``: :meth:`encode`'s result for ``max_length``, when already computed)."""
        enc = self.encode(max_length) if enc is None else enc
        order = sorted(range(len(enc["input_ids"])), key=lambda i: len(enc["input_ids"][i]))
        return [(torch.tensor(idx), self.padded(enc, idx))
                for idx in (order[start : start + batch_size] for start in range(0, len(order), batch_size))]

    def padded(self, enc, idx) -> dict:
        """Examples ``idx`` of the encodings ``enc`` as one batch padded by the tokenizer, on the device: examples
        of the same lengths in the same order come out with the same shape and padding."""
        feats = [{k: enc[k][int(i)] for k in enc.keys()} for i in idx]
        return {k: v.to(self.device) for k, v in self.tokenizer.pad(feats, return_tensors="pt").items()}

    def _check_pair_lengths(self, lengths: list[int], path: str) -> None:
        """Both inputs of every pair the same number of tokens (patching puts one's activations at the other's
        positions), or one line naming the first pair that differs."""
        for i, n in enumerate(lengths):
            m = len(self.other_encoding["input_ids"][i])
            if m != n:
                clean, corrupted = self.sides.clean_and_corrupted(n, m)
                raise HeadsweepError(f"data file {path}: line {self.examples.lines[i]}: the clean input is {clean} "
                                     f"tokens and the corrupted one {corrupted}; patching puts one input's activations "
                                     "at the other's positions, so they must tokenise to the same length: reword one "
                                     "of them")

    def run_donors(self, donors) -> None:
        """One ungated forward pass over the donor inputs of examples ``donors`` (another example's under resample,
        the pair's other input under patch), padded as a batch (the per-batch donor pass of
        :class:`~headsweep.workers.ablation.donors.Donors`)."""
        self.model(**self.padded(self._donor_encoding, donors))

    def truncated(self, whole: list[list[int]]) -> Finding:
        """The examples longer than ``max_length`` tokens (cut to it by ``tokenise``); ``whole``: their token ids
        before truncation."""
        ex = self.examples
        lengths = [len(ids) for ids in whole]
        return Finding("truncated_examples", f"examples longer than data.max_length {self.max_length} tokens, "
                       "truncated to it", [ex.ids[i] for i, n in enumerate(lengths) if n > self.max_length])

    def describe(self) -> DatasetInfo:
        self.donors.check()  # patch on data without pairs refused here, before the run writes anything
        paired = {}
        if self.paired:  # both unpatched means: the normalised patching score is computed from them
            evaluated = float(self.statistic(self.logits([[]])[0]).mean())
            other = float(self.statistic(self._other_logits()).mean())
            clean, corrupted = self.sides.clean_and_corrupted(evaluated, other)
            paired = {"task": "paired", "evaluated_input": self.evaluated, "logit_diff_clean": clean,
                      "logit_diff_corrupted": corrupted}
        return DatasetInfo(
            model=self.model_name,
            dataset=self.dataset_name,
            metric=self.metric.name,
            stat_names=list(self.metric.stat_names),
            example_ids=self.examples.ids,
            references=self.examples.labels,
            inventory=self.gates.inventory,
            inputs=_input_texts(self.examples),
            facts={"model_class": type(self.model).__name__, "num_labels": int(self.model.config.num_labels),
                   "dtype": str(self.model.dtype).removeprefix("torch."), "reuse": self.reuse_note, **self.data_facts,
                   **paired, **shared_facts(self.gates.sites)},
        )

    @torch.inference_mode()
    def _other_logits(self) -> torch.Tensor:
        """The ungated model's logits on each pair's other input: (n_examples, n_labels)."""
        out = torch.empty(len(self.examples.ids), self.model.config.num_labels, device=self.device)
        self.gates.clear()
        for idx, _ in self.batches:
            out[idx.to(self.device)] = self.model(**self.padded(self.other_encoding, idx)).logits.float()
        return out

    def statistic(self, logits: torch.Tensor) -> torch.Tensor:
        """Per example (last axis of ``logits`` the labels): 1.0 when the prediction is right (accuracy), or for
        paired inputs the answer's logit minus the wrong answer's (logit_diff); float64."""
        if not self.paired:
            return (logits.argmax(-1) == self.labels).double()
        shape = logits.shape[:-1] + (1,)
        answer = logits.gather(-1, self.labels.expand(shape[:-1]).unsqueeze(-1))
        wrong = logits.gather(-1, self.wrong.expand(shape[:-1]).unsqueeze(-1))
        return (answer - wrong).squeeze(-1).double()

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The evaluation batches as summed cross-entropy (``label_smoothing`` does not apply to classifiers), under
        the run's per-example fill where it has one (:func:`~headsweep.workers.ablation.donors.with_donors`); batches
        cut to the backward pass's memory budget (``backward_budget`` bytes, None: the device's activation budget)."""
        recompute = not self.donors.active

        def rows(inputs: dict) -> int:
            return backward_rows(self.backward_bytes_per_row(inputs, recompute), self.device, self.backward_budget)

        pieces = cut_batches(self.batches, rows)
        return with_donors(classifier_loss_batches(self.model, self.gates, pieces, self.labels, dtype, recompute),
                           self.donors, [idx for _, idx, _ in pieces], self.run_donors)

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """One forward pass of ``batch_size`` examples around the median length (cycled if the set is smaller)."""
        _, inputs = median_batch(self.tokenise(max_length or self.max_length, batch_size), lambda b: len(b[0]))
        n = len(next(iter(inputs.values())))
        inputs = take_rows(inputs, n, batch_size)
        real = inputs.get("attention_mask")
        tokens = int(real.sum()) if real is not None else int(inputs["input_ids"].numel())
        return Workload(batch_size, tokens, lambda model: model(**inputs))

    def length(self, inputs: dict | None = None) -> int:
        """Tokens of one example of ``inputs`` (default: the longest batch), padding included."""
        if inputs is None:
            return max(b["input_ids"].shape[1] for _, b in self.batches)
        return int(inputs["input_ids"].shape[1])

    def bytes_per_row(self, inputs: dict | None = None) -> int:
        """Activation bytes of one example of ``inputs`` (default: the longest batch) at the widest
        point of a layer (an estimate, see batch_budget).

        Per token: hidden states, queries/keys/values, contexts and outputs (~8 x hidden), the
        feed-forward activation before and after its nonlinearity (2 x intermediate) and a
        row of attention scores before and after softmax (2 x heads x length).
        """
        cfg = self.model.config
        hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "dim", 0) or 768)
        inner = int(getattr(cfg, "intermediate_size", 0) or getattr(cfg, "hidden_dim", 0) or 4 * hidden)
        heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_heads", 0) or 12)
        length = self.length(inputs)
        itemsize = torch.finfo(self.model.dtype).bits // 8
        return length * itemsize * (8 * hidden + 2 * inner + 2 * heads * length)

    def backward_bytes_per_row(self, inputs: dict, checkpointed: bool) -> int:
        """What one example of ``inputs`` keeps for a backward pass through the gates (an estimate): with the
        layers checkpointed, every layer's input and, twice over (activations and their gradients), one layer's
        activations (:meth:`bytes_per_row`); without, every layer's activations."""
        cfg = self.model.config
        layers = len(self.gates.sites)  # a classifier's encoder: one self-attention site per layer
        hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "dim", 0) or 768)
        length = inputs["input_ids"].shape[1]
        itemsize = torch.finfo(self.model.dtype).bits // 8
        if checkpointed:
            return layers * length * hidden * itemsize + 2 * self.bytes_per_row(inputs)
        return layers * self.bytes_per_row(inputs)

    def masks_per_forward(self, inputs: dict | None = None) -> int:
        """``sweep.masks_per_batch``, or (0: automatic) as many copies of the batch ``inputs``
        (default: the longest) as the activation budget holds."""
        return budget_masks_per_forward(self.runtime.masks_per_batch, self.runtime.batch_size,
                                        self.bytes_per_row(inputs), self.device, tokens_per_row=self.length(inputs))

    @torch.inference_mode()
    def logits(self, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Logits of every example under each mask: shape (n_masks, n_examples, n_labels)."""
        return self.reused_or_plain(lambda: self._logits_reused(masks), lambda: self._logits_plain(masks))

    def _logits_reused(self, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """Masks grouped by first gated layer; each group starts there from the batch's baseline states
        (:meth:`~.reuse.PrefixReuse.start`)."""
        reuse = self._reuse

        def start(batch: GridBatch[dict]) -> Pass:
            forward = reuse.start(batch.key, batch.inputs)
            return lambda chunk: forward(chunk).float()

        return self._grid(masks, start, reuse.groups(masks))

    def _logits_plain(self, masks: Sequence[Sequence[Head]]) -> torch.Tensor:
        """The reference: every mask (or copy of the batch) runs the whole model."""

        def start(batch: GridBatch[dict]) -> Pass:
            def forward(chunk: list[Sequence[Head]]) -> torch.Tensor:
                stacked = {k: repeat_rows(v, len(chunk)) for k, v in batch.inputs.items()}
                with self.gates.packed(chunk, batch.rows):
                    return self.model(**stacked).logits.float()

            return forward

        return self._grid(masks, start)

    def _grid(self, masks: Sequence[Sequence[Head]], start: Callable[[GridBatch[dict]], Pass],
              groups: list[list[int]] | None = None) -> torch.Tensor:
        """Every mask over every batch (:func:`~headsweep.workers.core.mask_grid.mask_grid`): logits of shape
        (n_masks, n_examples, n_labels), on the device."""
        out = torch.empty(len(masks), len(self.examples.ids), self.model.config.num_labels, device=self.device)
        batches = [GridBatch(key, inputs, idx) for key, (idx, inputs) in enumerate(self.batches)]
        return mask_grid(masks, batches, start, out,
                         masks_per_forward=lambda batch: self.masks_per_forward(batch.inputs),
                         donors=self.donors, run_donors=self.run_donors, groups=groups)

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Each mask's per-example statistics and loss; under resample ablation with K draws
        (``ablation.resamples``), their mean over the draws (:mod:`headsweep.workers.ablation.donors`), and the outputs
        of the first draw."""
        start = time.perf_counter()
        correct, loss, preds = [], [], []
        for _ in self.donors.draws():
            logits = self.logits(masks)
            pred = logits.argmax(-1)
            correct.append(self.statistic(logits).cpu().numpy())
            loss.append(np.stack([F.cross_entropy(row, self.labels, reduction="none").double().cpu().numpy()
                                  for row in logits]))
            preds.append(pred.cpu())
        seconds_each = (time.perf_counter() - start) / max(1, len(masks))
        mean_correct, mean_loss = np.mean(correct, axis=0), np.mean(loss, axis=0)
        results = []
        for m in range(len(masks)):
            stats = mean_correct[m][:, None]
            results.append(
                MaskOutput(
                    stats=stats,
                    loss=mean_loss[m],
                    outputs=[self._label_text[int(p)] for p in preds[0][m]],
                    score=self.metric.score(stats),
                    seconds=seconds_each,
                )
            )
        return results


SUPPORTED = "BERT, RoBERTa, ELECTRA, MiniLM, DistilBERT, ModernBERT and the other layouts of docs/families.md"


def _sites_or_error(model):
    sites = find_sites(model)
    check_sites(model, sites, "hf_classifier", SUPPORTED)
    return sites


def _label_text(raw: list[str], id2label: dict[int, str]) -> dict[int, str]:
    """Print predictions the way the data file writes labels: names, or integer ids."""
    names = set(id2label.values())
    if all(r in names for r in raw):
        return dict(id2label)
    return {i: str(i) for i in id2label}


def load_classifier(model_cfg: ClassifierModel, data_cfg: ClassifierData, runtime: RuntimeOptions) -> ClassifierAdapter:
    """Loader named by the ``hf_classifier`` model family."""
    return ClassifierAdapter(model_cfg, data_cfg, runtime)


def _input_texts(examples) -> list[str]:
    """Each example's text as the model reads it (a text pair joined by `` [SEP] ``), for the run's ``inputs``."""
    if examples.text_pairs is None:
        return list(examples.texts)
    return [f"{a} [SEP] {b}" for a, b in zip(examples.texts, examples.text_pairs, strict=True)]
