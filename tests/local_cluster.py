"""A multi-node Ray cluster on one machine, in a process of its own, whose nodes a test can take away.

Ray's own fault-tolerance tests use ``ray.cluster_utils.Cluster``: a head and worker nodes, each with its own
raylet and object store. It runs here in a child process (``python tests/local_cluster.py``), because Ray allows
one ``ray.init`` per process and the test session's own Ray instance (conftest ``ray_address``) lives in the test
process; the sweep's driver connects to the cluster with ``--address`` from a third process.

The head holds no CPU, so every worker actor runs on a worker node and taking a node away never takes the GCS or
the driver's raylet with it. Node death is noticed within about a second (short GCS health checks), as a real
lost node would be after ``health_check_failure_threshold`` missed beats.

With ``dashboard=True`` the head also serves Ray's job API (``headsweep submit`` and ``jobs`` talk to it), with
token auth off and ``HOME`` in the cluster's scratch folder (design notes: a token in ``~/.ray`` would turn it on).
``resources`` are custom resources every worker node gets (e.g. ``{"driver": 1}``: a job submitted with
``entrypoint_resources`` runs its driver on a worker node, which can then be lost; the head cannot).

Protocol (one line each way): the child prints ``ADDRESS <gcs address>`` (then, with a dashboard, ``DASHBOARD
<job API url>`` once the job API answers), then answers ``remove <pid>`` (take away, without a graceful shutdown,
the node whose raylet started process ``pid``) with ``REMOVED <node id>`` or ``ERROR <why>``; end of input shuts the
cluster down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 180  # three nodes on a busy machine
REMOVE_TIMEOUT_S = 60
JOB_API_TIMEOUT_S = 120  # within START_TIMEOUT_S: the child's error, with the dashboard's logs, reaches the test


def parent(pid: int) -> int:
    """The parent of process ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a killed one may linger a while as a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """Every living process below ``root`` (a raylet's workers and what they started)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            children.setdefault(parent(int(entry.name)), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together, so that no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def wait_for_job_api(url: str, temp_dir: str) -> None:
    """Until the head's job API answers; else an error ending with the dashboard's own log lines."""
    import requests

    deadline = time.monotonic() + JOB_API_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/api/jobs/", timeout=2).ok:
                return
        time.sleep(0.5)
    logs = sorted(Path(temp_dir).glob("session_latest/logs/dashboard*"))
    tails = "".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in logs)
    raise RuntimeError(f"the job API at {url} did not answer within {JOB_API_TIMEOUT_S} s\n{tails}")


def serve(worker_nodes: int, cpus: int, dashboard: bool = False, resources: dict | None = None) -> None:
    """Start the cluster, print its address, then take nodes away as asked on stdin."""
    import ray
    import ray._private.utils
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Cluster would record its address in /tmp/ray for a later bare ray.init: none here, other sessions share /tmp.
    ray._private.utils.write_ray_address = lambda *args, **kwargs: None

    # Short: the raylets' unix socket paths under it must stay below ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="hs-cl-", dir="/tmp")
    fast_health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 2}
    head: dict = {"num_cpus": 0, "include_dashboard": dashboard, "temp_dir": temp_dir, "_system_config": fast_health}
    if dashboard:
        # Free ports: the agent's default (52365) may be taken by another Ray on this machine.
        dashboard_port, agent_port, metrics_port = free_ports(3)
        os.environ["DASHBOARD_METRIC_PORT"] = str(metrics_port)  # read by the dashboard process; default 44227
        head.update(dashboard_host="127.0.0.1", dashboard_port=dashboard_port, dashboard_agent_listen_port=agent_port)
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=head)
    try:
        # Each node its own temp dir, as each machine has its own disk: nodes sharing one unpack each job's
        # uploaded working_dir into the same folder and remove it under one another's workers.
        nodes = [cluster.add_node(num_cpus=cpus, resources=dict(resources or {}), temp_dir=f"{temp_dir}/n{i}")
                 for i in range(worker_nodes)]
        cluster.wait_for_nodes()
        print(f"ADDRESS {cluster.address}", flush=True)
        if dashboard:
            url = f"http://127.0.0.1:{head['dashboard_port']}"
            wait_for_job_api(url, temp_dir)
            print(f"DASHBOARD {url}", flush=True)
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command != "remove":
                print(f"ERROR unknown command {command!r}", flush=True)
                continue
            raylets = {n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: n for n in nodes}
            pid = int(arg)
            while pid > 1 and pid not in raylets:
                pid = parent(pid)
            if pid not in raylets:
                print(f"ERROR process {arg} was not started by a worker node's raylet", flush=True)
                continue
            node = raylets[pid]
            # A lost machine takes its worker processes with it; Cluster.remove_node ends only the node's own
            # services (raylet, object store), and a worker outlives its raylet for a while.
            for child in descendants(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            cluster.remove_node(node, allow_graceful=False)
            nodes.remove(node)
            print(f"REMOVED {node.node_id}", flush=True)
    finally:
        cluster.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class LocalCluster:
    """The child process's cluster, seen from the test: its address, and ``remove_node_of(pid)``."""

    def __init__(self, worker_nodes: int = 2, cpus: int = 2, dashboard: bool = False, resources: dict | None = None):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        argv = [sys.executable, __file__, "--worker-nodes", str(worker_nodes), "--cpus", str(cpus),
                "--resources", json.dumps(resources or {})]
        self.home = None
        if dashboard:
            argv.append("--dashboard")
            self.home = tempfile.mkdtemp(prefix="hs-cl-home-", dir="/tmp")
            env.update(HOME=self.home, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
            # A job's driver runs in its uploaded folder, not here: the cluster's python finds headsweep on its
            # path (this checkout), as a cluster image has it installed.
            repo = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
        # The child's messages go to a file, shown when it fails to answer (a pipe nobody reads would fill).
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     text=True, env=env, start_new_session=True)
        try:
            self.address = self._expect("ADDRESS", START_TIMEOUT_S)
            self.dashboard = self._expect("DASHBOARD", START_TIMEOUT_S) if dashboard else None
        except BaseException:
            self.close()
            raise

    def _expect(self, word: str, timeout: float) -> str:
        """The rest of the child's next line, which must start with ``word``; an error after ``timeout`` s."""
        # One line per command, read whole: nothing stays in the reader's buffer for select to miss.
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"local cluster: no {word} line within {timeout:g} s{self._said()}")
        line = self.proc.stdout.readline()
        if not line.startswith(word + " "):
            raise RuntimeError(f"local cluster: expected {word}, got {line!r} (exit code {self.proc.poll()})"
                               f"{self._said()}")
        return line.split(" ", 1)[1].strip()

    def _said(self) -> str:
        """The end of what the child wrote to stderr, for an error message."""
        self.errors.seek(0)
        tail = self.errors.read()[-3000:]
        return f"; its stderr ends:\n{tail}" if tail.strip() else ""

    def remove_node_of(self, pid: int) -> str:
        """Take away the node holding process ``pid`` (a worker actor's); returns the node's id."""
        self.proc.stdin.write(f"remove {pid}\n")
        self.proc.stdin.flush()
        return self._expect("REMOVED", REMOVE_TIMEOUT_S)

    def close(self) -> None:
        """Shut the cluster down (end of input), then end whatever of its session is left."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
        self.errors.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="logical CPUs per worker node")
    parser.add_argument("--resources", default="{}", help="custom resources of each worker node, as JSON")
    parser.add_argument("--dashboard", action="store_true", help="serve Ray's job API on the head")
    args = parser.parse_args()
    serve(args.worker_nodes, args.cpus, args.dashboard, json.loads(args.resources))


if __name__ == "__main__":
    main()
