"""Placement: can the cluster hold the workers a config asks for, and still run everything else?

Ray queues an actor whose resources no node has, silently and forever. A sweep that would
wait for GPUs that do not exist, or whose workers would hold every CPU (starving Ray's own
tasks and the significance tests), is stopped here with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.sections import Config

# Logical CPUs left free beside the workers: significance tasks ask 0.5 CPU each.
CPU_HEADROOM = 0.5


@dataclass(frozen=True)
class NodeResources:
    """What one alive Ray node offers (logical resources)."""

    cpus: float
    gpus: float


def alive_nodes() -> list[NodeResources]:
    """The alive nodes of the connected cluster and their total CPUs and GPUs."""
    return [
        NodeResources(float(n["Resources"].get("CPU", 0.0)), float(n["Resources"].get("GPU", 0.0)))
        for n in ray.nodes()
        if n.get("Alive")
    ]


@dataclass(frozen=True)
class WorkerAsk:
    """What each worker asks of the cluster (``sweep.num_cpus_per_worker``, ``sweep.num_gpus_per_worker``)."""

    cpus: float
    gpus: float

    def fits_now(self) -> bool:
        """Whether the cluster has what one more worker asks free now (else workers not placed wait for it)."""
        free = ray.available_resources()
        return free.get("CPU", 0.0) >= self.cpus and (self.gpus <= 0 or free.get("GPU", 0.0) >= self.gpus)

    def describe(self) -> str:
        """``each worker asks 1 CPU and 0 GPU; the cluster has 2.5 CPUs and 0 GPUs free``."""
        free = ray.available_resources()
        return (f"each worker asks {self.cpus:g} CPU and {self.gpus:g} GPU; the cluster has "
                f"{_count(free.get('CPU', 0.0), 'CPU')} and {_count(free.get('GPU', 0.0), 'GPU')} free")


def _count(n: float, what: str) -> str:
    """``1 CPU``, ``2.5 CPUs``, ``0 GPUs``."""
    return f"{n:g} {what}" + ("" if n == 1 else "s")


def workers_per_node(node: NodeResources, cpus: float, gpus: float) -> int:
    """How many workers asking ``cpus`` and ``gpus`` fit on ``node``."""
    fits = int(node.cpus // cpus) if cpus > 0 else 10**9
    if gpus > 0:
        fits = min(fits, int(node.gpus // gpus + 1e-9))
    return fits


def check_threads(cfg: Config, cpus: float, where: str) -> None:
    """Refuse ``sweep.threads_per_worker`` above ``cpus``, the CPUs of the machine a worker runs on (``where`` says
    which): threads past them only contend (5,000 on 2 CPUs started about 10,000 threads and ran 2.8x slower)."""
    threads = cfg.sweep.threads_per_worker
    if threads > cpus:
        raise HeadsweepError(
            f"sweep.threads_per_worker={threads} is more than the {cpus:g} CPUs {where}: use at most {cpus:g} (or 0, "
            "the CPUs shared out among the workers)"
        )


def check_placement(cfg: Config, nodes: list[NodeResources]) -> None:
    """Raise a one-line error when ``nodes`` cannot run the sweep's workers as configured.

    With ``sweep.wait_for_resources`` (an autoscaling cluster that adds GPU nodes on demand)
    missing capacity is not an error: the workers start as nodes arrive, and
    ``sweep.placement_timeout_s`` bounds the wait.
    """
    s = cfg.sweep
    if nodes:
        check_threads(cfg, max(n.cpus for n in nodes), "of the Ray cluster's largest node")
    total_cpus = sum(n.cpus for n in nodes)
    total_gpus = sum(n.gpus for n in nodes)
    want_cpus = s.workers * s.num_cpus_per_worker
    if want_cpus > total_cpus - CPU_HEADROOM and not s.wait_for_resources:
        fit = int((total_cpus - CPU_HEADROOM) // s.num_cpus_per_worker)
        fewer = f"sweep.workers={fit}" if fit >= 1 else "fewer workers"
        raise HeadsweepError(
            f"sweep.workers x sweep.num_cpus_per_worker = {s.workers} x {s.num_cpus_per_worker:g} CPUs would hold "
            f"{'more than ' if want_cpus > total_cpus else ''}all {total_cpus:g} CPUs of the Ray cluster; leave at "
            f"least {CPU_HEADROOM:g} free for Ray's own tasks and the significance tests ({fewer} or a "
            "smaller sweep.num_cpus_per_worker)"
        )
    if s.num_gpus_per_worker <= 0 or s.wait_for_resources:
        return
    if total_gpus == 0:
        raise HeadsweepError(
            f"sweep.num_gpus_per_worker={s.num_gpus_per_worker:g} but the Ray cluster has no GPUs; to run this "
            "config on CPU add sweep.device=cpu sweep.num_gpus_per_worker=0 (or sweep.wait_for_resources=true "
            "on a cluster that adds GPU nodes on demand)"
        )
    fit = sum(workers_per_node(n, s.num_cpus_per_worker, s.num_gpus_per_worker) for n in nodes)
    if fit < s.workers:
        raise HeadsweepError(
            f"the Ray cluster fits {fit} of the {s.workers} workers asking {s.num_cpus_per_worker:g} CPU and "
            f"{s.num_gpus_per_worker:g} GPU each (it has {total_gpus:g} GPUs, {total_cpus:g} CPUs); use "
            f"sweep.workers={max(fit, 1)}, a fraction of a GPU per worker, or sweep.wait_for_resources=true"
        )
