"""The Ray actor of a sweep: loads one model and its data once, then runs what the driver sends.

Two entry points: ``evaluate`` (the hot path: a batch of work units, each a mask evaluated on the
whole evaluation set) and ``run`` (any other worker-side step of an experiment kind, e.g. gradient
importance or efficiency timing): ``run(fn, *args)`` calls ``fn(worker, *args)`` in the actor, so
a new experiment kind brings its worker-side function and never edits this class.

A worker kept warm between runs (``headsweep run --keep-workers``, :mod:`.warm`) is configured for each run that
claims it (``configure``) and let go at the run's end (``release``); ``claim`` and ``notes`` answer on a thread of
their own (the ``control`` concurrency group), so that a claim finds a busy worker busy at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray

from headsweep.workers.ablation.worker_fill import WorkerFill
from headsweep.workers.actor import warm
from headsweep.workers.core.family import DatasetInfo, EvalAdapter, MaskOutput, RuntimeOptions
from headsweep.workers.families.registry import model_family
from headsweep.workers.memory.model_sharing import offered


@ray.remote(concurrency_groups={"control": 1})
class EvalWorker:
    """Holds the evaluation adapter of one model family (and adapters on other data, loaded on demand)."""

    def __init__(self, name: str, kind: str, model_cfg: Any, data_cfg: Any, runtime: RuntimeOptions,
                 lease: tuple[tuple[str, str], float] | None = None):
        """``lease``: ``(owner, keep_s)`` of a worker kept warm (``owner``: the run holding it, as :class:`.Lease`
        has it); None for a worker that ends with its run."""
        # fairseq logs every dictionary and data file it loads at INFO; a sweep's log is for progress.
        logging.getLogger("fairseq").setLevel(logging.WARNING)
        # headsweep's own warnings reach the driver's console as `headsweep: warning: ...` lines: the
        # driver shows forwarded lines with that prefix and keeps the rest of a worker's output in its log.
        # A warm worker's are kept for the run holding it to fetch (``notes``): Ray forwards its output to the
        # driver that started it only.
        own = logging.getLogger("headsweep")
        self._lease: warm.Lease | None = None
        self._notes: warm.NoteBuffer | None = None
        if lease is not None:
            self._start = warm.ProcessStart.now()
            self._notes = warm.NoteBuffer()
            own.addHandler(self._notes)
            own.propagate = False
            self._lease = warm.Lease(lease[0], lease[1], warm.code_fingerprint(),
                                     restarted=ray.get_runtime_context().was_current_actor_reconstructed)
        elif not own.handlers:
            relay = logging.StreamHandler()
            relay.setLevel(logging.WARNING)
            relay.setFormatter(logging.Formatter(warm.WARNING_FORMAT))
            own.addHandler(relay)
            own.propagate = False
        self.configure(name, kind, model_cfg, data_cfg, runtime)

    def configure(self, name: str, kind: str, model_cfg: Any, data_cfg: Any, runtime: RuntimeOptions) -> None:
        """The run's model, data and options (what the constructor takes), nothing loaded yet."""
        self.name = name
        self.kind, self.model_cfg, self.data_cfg, self.runtime = kind, model_cfg, data_cfg, runtime
        self._adapter: EvalAdapter | None = None
        self._other: dict[str, EvalAdapter] = {}  # repr(data config) -> adapter on that data
        self._variant: tuple[tuple, EvalAdapter] | None = None  # ((positions, weights file), adapter)
        # What gated-off heads leave behind (sweep.ablation), set on every adapter loaded; mean's values computed
        # once, on the first load (again after Ray restarts the actor: the same values, they are deterministic).
        self._fill = WorkerFill(runtime.ablation)

    @ray.method(concurrency_group="control")
    def claim(self, owner: tuple[str, str], keep_s: float) -> str:
        """A warm worker taken by the run ``owner``: ``claimed``, ``busy`` or ``stale`` (:meth:`.Lease.claim`)."""
        return self._lease.claim(owner, keep_s) if self._lease is not None else warm.BUSY

    def retake(self, owner: tuple[str, str], setup: tuple) -> None:
        """A warm worker Ray restarted (a new process), taken back by the run holding it: its lease, and that run's
        ``setup`` (what :meth:`configure` takes) in place of the first run's, which Ray started it with."""
        if self._lease is not None:
            self._lease.take(owner)
        self.configure(*setup)

    def release(self) -> None:
        """The run is over: its models and data dropped, the process as it started, idle until the next claim or
        the keep time (the keep time the last claim gave)."""
        if self._lease is None:
            return
        self.configure(self.name, self.kind, self.model_cfg, self.data_cfg, self.runtime)
        gc.collect()  # the models' reference cycles: their memory back before the next run loads
        self._start.restore()
        self._lease.release()

    @ray.method(concurrency_group="control")
    def notes(self) -> list[str]:
        """headsweep's warnings since the last call (a warm worker's: Ray forwards its output elsewhere)."""
        return self._notes.drain() if self._notes is not None else []

    def load(self) -> DatasetInfo:
        """Load model and data (errors surface here, not in the constructor, with their cause)."""
        start = time.perf_counter()
        self._adapter = model_family(self.kind).load(self.model_cfg, self.data_cfg, self.runtime)
        info = self._adapter.describe()
        info.facts = {**info.facts, "load_seconds": round(time.perf_counter() - start, 3)}
        self._fill.install(self, self._adapter)
        ablation = self._fill.facts()
        return info if not ablation else dataclasses.replace(info, facts={**info.facts, "ablation": ablation})

    def held_adapters(self) -> list[EvalAdapter]:
        """Every adapter loaded and kept: the main one, the one on other data, the variant."""
        variant = [self._variant[1]] if self._variant is not None else []
        return [a for a in (self._adapter, *self._other.values(), *variant) if a is not None]

    def fill_values(self) -> dict[str, Any]:
        """The run's constant fill (mean ablation's means) as numpy arrays by ``attention:layer``; empty without."""
        return self._fill.values()

    def fill_tokens(self) -> dict[str, int]:
        """The real tokens each site's mean counted, by ``attention:layer``; empty without means."""
        return self._fill.tokens()

    def adapter(self, data_cfg: Any = None) -> EvalAdapter:
        """The adapter on the evaluation data (``data_cfg`` None), or on other data, loaded once and kept."""
        if data_cfg is None or data_cfg == self.data_cfg:
            if self._adapter is None:  # Ray restarted this actor after its process died: load again
                self.load()
            return self._adapter
        key = repr(data_cfg)
        if key not in self._other:
            self._other = {}  # the previous one's data freed before the next loads
            # The model the worker holds serves the other data too (one copy of the weights per worker).
            with offered(getattr(self.adapter(), "model", None)):
                self._other = {key: model_family(self.kind).load(self.model_cfg, data_cfg, self.runtime)}
            self._fill.install(self, self._other[key], "other data")
        return self._other[key]

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``: an experiment kind's worker-side step (a module-level function)."""
        return fn(self, *args)

    def where(self) -> str:
        return f"{self.name}@{socket.gethostname()}:{os.getpid()}"

    def variant_adapter(self, examples: tuple[int, ...] | None, weights: str | None) -> EvalAdapter:
        """The adapter on the examples at ``examples`` (a screening subset, ``WorkUnit.examples``; None: all) whose
        model holds the state dict at ``weights`` (``WorkUnit.weights``; None: the loaded weights).

        Loaded on first use and kept, one variant at a time beside the main adapter (a second model copy).
        """
        key = (examples, weights)
        if self._variant is None or self._variant[0] != key:
            self._variant = None  # free the previous copy before loading the next
            adapter = model_family(self.kind).load(self.model_cfg, self.data_cfg,
                                                   replace(self.runtime, examples=examples))
            if weights is not None:
                import torch

                # Before its first evaluation: load_state_dict copies in place, and the reuse caches (baseline
                # states) are filled lazily from the weights the model holds when a mask first runs.
                adapter.model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
            self._fill.install(self, adapter)
            self._variant = (key, adapter)
        return self._variant[1]

    def evaluate(self, units: list) -> list[tuple[str, MaskOutput]]:
        """Evaluate work units (``headsweep.workers.core.work.WorkUnit``); returns ``(eval_id, output)`` pairs.

        Units that name ``examples`` run on the adapter of that subset, the others on the whole set; units that
        name ``weights`` on an adapter whose model holds those weights.
        """
        results: list[tuple[str, MaskOutput]] = []
        for subset, weights in dict.fromkeys((u.examples, u.weights) for u in units):
            group = [u for u in units if (u.examples, u.weights) == (subset, weights)]
            plain = subset is None and weights is None
            adapter = self.adapter() if plain else self.variant_adapter(subset, weights)
            outputs = adapter.evaluate([u.masked for u in group])
            results.extend((u.eval_id, out) for u, out in zip(group, outputs, strict=True))
        return results
