"""``headsweep run`` with a stopwatch on the driver's phases: ``python -m bench.run_phases PHASES.json run CONFIG ...``.

The command runs exactly as ``python -m headsweep run ...`` does (the same ``main``, in this process); the driver's
steps are wrapped in timers (the module attributes the driver calls, replaced before the command starts), and
when it ends the phases are written to ``PHASES.json``: ``{"t0": <time.time() when this interpreter's code began>,
"phases": [[name, start, seconds], ...]}``, starts in ``time.time()`` seconds. The worker's side (its process,
imports, model load, baseline) is one phase here, ``workers``; ``runs.facts.load_seconds`` says how much of it was
the worker's ``load`` call. Used by ``bench/peers.py`` for its start-up table (bench/README.md).
"""

from __future__ import annotations

import functools
import json
import sys
import time

T0 = time.time()
PHASES: list[list] = []

# (module, attribute, phase): the driver's steps in the order a run takes them.
STEPS = (
    ("headsweep.sweep.configuration.config", "load_config", "config"),
    ("headsweep.sweep.configuration.config", "check_data_files", "data files"),
    ("headsweep.sweep.run.driver", "pin_hub_models", "hub pins"),
    ("headsweep.sweep.run.driver.Sweep", "check_model_files", "model files"),
    ("headsweep.sweep.run.driver", "run_fingerprints", "weights fingerprints"),
    ("headsweep.sweep.run.driver", "run_to_continue", "store: run to continue"),
    ("headsweep.sweep.run.driver", "complete_run", "store: complete run"),
    ("headsweep.sweep.run.driver", "check_memory", "memory check"),
    ("headsweep.sweep.run.driver", "init_ray", "ray.init"),
    ("headsweep.sweep.run.driver.Sweep", "start_workers", "workers"),
    ("headsweep.sweep.run.driver.Sweep", "open_run", "open run (checks, first row)"),
    ("headsweep.sweep.run.driver.Sweep", "sweep_model", "grid"),
    ("headsweep.sweep.run.context.Context", "finish", "significance left"),
    ("headsweep.sweep.cluster.ray_session", "end_ray", "ray shutdown"),
)


def timed(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.append([name, start, time.time() - start])

    return wrapper


def install() -> None:
    """Wrap every step of ``STEPS`` (importing the driver: its import is a phase of its own)."""
    import importlib

    for where, attr, name in STEPS:
        module, cls = where.rsplit(".", 1) if where.rsplit(".", 1)[-1][0].isupper() else (where, "")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, attr, timed(getattr(owner, attr), name))


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    start = time.time()
    from headsweep.sweep.terminal import cli

    PHASES.append(["cli import", start, time.time() - start])
    start = time.time()
    install()
    PHASES.append(["driver imports", start, time.time() - start])
    try:
        return cli.main(argv)
    finally:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"t0": T0, "phases": PHASES}, f)


if __name__ == "__main__":
    sys.exit(main())
