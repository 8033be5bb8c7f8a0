"""What removing heads buys: parameters, peak memory and throughput, full and pruned side by side.

The full model is the stock model (gates taken off, fairseq's fused attention path back on);
the pruned model is the same with the mask's heads physically removed
(:mod:`headsweep.workers.pruning.removal`). Both run the same batch of the evaluation set at each batch
size: the ``b`` examples around the median length (the adapter's own length-sorted batching,
cycled when the set has fewer than ``b`` examples), as the adapter's ``workload`` runs them
(``headsweep.workers.core.family.EvalAdapter``): a classifier runs one forward pass, a translation
model its configured beam search. Timing interleaves the two models
(``warmup`` untimed runs of each, then ``repeats`` rounds of full-then-pruned), so drift in
machine load hits both alike; medians and spreads are over the repeats.

Peak memory is the bytes of the model's parameters and buffers plus the most bytes the run
holds in tensors at once: on CUDA from the allocator's peak statistics, on CPU from the
allocation events of torch's profiler (measured in one extra, untimed run).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import EvalAdapter, ModelFamily, Workload
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import model_family
from headsweep.workers.pruning.removal import as_stock, count_parameters, prune_heads, ungated_copy

MB = 2**20


@dataclass
class Timing:
    """One model at one batch size: its size, peak memory and the seconds of each timed repeat."""

    variant: str
    batch_size: int
    n_params: int
    n_heads: int
    peak_memory_mb: float | None
    seconds: list[float]
    examples: int
    tokens: int


def adapter_workload(adapter: EvalAdapter, batch_size: int, max_length: int = 128) -> Workload:
    """The workload an adapter declares (``EvalAdapter.workload``) at one batch size."""
    if not hasattr(adapter, "workload"):
        raise HeadsweepError(f"{type(adapter).__name__}: this model family declares no workload "
                             "(EvalAdapter.workload), so the efficiency experiment cannot time it")
    return adapter.workload(batch_size, max_length)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    # torch's profiler (kineto) writes start/stop lines to file descriptor 2 that no setting turns off.
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_peak_bytes(run: Callable[[], object]) -> int | None:
    """Most bytes held in CPU tensors at once during ``run``, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except (AttributeError, RuntimeError):  # a torch without these profiler internals: no figure, no crash
        return None
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def peak_memory_mb(model: nn.Module, workload: Workload, device: torch.device) -> float | None:
    """Parameters and buffers plus the peak of tensors allocated while running ``workload`` once."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        workload.run(model)
        _sync(device)
        extra = torch.cuda.max_memory_allocated(device) - base
    else:
        extra = _cpu_peak_bytes(lambda: workload.run(model))
        if extra is None:
            return None
    return (weights + extra) / MB


def time_side_by_side(models: dict[str, nn.Module], workload: Workload, warmup: int, repeats: int,
                      device: torch.device) -> dict[str, list[float]]:
    """Seconds per run of each model, interleaved: ``warmup`` untimed runs each, then ``repeats`` rounds."""
    for model in models.values():
        for _ in range(warmup):
            workload.run(model)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            _sync(device)
            start = time.perf_counter()
            workload.run(model)
            _sync(device)
            seconds[name].append(time.perf_counter() - start)
    return seconds


@torch.inference_mode()
def measure(models: dict[str, nn.Module], heads: dict[str, int], workloads: Callable[[int], Workload],
            batch_sizes: Sequence[int], warmup: int, repeats: int, device: torch.device) -> list[Timing]:
    """Time and size every model at every batch size; ``heads[name]`` is the model's head count."""
    out = []
    for b in batch_sizes:
        workload = workloads(b)
        seconds = time_side_by_side(models, workload, warmup, repeats, device)
        for name, model in models.items():
            out.append(Timing(name, b, count_parameters(model), heads[name], peak_memory_mb(model, workload, device),
                              seconds[name], workload.examples, workload.tokens))
    return out


def summary(timings: Sequence[Timing]) -> list[dict]:
    """One row per model and batch size: medians and spreads, and the speedup over the full model."""
    full = {t.batch_size: float(np.median(t.seconds)) for t in timings if t.variant == "full"}
    rows = []
    for t in timings:
        s = np.asarray(t.seconds)
        examples_per_s, tokens_per_s = t.examples / s, t.tokens / s
        median = float(np.median(s))
        rows.append({
            "variant": t.variant, "batch_size": t.batch_size, "n_params": t.n_params, "n_heads": t.n_heads,
            "peak_memory_mb": t.peak_memory_mb, "examples": t.examples, "tokens": t.tokens, "repeats": len(s),
            "seconds_median": median, "seconds_min": float(s.min()), "seconds_max": float(s.max()),
            "examples_per_s": float(np.median(examples_per_s)), "examples_per_s_iqr": _iqr(examples_per_s),
            "tokens_per_s": float(np.median(tokens_per_s)), "tokens_per_s_iqr": _iqr(tokens_per_s),
            "speedup": full[t.batch_size] / median if t.batch_size in full else None,
        })
    return rows


def _iqr(values: np.ndarray) -> float:
    q1, q3 = np.percentile(values, [25, 75])
    return float(q3 - q1)


@contextlib.contextmanager
def full_and_pruned(model: nn.Module, gates, mask: Sequence[Head],
                    family: ModelFamily | None = None) -> Iterator[dict[str, nn.Module]]:
    """While active: the stock model (``model`` itself, its gates off:
    :func:`~headsweep.workers.pruning.removal.as_stock`)
    and a copy with ``mask``'s heads removed; the gated original is as it was once it ends.

    One copy of the weights beside the model, not two (the pruned one, which a copy of the whole model becomes
    while its heads are cut). ``family`` prunes the copy (default: the built-in family the model belongs to).
    """
    pruned = ungated_copy(model, gates)
    prune_heads(pruned, mask, family)
    with as_stock(model, gates) as full:
        yield {"full": full, "pruned": pruned}


def measure_task(adapter: EvalAdapter, mask: Sequence[Head], batch_sizes: Sequence[int], warmup: int, repeats: int,
                 max_length: int = 128, family: ModelFamily | None = None) -> list[dict]:
    """The efficiency rows of an adapter's model for one mask (see :func:`summary`), plus the device."""
    total = len(adapter.gates.inventory.heads)
    heads = {"full": total, "pruned": total - len(set(mask))}
    with full_and_pruned(adapter.model, adapter.gates, mask, family) as models:
        timings = measure(models, heads, lambda b: adapter_workload(adapter, b, max_length), batch_sizes, warmup,
                          repeats, adapter.device)
    if adapter.device.type == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(adapter.device)})"
    else:
        device = f"cpu ({torch.get_num_threads()} thread(s))"
    return [{**row, "device": device, "warmup": warmup} for row in summary(timings)]


def efficiency_on_worker(worker, mask: Sequence[Head], settings) -> list[dict]:
    """Worker-side step of the ``efficiency`` experiment (``EvalWorker.run``): the full and the pruned
    model timed side by side; ``settings`` is the config's ``efficiency`` section."""
    max_length = getattr(worker.data_cfg, "max_length", 128)
    return measure_task(worker.adapter(), mask, settings.batch_sizes, settings.warmup, settings.repeats, max_length,
                        family=model_family(worker.kind))
