"""Memory budgets: rows per forward pass when ``sweep.masks_per_batch`` is 0, and room for reuse caches.

Automatic mask batching fills one forward pass with as many (example x mask) rows as an
activation budget allows, from an estimate of the bytes one row needs at the widest point of
a layer (each adapter estimates its own: hidden size x sequence length x dtype size and the
attention scores for classifiers; beams x layers x cached keys/values for beam search):

* GPU: ``DEVICE_ACTIVATION_FRACTION`` of the device's free memory when the adapter asks;
* CPU: ``CPU_ACTIVATION_BYTES``. Matrix products keep CPU cores busy from a few hundred rows
  on, so this only bounds memory; what packing buys on a CPU is mostly fewer passes through
  per-call and per-step Python overhead (beam search: measured about 1.2x for 8 masks of 64
  sentences against one at a time, 6+6-layer model, d=128). A dense forward pass (every
  position of every row at once: the transformers families) is also kept within
  ``CPU_PASS_BYTES`` on a CPU: past a few tens of MiB its tensors leave the caches and each
  token costs more (one thread, per token: a 4-layer Llama of width 128, 37 us at 1k tokens a
  pass and 43 at 16k; a 6-layer BERT of width 64, 11.4 us at 10 MiB and 20.2 at 160 MiB; prefix
  reuse on the lm-eval grid, 8.0 s packed 23-26 masks a pass against 6.0 s one a pass). Beam
  search's estimate is the state it keeps across steps, not one step's working set, so it is
  not capped.

  With several threads a dense pass may hold up to ``CPU_TOKENS_PER_THREAD`` tokens a thread where
  the caller says how many tokens a row has: torch splits a matrix product between threads by rows,
  so each thread's share stays a large product (two threads, a bare ``linear`` of 576 x 1,536 up to
  2,048 x 128,256: 5-10% more GFLOP/s at 2,048 rows than at 512; the default route of a
  Qwen2.5-0.5B grid 2.8-5.5% faster at four masks a pass than at one: bench/README.md).
  One row of a real LM is tens to hundreds of MB (its logits), so ``CPU_PASS_BYTES`` holds one
  mask; this floor is bounded by memory instead: ``CPU_PASS_ROOM_FRACTION`` of the machine's
  available memory, times this process's share of the cores (workers sharing a host each take
  their part), capped at ``CPU_PASS_ROOM_CAP_BYTES``.

Sizes are estimated per batch (its own padded length), so batches of short sentences carry
more masks than batches of long ones.

Prefix/encoder reuse keeps baseline states (layer inputs, per-head contexts, encoder outputs)
between calls while they fit ``cache_budget``: ``CACHE_FRACTION`` of free GPU memory, or of
the machine's available memory capped at ``CPU_CACHE_CAP_BYTES``. States that do not fit are
recomputed once per call instead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver reads the budgets (sweep/run/memory.py): keep torch out of its import time
    import torch

MIB = 1 << 20
CPU_ACTIVATION_BYTES = 1024 * MIB
CPU_PASS_BYTES = 32 * MIB
CPU_TOKENS_PER_THREAD = 1024
CPU_PASS_ROOM_FRACTION = 0.5
CPU_PASS_ROOM_CAP_BYTES = 4096 * MIB
DEVICE_ACTIVATION_FRACTION = 0.5
CACHE_FRACTION = 0.25
CPU_CACHE_CAP_BYTES = 4096 * MIB


def free_memory(device: torch.device) -> int | None:
    """Free bytes on ``device``: the GPU's free memory, or the machine's available memory for CPUs."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available()


def host_available() -> int | None:
    """The machine's available memory in bytes (``MemAvailable``: free memory plus what the kernel can reclaim)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s share), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def activation_budget(device: torch.device) -> int:
    """Bytes of activations one forward pass may take."""
    if device.type == "cpu":
        return CPU_ACTIVATION_BYTES
    free = free_memory(device)
    return int(free * DEVICE_ACTIVATION_FRACTION) if free else CPU_ACTIVATION_BYTES


def cache_budget(device: torch.device) -> int:
    """Bytes of baseline states that reuse may keep between calls."""
    free = free_memory(device) or 0
    budget = int(free * CACHE_FRACTION)
    return min(budget, CPU_CACHE_CAP_BYTES) if device.type == "cpu" else budget


def rows_per_forward(bytes_per_row: int, device: torch.device) -> int:
    """How many rows of ``bytes_per_row`` activation bytes fit one forward pass (at least 1)."""
    return max(1, activation_budget(device) // max(1, int(bytes_per_row)))


def cpu_threads() -> int:
    """The threads torch's CPU products run on in this process."""
    import torch

    return torch.get_num_threads()


def cpu_pass_room(threads: int) -> int:
    """Bytes a dense CPU pass of ``threads`` threads may take to reach ``CPU_TOKENS_PER_THREAD`` tokens a thread:
    ``CPU_PASS_ROOM_FRACTION`` of the available memory times ``threads`` over the cores this process may run on,
    at most ``CPU_PASS_ROOM_CAP_BYTES``."""
    share = min(1.0, threads / machine_cpus())
    return min(CPU_PASS_ROOM_CAP_BYTES, int((host_available() or 0) * CPU_PASS_ROOM_FRACTION * share))


def masks_per_forward(masks_per_batch: int, batch_size: int, bytes_per_row: int, device: torch.device,
                      dense: bool = True, tokens_per_row: int = 0) -> int:
    """``masks_per_batch`` when set, else as many copies of a ``batch_size`` batch as the budget holds.

    ``dense``: ``bytes_per_row`` is what one pass works through at once, so on a CPU the pass is also kept
    within ``CPU_PASS_BYTES`` (module docstring); False for an estimate of state kept across steps.
    ``tokens_per_row``: the positions a row's pass computes (0: not known); with several CPU threads a dense
    pass may then grow to ``CPU_TOKENS_PER_THREAD`` tokens a thread within :func:`cpu_pass_room`.
    """
    if masks_per_batch > 0:
        return masks_per_batch
    batch = max(1, batch_size)
    row_bytes = max(1, int(bytes_per_row))
    per = rows_per_forward(row_bytes, device) // batch
    if dense and device.type == "cpu":
        per = min(per, CPU_PASS_BYTES // (row_bytes * batch))
        threads = cpu_threads() if tokens_per_row > 0 else 1
        if threads > 1:
            wanted = threads * CPU_TOKENS_PER_THREAD // (tokens_per_row * batch)
            per = max(per, min(wanted, cpu_pass_room(threads) // (row_bytes * batch)))
    return max(1, per)
