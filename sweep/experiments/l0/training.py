"""Training Hard Concrete head gates from a converged model (Voita et al. 2019 sec. 6).

The gates sit where every other head gate of headsweep sits (``headsweep.workers.core.gates``: the input
of each attention module's output projection), so one trainer serves every model family: the loss
is the family's own training loss as gradient importance uses it (``EvalAdapter.loss_batches``):
cross-entropy for classifiers, teacher-forced label-smoothed cross-entropy for fairseq translation
(epsilon ``label_smoothing``, default the family's 0.1, as ``headsweep.workers.families.fairseq_translation.train``
trains), token negative log-likelihood for causal LMs. Each step takes the next batch of the training
data (cyclically), samples one gate per head for the batch (Hard Concrete, ``hard_concrete.py``)
and minimises

    loss(batch) / n_examples(batch) + lambda * sum_h P(g_h > 0)

with Adam (``lr`` for the gates). ``train: gates`` updates only ``log_alpha`` (the model is frozen);
``train: all`` updates the model's weights as well (as the paper does), at ``model_lr``. The model runs
in eval mode (no dropout), so a run is a deterministic function of its settings: the noise of step
``t`` comes from a generator seeded with ``(seed, t)``, which is also what makes a run resumed from a
checkpoint (:meth:`L0Trainer.state_dict`) reach exactly the gates of an uninterrupted one.

``l0_trainable`` is the Ray Tune function trainable: one trial per lambda. Worker-side code of the ``l0`` kind: it
imports only ``headsweep.workers`` (and this folder's ``hard_concrete``), and trains with the ``l0`` config section
(``settings.L0Section``) as the driver read it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from headsweep.errors import HeadsweepError
from headsweep.sweep.experiments.l0.hard_concrete import HardConcrete
from headsweep.workers.ablation.worker_fill import fill_of
from headsweep.workers.core.family import EvalAdapter, RuntimeOptions
from headsweep.workers.core.heads import Head, SiteKey
from headsweep.workers.families.registry import model_family
from headsweep.workers.memory.backward_memory import by_group

STATE_FILE = "l0_state.pt"


def _step_seed(seed: int, step: int) -> int:
    # One generator per step: the noise of step t does not depend on how many steps ran in this process.
    return (seed * 1_000_003 + step) % (2**63 - 1)


@dataclass
class StepMetrics:
    """What one step reports: task loss (per example), expected open gates, the total."""

    step: int
    task_loss: float
    expected_open: float
    loss: float
    closed: int


class L0Trainer:
    """Hard Concrete gates on ``adapter``'s model, trained on ``adapter``'s data (its ``loss_batches``)."""

    def __init__(self, adapter: EvalAdapter, settings: Any, lam: float):
        """``settings``: the ``l0`` config section (``L0Section``); ``lam``: this trial's penalty weight."""
        if not lam >= 0:
            raise HeadsweepError(f"l0 lambda must be >= 0, got {lam}")
        settings.check()
        if not hasattr(adapter, "loss_batches"):
            raise HeadsweepError(f"{type(adapter).__name__}: this model family declares no training loss "
                                 "(EvalAdapter.loss_batches), so L0 gates cannot be trained")
        self.adapter, self.settings, self.lam = adapter, settings, float(lam)
        self.gates = adapter.gates
        self.model = adapter.model
        self.concrete = HardConcrete(beta=settings.beta)
        self.sites = [s for s in self.gates.sites if settings.attention is None or s.attention in settings.attention]
        if not self.sites:
            raise HeadsweepError(f"l0.attention {settings.attention} names no attention type of the model")
        param = next(self.model.parameters())
        self.dtype = torch.promote_types(param.dtype, torch.float32)
        self.device = param.device
        self.log_alpha: dict[SiteKey, torch.Tensor] = {
            s.key: torch.full((s.num_heads,), float(settings.init_log_alpha), dtype=torch.float32,
                              device=self.device, requires_grad=True)
            for s in self.sites
        }
        prepared = adapter.loss_batches(settings.label_smoothing, self.dtype)
        if not prepared.batches:
            raise HeadsweepError("no training data for the L0 gates (l0.data has no examples)")
        # One step per evaluation batch, whatever pieces the backward pass's memory budget cut it into.
        self.batches = by_group(prepared.batches)
        self.loss_name = prepared.loss_name
        groups: list[dict] = [{"params": list(self.log_alpha.values()), "lr": settings.lr}]
        self._frozen = [p for p in self.model.parameters() if p.requires_grad]
        if settings.train == "all":
            # The weights of a converged model want a far smaller step than the gates (model_lr).
            groups.append({"params": self._frozen, "lr": settings.model_lr or settings.lr})
            self._frozen = []
        self.optimizer = torch.optim.Adam(groups)
        self.step = 0

    # -- training -------------------------------------------------------------------------
    def train_step(self) -> StepMetrics:
        """One update on the next batch; returns its metrics."""
        pieces = self.batches[self.step % len(self.batches)]
        examples = sum(piece.n_examples for piece in pieces)
        generator = torch.Generator().manual_seed(_step_seed(self.settings.seed, self.step))
        was_training = self.model.training
        self.model.eval()
        for p in self._frozen:
            p.requires_grad_(False)
        try:
            # inference_mode(False): a caller inside inference mode (a Ray actor's default is not) gets a graph.
            with torch.inference_mode(False), torch.enable_grad():
                values = {key: self.concrete.sample(la, generator).to(self.dtype) for key, la in self.log_alpha.items()}
                self.gates.set_values(values)
                self.optimizer.zero_grad(set_to_none=True)
                penalty = self.expected_open()
                # The batch's pieces one at a time, their gradients summed: a piece's graph is freed before the next.
                task = torch.zeros((), dtype=self.dtype, device=self.device)
                for i, piece in enumerate(pieces):
                    part = piece.loss() / examples
                    last = i == len(pieces) - 1
                    # retain_graph: the gate samples' graph serves every piece; each piece's own graph is freed
                    # with ``part`` once the loop moves on.
                    (part + self.lam * penalty if last else part).backward(retain_graph=not last)
                    task = task + part.detach()
                total = task + self.lam * penalty.detach()
                if not torch.isfinite(total):
                    # A NaN step would leave NaN gates that close nothing and read as a result.
                    raise HeadsweepError(f"l0 lambda={self.lam:g}: the loss is not finite at step "
                                         f"{self.step + 1} (task loss {float(task):g}, expected open gates "
                                         f"{float(penalty):g}); lower lambda or l0.lr")
                self.optimizer.step()
        finally:
            self.gates.clear()
            for p in self._frozen:
                p.requires_grad_(True)
            self.model.train(was_training)
        self.step += 1
        return StepMetrics(self.step, float(task.detach()), float(penalty.detach()), float(total.detach()),
                           len(self.closed_heads()))

    def expected_open(self) -> torch.Tensor:
        """The L0 penalty: expected number of open gates over every gated head."""
        return sum(self.concrete.penalty(la) for la in self.log_alpha.values())

    def train(self, steps: int | None = None) -> list[StepMetrics]:
        """Run until ``steps`` updates in all (default ``settings.steps``)."""
        target = self.settings.steps if steps is None else steps
        return [self.train_step() for _ in range(max(0, target - self.step))]

    # -- results --------------------------------------------------------------------------
    def closed_heads(self) -> list[Head]:
        """Heads whose gate is closed by ``settings.closing``, in inventory order."""
        out = []
        with torch.no_grad():
            for site in self.sites:
                closed = self.concrete.closed(self.log_alpha[site.key], self.settings.closing)
                out += [Head(site.attention, site.layer, h) for h in range(site.num_heads) if bool(closed[h])]
        return sorted(out)

    def gate_rows(self) -> list[dict]:
        """One row per gated head: attention, layer, head, log_alpha, p_open, closed, step."""
        sites = [(s.attention, s.layer, s.num_heads) for s in self.sites]
        return rows_from_state(self.state_dict(), sites, self.concrete, self.settings.closing)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed trial needs to continue bit for bit (the model only with ``train: all``)."""
        state = {
            "step": self.step,
            "log_alpha": {f"{k[0]}:{k[1]}": v.detach().cpu().clone() for k, v in self.log_alpha.items()},
            "optimizer": self.optimizer.state_dict(),
        }
        if self.settings.train == "all":
            state["model"] = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        with torch.no_grad():
            for key, tensor in self.log_alpha.items():
                tensor.copy_(state["log_alpha"][f"{key[0]}:{key[1]}"].to(tensor.device))
        if "model" in state:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def l0_data_on_worker(worker: Any, data_cfg: Any) -> int:
    """Worker-side check of the ``l0`` experiment (``EvalWorker.run``), before anything is written: the training
    data loads with the run's model and has loss batches; returns their number (0: no training data)."""
    adapter = worker.adapter(data_cfg)
    if not hasattr(adapter, "loss_batches"):
        raise HeadsweepError(f"{type(adapter).__name__}: this model family declares no training loss "
                             "(EvalAdapter.loss_batches), so L0 gates cannot be trained")
    return len(by_group(adapter.loss_batches(None, torch.float32).batches))


# -- Ray Tune ----------------------------------------------------------------------------------
@dataclass
class L0Job:
    """What every trial of a run shares: the model, the training data, how it runs, the ``l0`` settings (the
    config section; each trial trains with its own lambda, and checkpoints every ``settings.checkpoint_every``
    steps, 0: at the end only)."""

    kind: str
    model_cfg: Any
    data_cfg: Any
    runtime: RuntimeOptions
    settings: Any
    report_every: int = 1
    notes: list[str] = field(default_factory=list)
    fill_values: dict = field(default_factory=dict)  # mean ablation's values, as the run stored them


def l0_trainable(config: dict, job: L0Job) -> None:
    """The Tune trainable: train the gates of one lambda (``config["lam"]``), checkpointing as it goes.

    Reports ``loss``, ``task_loss``, ``expected_open``, ``closed``, ``step`` and ``pid`` (the trial's process)
    every ``job.report_every``
    steps; a checkpoint (``l0_state.pt``) every ``checkpoint_every`` steps of the settings and at the end. A trial
    restarted by Tune (``FailureConfig``) continues from its latest checkpoint. With ``train: all`` every
    checkpoint holds the model's state dict (``state["model"]``: its own parameters and buffers, no gates), so a
    restarted trial resumes the fine-tuned weights and the final checkpoint holds the model the run evaluates.
    """
    from ray import tune

    if job.runtime.threads:
        torch.set_num_threads(job.runtime.threads)
    settings = job.settings
    if settings.label_smoothing is None:
        settings = dataclasses.replace(settings, label_smoothing=checkpoint_label_smoothing(job.model_cfg))
    adapter = model_family(job.kind).load(job.model_cfg, job.data_cfg, job.runtime)
    fill = fill_of(job.runtime.ablation, job.fill_values)
    if fill is not None:
        adapter.gates.set_fill(fill)
    trainer = L0Trainer(adapter, settings, float(config["lam"]))
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            trainer.load_state_dict(torch.load(os.path.join(folder, STATE_FILE), weights_only=False))
    if trainer.step >= settings.steps:  # finished before it was restarted
        _report(tune, trainer, None, with_checkpoint=True)
        return
    while trainer.step < settings.steps:
        metrics = trainer.train_step()
        last = trainer.step == settings.steps
        save = last or (settings.checkpoint_every > 0 and trainer.step % settings.checkpoint_every == 0)
        if save or last or trainer.step % max(1, job.report_every) == 0:
            _report(tune, trainer, metrics, with_checkpoint=save)


def _report(tune: Any, trainer: L0Trainer, metrics: StepMetrics | None, with_checkpoint: bool) -> None:
    values = {"step": trainer.step, "expected_open": float(trainer.expected_open().detach()),
              "closed": len(trainer.closed_heads()), "pid": os.getpid()}
    if metrics is not None:
        values.update(loss=metrics.loss, task_loss=metrics.task_loss)
    if not with_checkpoint:
        tune.report(values)
        return
    with tempfile.TemporaryDirectory() as folder:
        torch.save(trainer.state_dict(), os.path.join(folder, STATE_FILE))
        tune.report(values, checkpoint=tune.Checkpoint.from_directory(folder))


def checkpoint_label_smoothing(model_cfg: Any) -> float | None:
    """The label smoothing the model of ``model_cfg`` was trained with, as its family reads it (a fairseq
    checkpoint's stored criterion options), or None: the family's default (0.1 for fairseq)."""
    kind = getattr(model_cfg, "kind", None)
    return model_family(kind).training_label_smoothing(model_cfg) if kind else None


def load_trial_state(checkpoint: Any) -> dict[str, Any]:
    """The trainer state stored in a Tune ``Checkpoint``."""
    with checkpoint.as_directory() as folder:
        return torch.load(os.path.join(folder, STATE_FILE), weights_only=False)


def rows_from_state(state: dict[str, Any], sites: Sequence[tuple[str, int, int]], concrete: HardConcrete,
                    closing: str) -> list[dict]:
    """Gate rows (attention, layer, head, log_alpha, p_open, closed, step) from a stored trainer state.

    ``sites`` lists ``(attention, layer, num_heads)`` of the gated sites, in inventory order.
    """
    rows = []
    for attention, layer, num_heads in sites:
        la = state["log_alpha"][f"{attention}:{layer}"].double()
        p_open = concrete.p_open(la)
        closed = concrete.closed(la, closing)
        for h in range(num_heads):
            rows.append({"attention": attention, "layer": layer, "head": h, "log_alpha": float(la[h]),
                         "p_open": float(p_open[h]), "closed": bool(closed[h]), "step": int(state["step"])})
    return rows
