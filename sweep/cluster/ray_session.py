"""The driver's Ray session: connect to a cluster or start an embedded local instance."""

from __future__ import annotations

import contextlib
import os

import ray

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster import reaper
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.output import console, signals

# Whether init_ray connected this process (rather than finding Ray already initialized by its caller).
_connected_here = False
# The embedded instance's watchdog (headsweep.sweep.cluster.reaper): its processes end with this one.
_watchdog: reaper.Watchdog | None = None


def init_ray(address: str | None, cfg: Config) -> None:
    """Connect to ``address``, or start an embedded local Ray instance.

    Workers' output is forwarded to the driver (``log_to_driver``), where Ray prints it into the
    command's log file (or onto the terminal with ``--verbose``); the console shows a worker's own
    ``headsweep:`` lines (``console.relay_ray_workers``).
    """
    global _connected_here, _watchdog
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if not address and _watchdog is None:
        _watchdog = reaper.start()  # before the instance's first process: see headsweep.sweep.cluster.reaper
    try:
        # Ray replaces the SIGTERM handler (its core worker's aborts the process): a scheduler's SIGTERM must stop
        # a run as Ctrl-C does, its row marked interrupted (headsweep.sweep.output.signals).
        with signals.handlers_kept(), _watchdog.marking() if _watchdog is not None else contextlib.nullcontext():
            _init(address, cfg)
    except BaseException as exc:
        _let_go()  # a start cut short may have left some of the instance's processes
        if isinstance(exc, (ConnectionError, TimeoutError, ValueError, RuntimeError)):
            where = address or "a local instance"
            raise HeadsweepError(f"cannot reach the Ray cluster at {where}: {str(exc).splitlines()[0]}") from None
        raise
    _connected_here = True
    console.relay_ray_workers()


def end_ray() -> None:
    """Disconnect from the cluster (stopping an embedded instance) if ``init_ray`` connected this process; a
    connection the caller made is left to it.

    Called when a command ends, while the console still relays the workers' last lines: Ray's own exit hook
    would do it later, after first sleeping 0.5 s for those lines (measured: a CLI run 0.5 s shorter).
    """
    global _connected_here
    if _connected_here and ray.is_initialized():
        ray.shutdown()
    _connected_here = False
    _let_go()


def _let_go() -> None:
    """The embedded instance is shut down, or failed to start: its watchdog ends whatever is left of it."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.release()
        _watchdog = None


def _init(address: str | None, cfg: Config) -> None:
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # A bare local instance would switch on token auth and write ~/.ray/auth_token, which
        # later breaks `ray start` + job submission on the same machine; the embedded
        # instance is private to this process, so it runs without.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        need = cfg.sweep.workers * cfg.sweep.num_cpus_per_worker
        # Leave Ray's own tasks room beside the workers (logical CPUs, not threads).
        cpus = max(os.cpu_count() or 1, int(need + 0.999) + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)


def resolve_device(cfg: Config) -> str:
    if cfg.sweep.device != "auto":
        return cfg.sweep.device
    return "cuda" if cfg.sweep.num_gpus_per_worker > 0 else "cpu"
