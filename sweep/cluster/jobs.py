"""Sweeps as Ray jobs on a running cluster: submit, list, status, logs, stop, wait.

``submit`` runs exactly ``headsweep run`` on the cluster: the job's entrypoint is
``python -m headsweep.sweep.cluster.job_entry run CONFIG [overrides] --address auto [--workers N] --store STORE``
(``headsweep run`` in a folder holding the config, :mod:`.job_entry`), run by the cluster's ``python`` (the one
on the head's PATH, i.e. the image's interpreter; pass ``python=`` to name another). ``--address auto`` because
inside a Ray job ``RAY_ADDRESS`` points at the cluster and the driver must connect to it rather than start an
embedded instance.

How the config travels. The config file is on the submitting machine, so it is sent with the
job: the config and the configs it ``include``s (relative includes only, keeping their relative layout) go in
the job's runtime_env ``env_vars`` (:mod:`.job_entry` says why not as a ``working_dir``: Ray's GCS packages break
the resubmission of an unchanged config), at most ``MAX_BUNDLE_BYTES``. The config is checked
here first (unknown keys, bad overrides), so a typo fails in a second instead of in the job's logs.
Everything else in the config is read on the cluster, by the cluster: model and data paths are not
uploaded (a model is gigabytes). On the cluster the job's working directory is a folder holding the configs,
so, by the config rule (docs/configuration.md: relative to the config file when the path exists there, otherwise to the
working directory), a relative ``model.path`` or ``data.path`` resolves inside that folder and finds
nothing: in a submitted config, name models and data by absolute paths on the cluster's shared
volume (e.g. ``/mnt/headsweep/models/...``) or by URIs.

The store. Results are written by the cluster's processes, so ``store`` must be a URI every node can
reach: an absolute path on a volume mounted on every pod (ReadWriteMany PVC, NFS) or an object-store
URI (``s3://bucket/headsweep``; credentials come from the pods' environment, not from here). A
relative path is refused: on the cluster it would land in the job's temporary working directory and
vanish with it. With ``store=None`` the job uses the cluster's ``$HEADSWEEP_STORE`` and fails at once,
with a message in its logs, when the cluster does not set it.

Where the driver runs. Ray's job supervisor, and the driver it starts as a child process, run on the head node
unless the job asks for resources (``entrypoint_num_cpus``, ``entrypoint_resources``); then Ray may place them on
any node that has those, and a lost node can take the driver with it. Ray then marks the job FAILED ("Job
supervisor actor died"); ``status_detail`` says so in headsweep's words, and submitting the same config again
continues the run from the store: the new driver finds the run's row still ``running`` and its Ray job ended on
the cluster (``sweep/run/runs.py``), so it resumes the run without waiting for the heartbeat to go stale.

Addresses are the dashboard's job API, ``http://HEAD:8265`` (``kubectl port-forward`` to the head
service on Kubernetes). Every call first probes the address with a bounded timeout, so an address
that does not answer fails in seconds with one line instead of hanging. Clusters with token
authentication (Ray 2.52+, KubeRay ``authOptions``) need ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` in the submitting environment; Ray's client sends the token itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.yaml_text import read_yaml_file

# Bounds for the reachability probe: (connect, read) seconds.
PROBE_TIMEOUT_S = (5.0, 10.0)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
MISSING_STORE = "set HEADSWEEP_STORE on the cluster or pass --store"
# One environment string reaches the job's processes through exec, which takes at most 128 KiB (MAX_ARG_STRLEN).
MAX_BUNDLE_BYTES = 96 * 1024
# The job's environment variable holding its configs (JSON ``{"files": {relative path: text}}``), read by job_entry.
BUNDLE_VAR = "HEADSWEEP_JOB_CONFIGS"


# -- addresses and errors ---------------------------------------------------------------------------
def _api_url(address: str) -> str:
    """The job API's base URL; ``HOST:PORT`` means ``http://HOST:PORT``."""
    address = (address or "").strip().rstrip("/")
    if not address:
        raise HeadsweepError("no Ray job API address: pass --address http://HEAD:8265")
    if address.startswith("ray://"):
        raise HeadsweepError(
            f"{address} is a Ray Client address; jobs are submitted to the dashboard's job API, e.g. http://HEAD:8265"
        )
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise HeadsweepError(f"cannot reach the Ray job API at {address}: only http:// and https:// addresses work")
    return address


def _reason(exc: BaseException) -> str:
    """The useful part of a requests/urllib3 error, which nests the cause several levels deep."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno.group(1).strip()
    if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return f"no answer within {PROBE_TIMEOUT_S[0]:g} s"
    return (text.splitlines() or [type(exc).__name__])[0][:200]


def _probe(url: str) -> None:
    """Fail fast, with one line, when nothing answers at ``url``.

    Ray's client sends its requests without a timeout, so an address that drops packets would hang
    for minutes; this bounded request comes first. Any HTTP answer counts as reachable: whether the
    answer is acceptable (auth, version) is the client's to judge.
    """
    import requests

    try:
        answer = requests.get(f"{url}/api/version", timeout=PROBE_TIMEOUT_S)
    except requests.exceptions.RequestException as exc:
        raise HeadsweepError(f"cannot reach the Ray job API at {url}: {_reason(exc)}") from None
    if answer.status_code in (401, 403):
        return  # a Ray API with token auth: the client, which sends the token, reports it properly
    try:
        is_ray = answer.ok and "ray_version" in answer.json()
    except ValueError:
        is_ray = False
    if not is_ray:
        raise HeadsweepError(
            f"cannot reach the Ray job API at {url}: HTTP {answer.status_code} from /api/version, not a Ray dashboard "
            "(its port is usually 8265)"
        )


@contextlib.contextmanager
def _api_errors(url: str, job_id: str | None = None) -> Iterator[None]:
    """Translate the job client's exceptions into one-line ``HeadsweepError``s."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except HeadsweepError:
        raise
    except AuthenticationError as exc:
        raise HeadsweepError(
            f"the Ray job API at {url} refused the request ({str(exc).splitlines()[0]}); a cluster with token auth "
            "needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN here"
        ) from None
    except (ConnectionError, OSError) as exc:
        raise HeadsweepError(f"cannot reach the Ray job API at {url}: {_reason(exc)}") from None
    except RuntimeError as exc:
        text = str(exc)
        if job_id is not None and "404" in text:
            raise HeadsweepError(
                f"no job {job_id!r} on the Ray cluster at {url} (headsweep jobs list --address {url} shows its jobs)"
            ) from None
        raise HeadsweepError(f"the Ray job API at {url} failed: {text.splitlines()[0][:300]}") from None


def _client(address: str) -> tuple[Any, str]:
    """A connected ``JobSubmissionClient`` and the URL it talks to."""
    url = _api_url(address)
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:  # the job client needs ray[default] (requests, aiohttp)
        raise HeadsweepError(f"the Ray job client is not installed ({exc}): pip install 'ray[default]'") from None
    _probe(url)
    with _api_errors(url):
        return JobSubmissionClient(url), url


# -- the uploaded config ----------------------------------------------------------------------------
def _config_files(config: Path) -> list[Path]:
    """The config and every file it includes through relative ``include:`` entries, transitively."""
    found: list[Path] = []
    todo = [config]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        if not path.is_file():
            raise HeadsweepError(f"config file not found: {path}")
        found.append(path)
        data = read_yaml_file(path) or {}
        includes = data.get("include", []) if isinstance(data, dict) else []
        for inc in [includes] if isinstance(includes, str) else includes or []:
            # An absolute include names a file on the cluster, like any other absolute path in a config.
            if isinstance(inc, str) and not os.path.isabs(inc):
                todo.append(Path(os.path.normpath(path.parent / inc)))
    return found


def bundle_config(config_path: str | os.PathLike) -> tuple[str, str]:
    """The config and its relative includes as the job's :data:`BUNDLE_VAR` value (JSON of their
    texts by path relative to their common folder, keeping their layout), and the config's relative path (what the
    job's entrypoint names)."""
    config = Path(os.path.abspath(config_path))
    files = _config_files(config)
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    text = json.dumps({"files": {f.relative_to(root).as_posix(): f.read_text(encoding="utf-8") for f in files}})
    size = len(text.encode())
    if size > MAX_BUNDLE_BYTES:
        raise HeadsweepError(
            f"config {config_path} and its includes take {size:,} bytes, more than a job's environment "
            f"carries ({MAX_BUNDLE_BYTES:,}): move large lists (masks, heads) into files on the cluster's shared "
            "volume")
    return text, config.relative_to(root).as_posix()


def _warn_relative_paths(config_path: str | os.PathLike, overrides: list[str]) -> None:
    """One warning naming the relative file paths of the config, its includes and the overrides: the job resolves
    them inside its own folder on the cluster, which holds the configs alone."""
    from headsweep.sweep.configuration.config import apply_overrides, relative_paths

    found = []
    for path in _config_files(Path(os.path.abspath(config_path))):
        data = read_yaml_file(path)
        found += relative_paths(data) if isinstance(data, dict) else []
    found += relative_paths(apply_overrides({}, overrides))
    if found:
        logging.getLogger("headsweep").warning(
            "%s: relative paths resolve inside the job's folder on the cluster, which holds only the config files; "
            "use absolute paths (or URIs) that the cluster's nodes see", ", ".join(dict.fromkeys(found)))


def _check_store(store: str | None) -> None:
    if store is None:
        return
    if not store.strip():
        raise HeadsweepError("empty --store: give an absolute path on shared storage or a URI such as s3://bucket/x")
    if "://" not in store and not store.startswith("/"):
        raise HeadsweepError(
            f"store {store!r} is a relative path; a submitted sweep writes from the cluster, so give an absolute path "
            "on storage every node mounts (e.g. /mnt/headsweep/store) or a URI such as s3://bucket/headsweep"
        )


def build_entrypoint(
    config_rel: str, overrides: list[str], store: str | None, workers: int | None, python: str = "python"
) -> str:
    """The shell command a submitted job runs: ``headsweep run`` beside its configs (:mod:`.job_entry`)."""
    parts = [python, "-m", "headsweep.sweep.cluster.job_entry", "run", config_rel, *overrides, "--address", "auto"]
    if workers is not None:
        parts += ["--workers", str(workers)]
    command = shlex.join(parts)
    if store is not None:
        return f"{command} --store {shlex.quote(store)}"
    # Left to the cluster's environment; the shell stops the job with this message when it is unset,
    # rather than letting the default ./headsweep-store land in the job's throw-away working directory.
    return f'{command} --store "${{HEADSWEEP_STORE:?{MISSING_STORE}}}"'


# -- the API the CLI calls --------------------------------------------------------------------------
def submit(
    config_path: str,
    overrides: list[str],
    address: str,
    store: str | None,
    workers: int | None,
    runtime_env: dict | None = None,
    wait: bool = False,
    *,
    python: str = "python",
    entrypoint_num_cpus: float | None = None,
    entrypoint_resources: dict[str, float] | None = None,
) -> str:
    """Submit ``headsweep run CONFIG [overrides] --store STORE [--workers N]`` as a Ray job.

    Args:
        config_path: the sweep's YAML config on this machine; it and its relative includes are uploaded.
        overrides: ``key=value`` config overrides, passed on to ``headsweep run`` unchanged.
        address: the cluster's job API, ``http://HEAD:8265``.
        store: results store as the cluster sees it (absolute shared path or URI); None: the cluster's
            ``$HEADSWEEP_STORE``.
        workers: number of worker actors (``--workers``), or None for the config's ``sweep.workers``.
        runtime_env: extra Ray runtime_env for the job (``env_vars``, ``pip``, ...); ``working_dir`` is
            taken by the uploaded config.
        wait: block until the job ends; a job that does not succeed raises ``HeadsweepError``.
        python: the interpreter on the cluster that has headsweep installed.
        entrypoint_num_cpus: CPUs the driver holds; with ``entrypoint_resources`` (custom resources, e.g.
            ``{"driver": 1}``), lets Ray run the driver on a node that has them instead of the head.

    Returns:
        The Ray job (submission) id.
    """
    from headsweep.sweep.configuration.config import load_config, workers_override

    _check_store(store)
    if workers is not None and workers < 1:
        raise HeadsweepError(f"--workers must be at least 1, got {workers}")
    if entrypoint_num_cpus is not None and not entrypoint_num_cpus >= 0:
        raise HeadsweepError(f"--entrypoint-num-cpus must be >= 0, got {entrypoint_num_cpus}")
    for name, amount in (entrypoint_resources or {}).items():
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not amount >= 0:
            raise HeadsweepError(f"--entrypoint-resources: resource {name!r} must be a number >= 0, got {amount!r}")
    overrides = list(overrides)
    # Validate here so that a typo fails now, not minutes later in the job's logs.
    load_config(config_path, overrides + ([workers_override(workers, overrides)] if workers is not None else []))
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise HeadsweepError(f"--runtime-env-json must be a JSON object of runtime_env fields (e.g. "
                             f"'{{\"env_vars\": {{\"HF_HOME\": \"/cache\"}}}}'), got {runtime_env!r}")
    env = dict(runtime_env or {})
    if not isinstance(env.get("env_vars", {}), dict):
        raise HeadsweepError(f"--runtime-env-json: env_vars must be a JSON object of variable names and values, got "
                             f"{env['env_vars']!r}")
    if "working_dir" in env:
        raise HeadsweepError("runtime_env 'working_dir' is not used: the job runs from the headsweep installed on the "
                             "cluster, with the config sent along; put code in the image instead")
    bundle, config_rel = bundle_config(config_path)
    _warn_relative_paths(config_path, overrides)
    env["env_vars"] = {**env.get("env_vars", {}), BUNDLE_VAR: bundle}

    client, url = _client(address)
    entrypoint = build_entrypoint(config_rel, overrides, store, workers, python)
    metadata = {"headsweep_config": Path(config_path).name, "headsweep_store": store or "$HEADSWEEP_STORE"}
    with _api_errors(url):
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=env, metadata=metadata,
                                   entrypoint_num_cpus=entrypoint_num_cpus,
                                   entrypoint_resources=entrypoint_resources or None)
    if wait:
        _follow(client, url, job_id, None)
    return job_id


def _when(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def list_jobs(address: str) -> list[dict]:
    """The cluster's submitted jobs, oldest first.

    Each is a dict with ``job_id``, ``status``, ``entrypoint``, ``start_time`` and ``end_time`` (ISO 8601
    UTC, or None), ``message`` and ``metadata``. Drivers that connected with ``ray.init`` rather than
    through the job API are left out: they cannot be followed with status, logs or stop.
    """
    client, url = _client(address)
    with _api_errors(url):
        details = client.list_jobs()
    rows = [
        {
            "job_id": d.submission_id,
            "status": str(getattr(d.status, "value", d.status)),
            "entrypoint": d.entrypoint,
            "start_time": _when(d.start_time),
            "end_time": _when(d.end_time),
            "message": d.message,
            "metadata": dict(d.metadata or {}),
        }
        for d in details
        if d.submission_id
    ]
    return sorted(rows, key=lambda r: (r["start_time"] or "", r["job_id"]))


def status(address: str, job_id: str) -> str:
    """The job's status: PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED."""
    client, url = _client(address)
    with _api_errors(url, job_id):
        st = client.get_job_status(job_id)
    return str(getattr(st, "value", st))


# Ray's error types (JobErrorType) for a job whose driver went away with its supervisor: the node that ran it was
# lost, or the supervisor's process died.
DRIVER_LOST = ("JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE")


def status_detail(address: str, job_id: str) -> tuple[str, str | None]:
    """The job's status and, for a job that ended otherwise than SUCCEEDED, one line saying why (None when Ray
    gives no reason): a driver lost with its node is named as such, with how to continue the run."""
    client, url = _client(address)
    with _api_errors(url, job_id):
        info = client.get_job_info(job_id)
    st = str(getattr(info.status, "value", info.status))
    return st, _why(st, info)


def _why(st: str, info: Any) -> str | None:
    if st not in ("FAILED", "STOPPED"):
        return None
    message = " ".join((info.message or "").split())
    kind = str(getattr(info.error_type, "value", info.error_type) or "")
    if kind in DRIVER_LOST or message.startswith("Job supervisor actor died"):
        return (f"the job's driver was lost with the process or node that ran it (Ray: {message[:300]}); submit "
                "the same config again to continue the run from the store")
    return message[:500] or None


def logs(address: str, job_id: str) -> str:
    """Everything the job has printed so far (stdout and stderr, with Ray's own lines)."""
    client, url = _client(address)
    with _api_errors(url, job_id):
        return client.get_job_logs(job_id)


def stop(address: str, job_id: str) -> bool:
    """Ask the job to stop; False when it had already ended. A stopped sweep is marked interrupted."""
    client, url = _client(address)
    with _api_errors(url, job_id):
        return bool(client.stop_job(job_id))


def wait(address: str, job_id: str, timeout_s: float | None) -> str:
    """Block until the job ends and return its terminal status (SUCCEEDED, FAILED or STOPPED).

    ``timeout_s=None`` waits without limit; otherwise a job still running after ``timeout_s`` seconds
    raises ``HeadsweepError`` (the job itself keeps running).
    """
    client, url = _client(address)
    return _wait_for(client, url, job_id, timeout_s)


def follow(address: str, job_id: str, timeout_s: float | None = None) -> None:
    """Wait for the job; raise ``HeadsweepError`` with its last log line unless it SUCCEEDED."""
    client, url = _client(address)
    _follow(client, url, job_id, timeout_s)


def _follow(client: Any, url: str, job_id: str, timeout_s: float | None) -> None:
    final = _wait_for(client, url, job_id, timeout_s)
    if final == "SUCCEEDED":
        return
    with _api_errors(url, job_id):
        why = _why(final, client.get_job_info(job_id))
        # A lost driver printed no last line; else the job's last line is the one that says why (`headsweep: error:
        # ...`, a traceback's last line).
        lost = why is not None and why.startswith("the job's driver was lost")
        tail = [] if lost else [line for line in client.get_job_logs(job_id).splitlines() if line.strip()]
    detail = f": {why}" if lost else f": {tail[-1].strip()[:300]}" if tail else ""
    raise HeadsweepError(
        f"job {job_id} ended {final}{detail} (headsweep jobs logs {job_id} --address {url} shows its output)"
    )


def _wait_for(client: Any, url: str, job_id: str, timeout_s: float | None) -> str:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.5
    while True:
        with _api_errors(url, job_id):
            st = client.get_job_status(job_id)
        st = str(getattr(st, "value", st))
        if st in TERMINAL:
            return st
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HeadsweepError(f"job {job_id} is still {st} after {timeout_s:g} s")
            pause = min(pause, left)
        time.sleep(pause)
        pause = min(pause * 1.5, 5.0)  # quick for short jobs, light on the API for day-long sweeps


def format_jobs(jobs: list[dict]) -> str:
    """``list_jobs`` as an aligned text table (what ``headsweep jobs list`` prints)."""
    header = ["job_id", "status", "start_time", "end_time", "config", "store"]
    rows = [
        [
            j["job_id"],
            j["status"],
            j["start_time"] or "",
            j["end_time"] or "",
            j["metadata"].get("headsweep_config", ""),
            j["metadata"].get("headsweep_store", ""),
        ]
        for j in jobs
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])
    return "\n".join(lines)
