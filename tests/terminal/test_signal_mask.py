"""The SIGTERM hold around ``ray.init`` (signals.handlers_kept) is this process's own: the embedded Ray instance's
processes start with SIGTERM deliverable, so Ray's shutdown ends each with its first SIGTERM instead of waiting out
its grace period (a second per process) before a SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os, signal
import psutil, ray
from headsweep.sweep.output import signals

def blocked(pid):
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(l for l in f if l.startswith("SigBlk:")).split()[1], 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)

signals.install()
os.environ["RAY_AUTH_MODE"] = "disabled"
with signals.handlers_kept():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    held_here = blocked(os.getpid())
children = psutil.Process().children(recursive=True)
result = {"held_during_init": held_here, "held_after": blocked(os.getpid()),
          "children": len(children), "children_holding": sorted(p.name() for p in children if blocked(p.pid)),
          "handler_back": signal.getsignal(signal.SIGTERM) is signals._stop}
ray.shutdown()
print(json.dumps(result))
"""


def test_ray_processes_started_under_the_hold_take_sigterm():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["held_during_init"] and not result["held_after"] and result["handler_back"], result
    assert result["children"] >= 3, result  # GCS, raylet, and Ray's helpers at least
    assert result["children_holding"] == [], result
