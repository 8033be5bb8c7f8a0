"""The contract between headsweep and a model family.

A model family (transformers classifiers, fairseq translation models, a user's plugin) is one
:class:`ModelFamily`: its config sections, and what the generic machinery asks of it.

* ``load(model_cfg, data_cfg, runtime)``: the **evaluation adapter** a Ray actor holds
  (:class:`EvalAdapter`): one gated model with its evaluation data and metric. Besides
  ``describe`` and ``evaluate`` (every experiment), it gives gradient importance its
  ``loss_batches`` and the efficiency experiment its ``workload``, and runs its own optional
  **reuse strategy** (work shared between masks, built on :mod:`headsweep.workers.memory.replay`;
  ``RuntimeOptions.reuse`` False turns it off; ``reuse_note`` says which one runs).
* ``check_data(data_cfg, key)``: what the driver checks of a **data section** before Ray starts.
* ``load_model(model_cfg)``: the **model** alone, without data (:class:`LoadedModel`).
* ``find_sites(model)``: its **attention sites** (where the head gates go); ``owns(model)``: whether a
  bare model is this family's.
* ``prune(model, heads)``: **physical pruning**; ``save_pruned(...)``: **exporting** the pruned model
  in the family's own format; ``loads_exported(folder)`` / ``load_exported(folder)``: reading such a
  folder back (``headsweep.load_pruned``).
* ``attention_weights(model, sites, consume)``: every head's **attention weights** as the modules
  compute them (relevance propagation); ``attention_reader(adapter)``: what **roles** reads of an
  adapter (:class:`headsweep.workers.attention.reader.AttentionReader`); ``syntax_attention``: the attention
  type scored against parses (None: no syntactic heads).
* ``training_label_smoothing(model_cfg)``: the label smoothing the model was **trained** with, if it
  says (the L0 gates' loss).
* ``weight_bytes(model_cfg)``: the **memory** its weights take once a worker loads them, read from the files
  (the driver refuses a run whose workers cannot hold them, before any loads: ``sweep/run/memory.py``).
* ``weight_files(model_cfg)``: the **files** its weights are read from, whose content fingerprint a run keeps
  (a later use of the run with other weights is refused: ``sweep/models/weights.py``).

This module is the contract alone: the built-in families (``headsweep.workers.families.<name>/``,
``family.py`` declaring the ``ModelFamily``; heavy modules imported only when a method needs them, so
the driver never imports fairseq or transformers models it does not use) import it, and
:mod:`headsweep.workers.families.registry` lists them and finds a family by name. A plugin is a
``ModelFamily`` defined elsewhere and named in a config as ``model.kind: package.module:NAME``;
constructed plainly (``ModelFamily(name, model_config, data_config, loader)``) it evaluates masks
and refuses what it does not implement with a clear error; a subclass overrides the methods it
supports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.core.heads import Head, HeadInventory, SiteKey
from headsweep.workers.core.metrics import Metric

if TYPE_CHECKING:  # the driver imports this module: keep torch out of its import time
    import torch
    from torch import nn

    from headsweep.workers.ablation.spec import AblationSpec
    from headsweep.workers.attention.reader import AttentionReader, Consumer
    from headsweep.workers.core.gates import AttentionSite, HeadGates
    from headsweep.workers.core.head_slicing import HeadSlice

R = TypeVar("R", bound="RuntimeOptions")


def _zero_ablation() -> AblationSpec:
    """The default ablation, ``zero`` (nothing changes). The methods build on this contract, so the contract reads
    their spec when a runtime is made rather than when it is imported."""
    from headsweep.workers.ablation.spec import AblationSpec

    return AblationSpec()


@dataclass
class RuntimeOptions:
    """How an adapter runs: the driver's ``sweep`` section, resolved for one worker. A family with settings of its
    own subclasses it (``ModelFamily.runtime_options``; fairseq translation's token budget, loss pass and fused
    attention: :class:`~headsweep.workers.families.fairseq_translation.config.TranslationRuntime`)."""

    device: str = "cpu"
    batch_size: int = 32
    masks_per_batch: int = 0
    reuse: bool = True  # share work between masks (prefix/encoder reuse); False: plain reference path
    threads: int = 0
    seed: int = 0
    # Only these examples (positions in the evaluation set, after data.max_examples), for the subset that
    # sequential screening evaluates first (sweep.screen); None: every example. See workers/data/example_subset.py.
    examples: tuple[int, ...] | None = None
    # What a gated-off head leaves behind (sweep.ablation and its settings); default zero: nothing changes.
    ablation: AblationSpec = field(default_factory=_zero_ablation)

    @classmethod
    def of(cls: type[R], runtime: RuntimeOptions) -> R:
        """``runtime`` as a family's options ``cls``: itself, or (a plain :class:`RuntimeOptions`, as a caller
        outside the driver may hand the loader) its settings with the family's defaults for the rest."""
        if isinstance(runtime, cls):
            return runtime
        names = {f.name for f in fields(cls)}
        return cls(**{f.name: getattr(runtime, f.name) for f in fields(runtime) if f.name in names})


@dataclass
class DatasetInfo:
    """What the driver needs to know about an adapter's evaluation set and model."""

    model: str
    dataset: str
    metric: str
    stat_names: list[str]
    example_ids: list[str]
    references: list[str]
    inventory: HeadInventory
    facts: dict[str, Any] = field(default_factory=dict)
    # The evaluated texts, one per example id (a sentence, a source, a decoded window): stored once per run in the
    # ``inputs`` table for the report's drill-downs. Empty: the family keeps none.
    inputs: list[str] = field(default_factory=list)

    @property
    def n_examples(self) -> int:
        return len(self.example_ids)


@dataclass
class MaskOutput:
    """One evaluation of one mask: per-example statistics, loss and output, in example order."""

    stats: np.ndarray
    loss: np.ndarray | None  # None: not computed (stored as null)
    outputs: list[str]
    score: float
    seconds: float


@dataclass
class LossBatch:
    """One batch of the training loss that gradient importance differentiates.

    ``tokens[site]`` is the batch's (B, T) mask of real (non-padding) tokens as the site sees
    them (batch first, whatever the model's layout); ``loss()`` runs the model (with whatever
    gates are set) and returns the batch's training loss, summed over its examples.
    ``outputs()`` (None where a family has none) runs the model and returns its logits
    ``(..., V)`` with a boolean mask ``(...)`` of the predictions that count (a classifier's
    examples, a translation's real target tokens, a language model's scored tokens): what
    relevance propagation explains.

    ``group``: the evaluation batch this one is a piece of, where an adapter cuts batches to fit the backward
    pass's memory (:mod:`headsweep.workers.memory.backward_memory`): batch-level importance sums a group's gradients
    before taking their absolute value (None: a group of its own). ``recompute``: ``loss()`` may run again during the
    backward pass with the same result (no state set for its forward alone, such as a per-example fill), so
    gradient methods may checkpoint the model's layers.
    """

    tokens: dict[SiteKey, torch.Tensor]
    n_examples: int
    loss: Callable[[], torch.Tensor]
    outputs: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    group: int | None = None
    recompute: bool = False


@dataclass
class LossBatches:
    """An adapter's data as loss batches, and the name of the loss (recorded with the scores)."""

    batches: list[LossBatch]
    loss_name: str


@dataclass
class Workload:
    """One batch of inputs and how a model runs it (what the efficiency experiment times)."""

    examples: int
    tokens: int  # non-padding input (source) tokens
    run: Callable[[nn.Module], object]


class EvalAdapter(Protocol):
    """What a worker actor holds: a gated model with its evaluation data and metric.

    ``describe`` and ``evaluate`` are what every experiment needs. ``model``, ``gates``,
    ``device``, ``loss_batches`` (gradient importance) and ``workload`` (efficiency) are needed by
    the experiments that use them; an adapter without them runs the others.
    """

    metric: Metric
    model: nn.Module
    gates: HeadGates
    device: torch.device
    reuse_note: str  # which reuse strategy runs, or why none does (``describe().facts["reuse"]``)

    def describe(self) -> DatasetInfo: ...

    def evaluate(self, masks: Sequence[Sequence[Head]]) -> list[MaskOutput]:
        """Evaluate each mask (the heads to gate off) on the whole evaluation set."""
        ...

    def loss_batches(self, label_smoothing: float | None, dtype: torch.dtype) -> LossBatches:
        """The adapter's data as training-loss batches computed in ``dtype`` (at least float32).

        ``label_smoothing`` None means the family's training default.
        """
        ...

    def workload(self, batch_size: int, max_length: int) -> Workload:
        """``batch_size`` examples around the median length, run as evaluation runs them."""
        ...


class LoadedModel(Protocol):
    """A family's model loaded without evaluation data (for export), with what saving it needs."""

    model: nn.Module


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config sections and the operations headsweep asks of it.

    ``loader`` is ``package.module:NAME`` of a callable ``(model_cfg, data_cfg, runtime)`` returning
    the :class:`EvalAdapter` (imported when first used). ``checkpoint_key`` is the ``model`` key a
    run over training checkpoints replaces. ``runtime_options``: its :class:`RuntimeOptions`, a subclass where it
    has settings of its own (:meth:`runtime` builds it). ``batches_by_tokens``: its options carry ``max_tokens``
    (``sweep.max_tokens`` is refused for the others).
    ``syntax_attention``: the attention type whose heads roles scores against parses of the
    evaluation text (None: the family has no parsed text). ``hub_ids``: ``model.path`` (and
    ``model.tokenizer``, ``checkpoints``) may name a Hugging Face Hub model in the local cache,
    which a run pins to its commit. ``fills_by_position``: its evaluation runs every attention module over whole
    right-padded sequences, so a gated-off head can be filled per absolute position and the first position kept
    (``ablation.positions: per_position``, ``ablation.keep_first``); False where it cannot (fairseq translation:
    beam search runs decoder attention one position per step, sources are left-padded). ``resample_attention``: the
    attention types whose heads resample ablation can fill with a donor's activations (None: every type); fairseq
    translation's encoder self-attention only, since a donor's decoder states follow its own hypotheses in beam
    search and cannot stand in for another sentence's. The methods past ``load``
    refuse with a clear error (or answer "no") unless a subclass implements them.
    """

    name: str
    model_config: type
    data_config: type
    loader: str
    checkpoint_key: str = "path"
    batches_by_tokens: bool = False
    syntax_attention: str | None = None
    hub_ids: bool = False
    fills_by_position: bool = True
    resample_attention: tuple[str, ...] | None = None
    runtime_options: type[RuntimeOptions] = RuntimeOptions

    def runtime(self, **settings: Any) -> RuntimeOptions:
        """The family's :class:`RuntimeOptions` from ``settings`` (the sweep section resolved for a worker), less
        the settings its options do not have (another family's: the driver hands every family the same ones)."""
        names = {f.name for f in fields(self.runtime_options)}
        return self.runtime_options(**{k: v for k, v in settings.items() if k in names})

    def load(self, model_cfg: Any, data_cfg: Any, runtime: RuntimeOptions) -> EvalAdapter:
        """The evaluation adapter: the gated model on the evaluation data."""
        module, func = self.loader.split(":")
        return getattr(importlib.import_module(module), func)(model_cfg, data_cfg, runtime)

    def check_data(self, data_cfg: Any, key: str = "data") -> None:
        """Everything about the data section ``data_cfg`` (config key ``key``) that needs no model: its settings
        and its files, checked on the driver before anything starts (the workers check the rest against the
        model). By default the section's own ``check_files(key)``, if it has one."""
        check = getattr(data_cfg, "check_files", None)
        if check is not None:
            check(key)

    def check_model(self, model_cfg: Any) -> None:
        """What can be checked of the model of ``model_cfg`` from its files without loading it (no torch), on the
        driver before Ray starts; by default nothing (the workers refuse what they cannot load)."""

    def load_model(self, model_cfg: Any) -> LoadedModel:
        """The model of ``model_cfg`` alone (on the CPU, in eval mode, no gates)."""
        raise self._unsupported("loading a model without its data (headsweep export)")

    def find_sites(self, model: nn.Module) -> list[AttentionSite]:
        """Every attention module of ``model`` whose heads can be gated; empty if it is not this family's."""
        raise self._unsupported("finding attention sites")

    def owns(self, model: nn.Module) -> bool:
        """Whether a bare ``model`` is this family's (asked in registry order by ``registry.family_of_model``)."""
        return bool(self.find_sites(model))

    def prune(self, model: nn.Module, heads: Sequence[Head]) -> dict[SiteKey, HeadSlice]:
        """Remove ``heads`` from ``model`` in place; each pruned module's slice by ``(attention, layer)``."""
        raise self._unsupported("physical pruning")

    def save_pruned(self, model_cfg: Any, loaded: LoadedModel, heads: Sequence[Head], out_dir: Any) -> None:
        """Write ``loaded`` (already pruned of ``heads``) into the empty folder ``out_dir``, in the family's format."""
        raise self._unsupported("exporting a pruned model")

    def stock_sizes(self, model: nn.Module, heads: Sequence[Head]) -> dict[str, int]:
        """The sizes a stock config of ``model`` without ``heads`` states (``headsweep export --stock``: a folder the
        model's own library loads as it is), or a one-line error saying why there is none. Checks only."""
        raise self._unsupported("exporting a stock architecture (--stock)")

    def save_stock(self, model_cfg: Any, loaded: LoadedModel, sizes: dict[str, int], out_dir: Any) -> None:
        """Write ``loaded`` (already pruned of heads :meth:`stock_sizes` accepted) into the empty folder ``out_dir``
        as the stock architecture with ``sizes``."""
        raise self._unsupported("exporting a stock architecture (--stock)")

    def loads_exported(self, folder: str | Path) -> bool:
        """Whether ``folder`` is one this family's ``save_pruned`` writes (``headsweep.load_pruned`` asks)."""
        return False

    def load_exported(self, folder: str | Path) -> nn.Module:
        """The model exported into ``folder`` by ``save_pruned``, its heads removed again (CPU, eval mode)."""
        raise self._unsupported("loading an exported model")

    def attention_weights(self, model: nn.Module, sites: Sequence[AttentionSite],
                          consume: Consumer) -> AbstractContextManager[None]:
        """A context inside which every forward of ``model`` hands each site's per-head attention weights
        ``(batch, heads, query, key)`` to ``consume(site_key, weights)`` as its module computes them, the model
        running the path that exposes them (relevance propagation reads the probabilities this way)."""
        raise self._unsupported("reading attention weights")

    def attention_reader(self, adapter: Any) -> AttentionReader:
        """What roles reads of ``adapter``: its heads' attention maps on its evaluation data, its tokenisation of
        a corpus, its text as the model's pieces (:class:`~headsweep.workers.attention.reader.AttentionReader`).

        By default the adapter's own ``attention_maps(sink)`` (how a plugin takes part); an adapter the family
        cannot read is refused with a clear error.
        """
        if not callable(getattr(adapter, "attention_maps", None)):
            raise HeadsweepError(f"model family {self.name!r} gives no attention maps (its adapter has no "
                                 "attention_maps()): roles cannot run on it")
        from headsweep.workers.attention.reader import AdapterReader

        return AdapterReader(adapter)

    def training_label_smoothing(self, model_cfg: Any) -> float | None:
        """The label smoothing the model of ``model_cfg`` was trained with, if it records it; None: the family's
        training default."""
        return None

    def weight_bytes(self, model_cfg: Any) -> int | None:
        """Bytes the model of ``model_cfg`` takes in a worker once loaded, read from its files without importing
        torch (the driver asks before any worker starts); None where unknown (the driver then checks nothing)."""
        return None

    def weight_files(self, model_cfg: Any) -> list[Path] | None:
        """The files holding the weights of ``model_cfg``'s model, whose content a run's fingerprint hashes
        (``facts.weights``, :mod:`headsweep.sweep.models.weights`); None where unknown (nothing is fingerprinted)."""
        return None

    def _unsupported(self, what: str) -> HeadsweepError:
        return HeadsweepError(f"model family {self.name!r} does not support {what}")
