"""Workers kept warm between runs on a running cluster (``headsweep run --address ... --keep-workers SECONDS``).

A worker's process spends seconds importing torch and transformers before its model loads; a run on a cluster
that is already up may keep its workers when it ends, and the next run with workers of the same shape takes them
over instead of starting new ones. Each is a detached Ray actor in the namespace :data:`NAMESPACE`, named by its
shape (what it asks of the cluster and how Ray restarts it) and a random suffix. What a warm worker keeps and what
it never carries over is said in :mod:`headsweep.workers.actor.warm`.

A run claims the idle workers of its shape (one run at a time holds a worker), starts what it lacks, and ends every
other idle warm worker (another shape's, or one more than it needs: claimed first, so that no run takes it
meanwhile), so that workers kept idle never hold resources a run is waiting for. A run that ends normally, or is
refused after its workers loaded, lets its workers go idle; one that fails or is interrupted ends them (a call may
still be running in them)."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from headsweep.errors import HeadsweepError
from headsweep.workers.actor import warm
from headsweep.workers.actor.eval_worker import EvalWorker

NAMESPACE = "headsweep-warm"
# How long a claim may take: it answers on its own thread, even while the worker evaluates.
CLAIM_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Shape:
    """What makes two workers interchangeable between runs: their Ray resources and restarts."""

    cpus: float
    gpus: float
    restarts: int

    def prefix(self) -> str:
        digest = hashlib.sha256(f"{self.cpus:g}/{self.gpus:g}/{self.restarts}".encode()).hexdigest()[:12]
        return f"worker-{digest}-"


def owner() -> tuple[str, str]:
    """This driver as a warm worker's holder: ``(pid@host, Ray job id)`` (the job tells the worker when the driver
    is gone)."""
    import socket

    return f"{os.getpid()}@{socket.gethostname()}", ray.get_runtime_context().get_job_id()


def take_workers(n: int, shape: Shape, setup: list[tuple], keep_s: float) -> tuple[list[Any], int]:
    """``n`` workers of ``shape``, each configured with its ``setup`` (what ``EvalWorker.configure`` takes): idle
    warm ones claimed first, the rest started (held by this driver from their start). Every other idle warm worker
    is ended. Returns the actors and how many were warm."""
    me = owner()
    names = sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                   if entry.get("namespace") == NAMESPACE)
    taken: list[Any] = []
    for name in names:
        actor = _claimed(name, me, keep_s)
        if actor is None:
            continue
        if name.startswith(shape.prefix()) and len(taken) < n:
            taken.append(actor)
        else:
            ray.kill(actor, no_restart=True)
    for actor, args in zip(taken, setup, strict=False):
        actor.configure.remote(*args)
    warm_count = len(taken)
    for args in setup[warm_count:]:
        # a name no other run can pick: a new worker is never another run's
        taken.append(EvalWorker.options(
            name=f"{shape.prefix()}{uuid.uuid4().hex[:12]}", namespace=NAMESPACE, lifetime="detached",
            num_cpus=shape.cpus, num_gpus=shape.gpus, max_restarts=shape.restarts, max_task_retries=0,
        ).remote(*args, lease=(me, keep_s)))
    return taken, warm_count


def release(actors: list[Any]) -> list[str]:
    """Let the run's workers go idle (their models dropped); returns their last warnings. A worker that does not
    answer is ended."""
    lines: list[str] = []
    calls = {a: a.release.remote() for a in actors}
    for actor, call in calls.items():
        try:
            ray.get(call, timeout=CLAIM_TIMEOUT_S)
            lines += ray.get(actor.notes.remote(), timeout=CLAIM_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            ray.kill(actor, no_restart=True)
    return lines


def notes(actors: list[Any]) -> list[str]:
    """The warm workers' warnings since last asked (each answers on its own thread)."""
    lines: list[str] = []
    for actor in actors:
        try:
            lines += ray.get(actor.notes.remote(), timeout=CLAIM_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            continue
    return lines


def _claimed(name: str, me: tuple[str, str], keep_s: float) -> Any | None:
    """The warm worker ``name``, now held by ``me``; None if another run holds it or it ended."""
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # ended since it was listed
        return None
    return actor if _answer(actor, me, keep_s) == warm.CLAIMED else None


def _answer(actor: Any, me: tuple[str, str], keep_s: float) -> str:
    """The worker's answer to a claim; ``stale`` for one that ended meanwhile or does not answer."""
    try:
        return ray.get(actor.claim.remote(me, keep_s), timeout=CLAIM_TIMEOUT_S)
    except (RayActorError, GetTimeoutError):
        return warm.STALE
    except ray.exceptions.RayTaskError as exc:
        raise HeadsweepError(f"a warm worker ({actor}) failed to answer a claim: {str(exc).splitlines()[0]}") from None
