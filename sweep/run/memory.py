"""Refusing a run whose workers cannot hold the model, before any of them loads it.

Every worker holds its own copy of the model, so a model that fits the machine once may not fit it
``sweep.workers`` times; without this check the machine swaps, or the kernel kills workers mid-load, minutes
into the run. The driver asks the model family what the weights take once loaded (``ModelFamily.weight_bytes``:
a transformers folder's tensors at ``model.dtype``, a fairseq checkpoint's file size), from the files alone,
before Ray starts.

What one worker is counted to need (``Need``):

* the weights, in ``model.dtype`` (the largest model of the run, where it sweeps training checkpoints);
* on a CPU, the activation budget of one forward pass (``batch_budget.CPU_ACTIVATION_BYTES``, 1 GiB): packing
  fills a pass with masks up to it. With several threads a pass may grow past it to reach 1,024 tokens a thread,
  within a share of the memory available when it runs (``batch_budget.cpu_pass_room``), which fits by construction
  as the GPU's budgets do. On a GPU the packing and reuse budgets are fractions of the GPU memory left
  free once the model is loaded, so they fit by construction; the GPU is checked for the weights alone.

* once, where the run has the ``efficiency`` experiment, one more copy of the weights: the worker that times it
  holds the pruned model beside its own (the full model is its own, gates off: ``workers.pruning.removal.as_stock``).

What it is not counted to need, and why:

* reuse states (``sweep.reuse``): each worker caps them at a quarter of the memory free when it loads (at most
  4 GiB on a CPU) and recomputes, once per call, the states that do not fit: they shrink to what is there.
* gradient importance: its backward pass is held to the same activation budget, not counted beside it (a worker
  runs one or the other). The transformers families cut its loss batches to the budget and checkpoint the blocks,
  so the backward pass keeps each layer's input and one block's activations (headsweep.workers.memory.backward_memory);
  on Qwen2.5-0.5B's shape its peak went from 6.6 to 3.0 GiB (weights 1.84 GiB). Not so held: fairseq translation
  (loss batches sized by ``sweep.max_tokens``), relevance propagation (``lrp``), importance under a per-example
  fill (resample ablation, activation patching) and L0 training (its pieces are not checkpointed), which keep
  every layer of a loss batch (or piece).
* adapters on other data (``importance.data``, relevance, roles): they run the model the worker holds
  (``workers.memory.model_sharing``), so they add their data, not weights.
* the worker process itself: Ray, torch and transformers imported take about 0.3 GiB (VmRSS measured with torch
  2.13 and transformers 5.23), small beside the weights of the models this check is for.

The number of workers a refusal recommends is also held to what the machine's CPUs run at once (``machine_cpus``
over ``sweep.num_cpus_per_worker``): memory for 18 workers on a 2-CPU machine is no reason to start 18, which load
their models in turn and run no faster than 2.

The memory compared with is ``MemAvailable`` (free memory and what the kernel can reclaim), capped by
``sweep.memory_limit_gib`` (a user's share of a shared box); for ``sweep.device=cuda`` also each visible GPU's
free memory as ``nvidia-smi`` reports it (the driver imports no torch: initialising CUDA here would hold GPU
memory for the whole run). Checked on an embedded local Ray instance only: on a cluster (``--address``) the
workers run on other machines, whose memory this one does not see.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster.ray_session import resolve_device
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.registry import declaring
from headsweep.workers.families.registry import model_family
from headsweep.workers.memory.batch_budget import CPU_ACTIVATION_BYTES, host_available, machine_cpus

GIB = 1 << 30
# model.dtype values whose weights bfloat16 halves (or quarters).
WIDE_DTYPES = ("float32", "float", "float64", "double")


@dataclass(frozen=True)
class Need:
    """What one worker needs: the model's weights and the activation budget beside them (bytes); ``bfloat16``: the
    weights in bfloat16, where ``model.dtype`` is wider (None: no such option)."""

    weights: int
    activations: int
    bfloat16: int | None = None
    pruned_copy: bool = False  # the efficiency experiment: one worker holds one more copy of the weights

    @property
    def per_worker(self) -> int:
        return self.weights + self.activations

    def total(self, workers: int, weights: int | None = None) -> int:
        """What ``workers`` workers need in all (with ``weights`` in place of the run's, e.g. bfloat16's)."""
        w = self.weights if weights is None else weights
        return workers * (w + self.activations) + (w if self.pruned_copy else 0)

    def fit(self, have: int, weights: int | None = None) -> int:
        """How many workers fit in ``have`` bytes."""
        w = self.weights if weights is None else weights
        return max(0, (have - (w if self.pruned_copy else 0)) // (w + self.activations))


def check_memory(cfg: Config, models: Sequence[Any], address: str | None) -> None:
    """Refuse, in one line, a run whose ``sweep.workers`` workers cannot hold the largest of ``models`` (the run's
    model sections) with their budgets in the memory this machine has for them. Nothing is checked on a cluster
    (``address``), nor for a model family that cannot size its weights."""
    if address:
        return
    family = model_family(cfg.model.kind)
    weights, model = max(((family.weight_bytes(m) or 0, m) for m in models), key=lambda sized: sized[0])
    if not weights:
        return
    device = resolve_device(cfg)
    half = None
    if getattr(model, "dtype", None) in WIDE_DTYPES:
        half = family.weight_bytes(dataclasses.replace(model, dtype="bfloat16"))
    pruned_copy = any(k in cfg.sweep.experiments for k in declaring("pruned_copy"))
    check_host(cfg, Need(weights, CPU_ACTIVATION_BYTES if device == "cpu" else 0, half, pruned_copy), model)
    if device == "cuda":
        check_gpus(cfg, weights, model, gpu_free_bytes())


def check_host(cfg: Config, need: Need, model: Any) -> None:
    """The workers' need against the machine's available memory, capped by ``sweep.memory_limit_gib``."""
    s = cfg.sweep
    available = host_available()
    limit = None if s.memory_limit_gib is None else int(s.memory_limit_gib * GIB)
    known = [x for x in (available, limit) if x is not None]
    if not known or need.total(s.workers) <= min(known):
        return
    have = min(known)
    source = "MemAvailable"
    if have == limit:
        source = "sweep.memory_limit_gib" + (f"; the machine has {gib(available)} available" if available else "")
    parts = "the weights"
    if need.activations:
        parts += f" and the {gib(need.activations)} activation budget of a forward pass"
    copy = " with the efficiency experiment's pruned copy of the weights" if need.pruned_copy else ""
    fixes = remedies(need, s.workers, have, limited=limit is not None, cpus=machine_cpus(),
                     cpus_per_worker=s.num_cpus_per_worker)
    raise HeadsweepError(
        f"{workers(s.workers)} cannot hold this model: its weights take {gib(need.weights)}{dtype_note(model)}, each "
        f"worker needs about {gib(need.per_worker)} ({parts}), {gib(need.total(s.workers))} in all{copy}, and "
        f"{gib(have)} is available ({source}): {fixes}"
    )


def remedies(need: Need, asked: int, have: int, limited: bool, cpus: int | None = None,
             cpus_per_worker: float = 1.0) -> str:
    """What to change so that the workers fit in ``have`` bytes: fewer workers (as many as fit, and no more than
    ``cpus`` CPUs run at once at ``cpus_per_worker`` each), bfloat16 weights (where more workers fit so), more
    memory (``limited``: a larger ``sweep.memory_limit_gib``)."""
    options = []
    in_memory = need.fit(have)
    runs = max(1, math.floor(cpus / cpus_per_worker + 1e-9)) if cpus else asked
    fit = min(in_memory, runs)
    if 1 <= fit < asked:
        why = f" (what the machine's {cpus} CPUs run at once; {in_memory} fit in memory)" if fit < in_memory else ""
        options.append(f"sweep.workers={fit}{why}")
    if need.bfloat16 is not None:
        fit_half = min(asked, runs, need.fit(have, need.bfloat16))
        if fit_half > fit:
            fewer = f" with sweep.workers={fit_half}" if fit_half < asked else ""
            options.append(f"model.dtype: bfloat16{fewer} (weights {gib(need.bfloat16)})")
    options.append(("a larger sweep.memory_limit_gib or " if limited else "") + "a machine with more memory")
    return "use " + ", or ".join(options)


def check_gpus(cfg: Config, weights: int, model: Any, free: list[int] | None) -> None:
    """The weights of the workers that share one GPU (``sweep.num_gpus_per_worker`` below 1) against the freest
    visible GPU (``free``: bytes per GPU; None: unknown, nothing checked)."""
    if not free:
        return
    s = cfg.sweep
    share = 1 if s.num_gpus_per_worker >= 1 else min(s.workers, max(1, math.floor(1 / s.num_gpus_per_worker + 1e-9)))
    if share * weights <= max(free):
        return
    half = ", model.dtype: bfloat16" if getattr(model, "dtype", None) in WIDE_DTYPES else ""
    raise HeadsweepError(
        f"{workers(share)} per GPU (sweep.num_gpus_per_worker={s.num_gpus_per_worker:g}) cannot hold this model: "
        f"its weights take {gib(weights)}{dtype_note(model)} per worker, and the freest GPU has {gib(max(free))} "
        f"free (nvidia-smi): use a larger sweep.num_gpus_per_worker (fewer workers per GPU){half}, or GPUs with more "
        "memory"
    )


def gpu_free_bytes(query: str | None = None) -> list[int] | None:
    """Free memory (bytes) of each GPU that ``CUDA_VISIBLE_DEVICES`` leaves visible, from ``nvidia-smi``; None when
    there is no ``nvidia-smi`` or it fails. ``query``: its CSV output (``index, uuid, memory.free`` in MiB),
    read here when None."""
    if query is None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            query = subprocess.run([smi, "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=20, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    gpus = {}
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            gpus[(parts[0], parts[1])] = int(parts[2]) << 20
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(gpus.values())
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    # Indices or UUIDs (``GPU-...``, or a unique prefix of one), as CUDA reads them.
    return [free for (index, uuid), free in gpus.items() if any(w == index or uuid.startswith(w) for w in wanted)]


def gib(n: int) -> str:
    """``4.61 GiB``; below a hundredth of a GiB in MiB (a test's tiny model: ``0.07 MiB``)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / (1 << 20):.2f} MiB"


def workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def dtype_note(model: Any) -> str:
    """`` in float32 (model.dtype)`` for a family with a ``model.dtype``, else nothing."""
    dtype = getattr(model, "dtype", None)
    return f" in {dtype} (model.dtype)" if dtype else ""
