"""The worker pool: streams batches of work units to actors and survives losing some of them.

Ray's documented pattern for stateful inference: a fixed pool of actors that each hold the
model, a small window of calls in flight per actor, and ``ray.wait`` to take results in the
order they finish, so results are written while the grid runs and the driver's memory does not
grow with the grid.

Balance: call slots are handed out round-robin over the workers, and each call's batch is cut
from the queue only when a slot frees up: ``per_call`` units while the queue is long, then
smaller (``batch_size``) so that the end of every phase is shared by all workers instead of
queueing behind the first one.

Fault tolerance: actors are created with ``max_restarts``, so Ray restarts a worker whose
process or node dies; the calls it had in flight fail with ``RayActorError`` (or, for a result
that finished on a node lost before the driver fetched it, ``ObjectLostError``) and their units
go back to the front of the queue, preferably to another worker. The other workers go on while
Ray restarts the lost one (its process started again: seconds; its node lost: Ray places it on
another, and until then it answers ``ActorUnavailableError``); once it answers, within
``restart_wait_s``, it loads its model, then gets its calls back; a phase ends once no worker is
being restarted. Only a worker Ray gave up on (no restarts left), or one not back in time, is
gone for good. A batch is retried at most ``max_retries`` times; after that, or when every
worker is gone for good, the sweep stops with an error that names the evaluations (those
already stored stay, and a rerun resumes).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError

from headsweep.errors import HeadsweepError
from headsweep.workers.core.work import WorkUnit

CALLS_IN_FLIGHT_PER_WORKER = 2
# Work units per call when sweep.masks_per_batch is 0: enough to share a forward pass (and, with
# reuse, a cached prefix) between masks, few enough that a lost worker costs little.
DEFAULT_UNITS_PER_CALL = 8
# How long a lost worker may take to come back (Ray restarts it) before it is given up.
RESTART_WAIT_S = 120.0
# How often a restarting worker is asked whether it is back.
RESTART_POLL_S = 0.2
# A call's failures that mean its worker (or the node holding its result) was lost, not that the work failed.
LOST = (RayActorError, ObjectLostError)


def log(message: str) -> None:
    """One of the driver's status lines on stderr (above the live progress line; see
    ``headsweep.sweep.output.console``)."""
    from headsweep.sweep.output.console import say

    say(message)


def unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause of a Ray error (our HeadsweepError where there is one)."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if cause is not None:
            return cause
    return exc


def get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` with our own errors unwrapped from Ray's task error."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as exc:
        cause = unwrap(exc)
        if isinstance(cause, HeadsweepError):
            raise cause from None
        raise


def units_per_call(masks_per_batch: int) -> int:
    """Work units in one actor call: ``sweep.masks_per_batch``, or ``DEFAULT_UNITS_PER_CALL`` when it is 0."""
    return max(1, int(masks_per_batch) or DEFAULT_UNITS_PER_CALL)


def batch_size(remaining: int, per_call: int, live: int, calls_in_flight: int) -> int:
    """Units in the next call when ``remaining`` units are still unsent.

    ``per_call`` while the queue can fill every call slot (``live`` workers x ``calls_in_flight``)
    with full calls, so masks keep sharing forward passes; then the queue's fair share per slot,
    ``ceil(remaining / (live x calls_in_flight))``, never below one, so that the last calls are
    spread over every worker instead of queueing on the first. One worker has no one to share
    with: it takes ``per_call`` (or what is left).
    """
    per_call = min(max(1, per_call), remaining)
    if live <= 1:
        return max(1, per_call)
    share = -(-remaining // (live * max(1, calls_in_flight)))
    return max(1, min(per_call, share))


def name_units(units: Sequence[WorkUnit], limit: int = 8) -> str:
    names = ", ".join(u.eval_id for u in units[:limit])
    return names + (f" and {len(units) - limit} more" if len(units) > limit else "")


def loaded(worker: Any, retake: tuple | None = None) -> str:
    """On a worker Ray restarted (through ``EvalWorker.run``): its model and data loaded again; its name.
    ``retake``: ``(owner, setup)`` of a warm worker (``EvalWorker.retake``), which Ray started again with the
    arguments of the run that first started it."""
    if retake is not None:
        worker.retake(*retake)
    worker.adapter()
    return worker.where()


@dataclass
class Restart:
    """A lost worker that Ray is restarting: asked its name (``where``) until it answers or ``deadline`` passes, then
    made to load its model (``loading``) before it takes work again."""

    worker: int
    actor: Any
    lost_as: str  # its name before
    deadline: float  # time.monotonic()
    asked: Any = None  # the call in flight, if any: ``where``, or ``loaded`` once it answered
    ask_at: float = 0.0  # when to ask again, after an answer that it is not back yet
    loading: bool = False

    def ask(self) -> Any | None:
        """The call in flight, ``where`` sent now if none is and it is time; None until then."""
        if self.asked is None and time.monotonic() >= self.ask_at:
            self.asked = self.actor.where.remote()
        return self.asked


@dataclass
class WorkerPool:
    """Actors that each hold one model copy, with what the driver knows about each."""

    actors: list
    names: list[str]
    max_retries: int = 2
    calls_in_flight: int = CALLS_IN_FLIGHT_PER_WORKER
    restart_wait_s: float = RESTART_WAIT_S
    alive: list[bool] = field(default_factory=list)
    done_by_worker: Counter = field(default_factory=Counter)
    busy: Counter = field(default_factory=Counter)
    restarting: dict[int, Restart] = field(default_factory=dict)  # lost workers Ray is restarting
    # Called with a worker's actor once Ray restarted it (optimal ablation installs its constants again).
    on_restart: Callable[[Any], None] | None = None
    # Workers kept warm (headsweep.sweep.cluster.warm_workers): this driver as their holder, and each worker's setup
    # (EvalWorker.configure's arguments); None: workers that end with the run.
    warm_owner: tuple[str, str] | None = None
    setups: list[tuple] = field(default_factory=list)
    # How many results of the call ``stream`` is yielding from come after the one it yielded last: a progress line
    # waits for the last of a call's results, which land together (a line per call, not one per call's first unit).
    landing_left: int = 0

    def __post_init__(self) -> None:
        self.alive = [True] * len(self.actors)

    def live(self) -> list[int]:
        indices = [i for i, ok in enumerate(self.alive) if ok]
        if not indices:
            raise HeadsweepError(
                f"all {len(self.actors)} workers were lost; the evaluations stored so far are kept: "
                "rerun the same command to resume"
            )
        return indices

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(worker, *args)`` on one live worker (``EvalWorker.run``); on losing it, on the next (bounded)."""
        what = getattr(fn, "__name__", str(fn))
        for attempt in range(self.max_retries + 1):
            self._wait_for_restarts()  # a lost worker back (or given up) first: nothing else to do meanwhile
            i = self.live()[0]
            sent_to = self.names[i]
            try:
                return get(self.actors[i].run.remote(fn, *args))
            except LOST as exc:
                self._lost(i, exc, f"its {what} call", attempt + 1, sent_to)
        raise HeadsweepError(f"{what} failed on {self.max_retries + 1} workers in a row: each worker was lost")

    def stream(self, units: Sequence[WorkUnit], per_call: int,
               send: Callable[[Any, list[WorkUnit]], Any] | None = None) -> Iterator[tuple[WorkUnit, Any, str]]:
        """Evaluate ``units`` in calls of at most ``per_call``; yield ``(unit, output, worker name)`` as they land.

        ``send(actor, batch)`` makes one call (its result: ``(eval_id, output)`` pairs, as ``EvalWorker.evaluate``
        gives them, which it does by default): another worker step streams its units as evaluations do (optimal
        ablation's constants, a slice of heads per call).

        Calls go to the workers round-robin (slots ``[0, 1, ..., 0, 1, ...]``) and each call's batch is
        cut from the queue only when a slot is free, sized by ``batch_size`` so that the tail of the
        queue is shared out rather than left to one worker. A lost worker's slots come back when Ray has
        restarted it; the others go on meanwhile, and the stream ends once no worker is still being restarted.
        """
        call = send if send is not None else (lambda actor, batch: actor.evaluate.remote(batch))
        queue: deque[WorkUnit] = deque(units)  # not yet sent
        # Batches a lost worker had in flight: (batch, failed attempts so far, the worker it was lost on).
        retry: deque[tuple[list[WorkUnit], int, int]] = deque()
        by_id = {u.eval_id: u for u in units}
        pending: dict = {}  # call -> (worker, batch, failed attempts so far, the worker's name when it was sent)
        slots: deque[int] = deque(i for _ in range(self.calls_in_flight) for i in self.live())
        while queue or retry or pending or self.restarting:
            while slots and (queue or retry):
                # A retried batch goes first, to another worker where one has a free slot.
                i = self._pick(slots, avoid=retry[0][2] if retry else None)
                if i is None:
                    break
                if retry:
                    batch, attempts, _ = retry.popleft()
                else:
                    n = batch_size(len(queue), per_call, len(self.usable()), self.calls_in_flight)
                    batch, attempts = [queue.popleft() for _ in range(n)], 0
                pending[call(self.actors[i], batch)] = (i, batch, attempts, self.names[i])
                self.busy[i] += 1
            if not pending and not self.restarting:
                raise HeadsweepError(
                    f"all {len(self.actors)} workers were lost; not evaluated: "
                    f"{name_units([u for b, *_ in retry for u in b] + list(queue))}; the evaluations stored so far "
                    "are kept: rerun the same command to resume"
                )
            asked = {ref for r in self.restarting.values() if (ref := r.ask()) is not None}
            ready, _ = ray.wait([*pending, *asked], num_returns=1,
                                timeout=RESTART_POLL_S if self.restarting else None)
            if not ready or ready[0] in asked:
                for restart in list(self.restarting.values()):
                    if self._returned(restart, ready) and self.alive[restart.worker]:
                        slots.extend([restart.worker] * self.calls_in_flight)
                continue
            [ref] = ready
            i, batch, attempts, sent_to = pending.pop(ref)
            self.busy[i] -= 1
            try:
                results = get(ref)
            except LOST as exc:
                if attempts >= self.max_retries:
                    raise HeadsweepError(
                        f"{len(batch)} evaluations failed {attempts + 1} times, their worker lost each time "
                        f"(last: {type(exc).__name__}): {name_units(batch)}"
                    ) from None
                if self._lost(i, exc, f"{len(batch)} evaluations", attempts + 2, sent_to):
                    slots = deque(k for k in slots if k != i)  # its free slots come back with it
                retry.append((batch, attempts + 1, i))
                continue
            slots.append(i)
            self.done_by_worker[i] += len(results)
            for k, (eval_id, out) in enumerate(results):
                self.landing_left = len(results) - 1 - k
                yield by_id[eval_id], out, self.names[i]

    def usable(self) -> list[int]:
        """The workers that take calls now: alive, and not being restarted."""
        return [i for i, ok in enumerate(self.alive) if ok and i not in self.restarting]

    def _pick(self, slots: deque[int], avoid: int | None) -> int | None:
        """Next free slot on a usable worker; a retried batch goes to another worker when one is free."""
        usable = set(self.usable())
        live = [i for i in slots if i in usable]
        slots.clear()
        slots.extend(live)
        if not slots:
            return None
        for k, i in enumerate(slots):
            if i != avoid:
                del slots[k]
                return i
        return slots.popleft()

    def _lost(self, i: int, exc: BaseException, what: str, attempt: int, sent_to: str) -> bool:
        """A call of ``what`` on worker ``i``, sent to it as ``sent_to``, failed with ``exc``: its worker (or the
        node holding its result) was lost. Returns whether this is news: the worker's first failed call since it
        was sent work as ``sent_to``; then Ray is restarting it (``restarting``), and the pool waits for it
        (``_returned``). Its other calls in flight fail too; they are re-run without a second wait."""
        first = self.names[i] == sent_to and self.alive[i] and i not in self.restarting
        if first:
            self.restarting[i] = Restart(i, self.actors[i], sent_to, time.monotonic() + self.restart_wait_s)
            log(f"worker {sent_to} lost ({type(exc).__name__}); re-running {what} "
                f"(attempt {attempt} of {self.max_retries + 1})")
        else:
            log(f"re-running {what} worker {sent_to} had in flight (attempt {attempt} of {self.max_retries + 1})")
        return first

    def _returned(self, restart: Restart, ready: list) -> bool:
        """Whether the wait for ``restart`` is over (``ready``: the calls ``ray.wait`` found ready): the worker is
        back, its model loaded, under its new name (``on_restart`` done), or given up (Ray has no restarts left
        for it, or it does not answer within ``restart_wait_s``). While Ray places the worker again (its node was
        lost, say) it answers ``ActorUnavailableError``; it is asked again a little later.

        The load comes before any work: a call sent to a worker still loading would wait for the load, while
        other workers could have run it, and be lost (and count against ``max_retries``) should the worker die
        again before it is ready."""
        i = restart.worker
        if restart.asked is None or restart.asked not in ready:
            if restart.loading or time.monotonic() < restart.deadline:
                return False
            fate = f"gone for good (not back within {self.restart_wait_s:g} s)"
        else:
            try:
                answer = get(restart.asked)
                if restart.loading and self.on_restart is not None:
                    self.on_restart(self.actors[i])
            except RayActorError as exc:
                now = time.monotonic()
                died_loading = restart.loading
                restart.asked, restart.ask_at, restart.loading = None, now + RESTART_POLL_S, False
                if died_loading:  # Ray restarts it again: asked afresh
                    restart.deadline = now + self.restart_wait_s
                    return False
                if isinstance(exc, ActorUnavailableError) and now < restart.deadline:
                    return False
                fate = f"gone for good ({type(exc).__name__})"
            else:
                if not restart.loading:
                    retake = (self.warm_owner, self.setups[i]) if self.warm_owner is not None else None
                    restart.asked, restart.loading = restart.actor.run.remote(loaded, retake), True
                    return False
                self.names[i] = answer
                fate = f"restarted as {answer}"
        del self.restarting[i]
        self.alive[i] = fate.startswith("restarted")
        log(f"worker {restart.lost_as} {fate}")
        return True

    def _wait_for_restarts(self) -> None:
        """Block until no worker is being restarted (each back, or given up)."""
        while self.restarting:
            asked = [ref for r in self.restarting.values() if (ref := r.ask()) is not None]
            ready = ray.wait(asked, num_returns=1, timeout=RESTART_POLL_S)[0] if asked else []
            if not asked:
                time.sleep(RESTART_POLL_S)
            for restart in list(self.restarting.values()):
                self._returned(restart, ready)

    def status_line(self) -> str:
        """One line per-worker status: evaluations done and calls in flight."""
        parts = []
        for i, name in enumerate(self.names):
            state = ("lost" if not self.alive[i] else "restarting" if i in self.restarting
                     else "busy" if self.busy[i] else "idle")
            parts.append(f"{name} {self.done_by_worker[i]} done, {state}")
        return "workers: " + "; ".join(parts)

    def stop(self) -> None:
        """End the workers (their model copies) once no more work is coming."""
        for a in self.actors:
            ray.kill(a)
        self.actors.clear()

    def release(self) -> None:
        """The run is done with its workers, and none has a call running: warm workers go idle for the next run
        (their last warnings shown), others end."""
        if self.warm_owner is None:
            self.stop()
            return
        from headsweep.sweep.cluster.warm_workers import release
        from headsweep.sweep.output.console import relay_lines

        relay_lines(release(self.actors))
        self.actors.clear()

    def relay_notes(self) -> None:
        """Show warm workers' warnings so far (Ray forwards their output to the driver that started them only)."""
        if self.warm_owner is not None and self.actors:
            from headsweep.sweep.cluster.warm_workers import notes
            from headsweep.sweep.output.console import relay_lines

            relay_lines(notes(self.actors))
