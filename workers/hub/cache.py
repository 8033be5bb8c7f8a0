"""Models named by Hugging Face Hub id, read from the local cache with no network call; and ``headsweep fetch``.

``model.path: Qwen/Qwen2.5-0.5B`` (or ``gpt2``, or ``org/name@revision``) names the snapshot that
``huggingface_hub`` keeps in its cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``)::

    models--org--name/refs/main                 the commit a branch or tag points at
    models--org--name/snapshots/<commit>/...    the files of that commit (links into blobs/)

The revision is a branch or tag name with a file under ``refs/``, or a commit (its 40 hex digits, or a
prefix of at least ``MIN_PREFIX`` that only one cached commit starts with); none given means ``main``.
Resolving reads only the file system. :func:`fetch` (``headsweep fetch``) is the only code that downloads.

A run pins what it resolved (:func:`headsweep.sweep.models.hub_pins.pin_hub_models`): the config's id becomes
``id@<commit>``, so the config hash (the run's identity) follows the commit (a run against another revision, or
against ``main`` after it moved, is another run) and every worker loads that very commit from its own cache.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

MIN_PREFIX = 4  # as git: a shorter commit prefix is refused
SHA = re.compile(r"[0-9a-f]{40}")
HEX = re.compile(r"[0-9a-f]+")
# huggingface_hub's repo id rule (validate_repo_id): [namespace/]name of word characters, '-' and '.', up to
# 96 each, no '--' or '..', not starting or ending with '-' or '.'.
REPO_ID = re.compile(r"(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?")
# Copies of the weights in other frameworks' formats, and Meta's original checkpoints (Llama's
# original/consolidated.pth doubles the download): transformers loads none of them.
NOT_LOADED = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "onnx/*", "*.tflite", "*.mlmodel",
              "coreml/*", "openvino/*", "*.gguf", "original/*", "flax_model*", "tf_model*", "rust_model*"]
# With safetensors weights in the repository, the same weights in PyTorch's pickle format.
PICKLED_WEIGHTS = ["pytorch_model*.bin", "*.pt", "*.pth"]


@dataclass(frozen=True)
class Snapshot:
    """A model revision found in the local cache."""

    repo_id: str
    requested: str | None  # the revision as written (None: main)
    revision: str  # the commit it resolved to
    folder: Path

    @property
    def pinned(self) -> str:
        """``repo_id@<commit>``: what a run records and its workers load."""
        return f"{self.repo_id}@{self.revision}"

    def facts(self) -> dict[str, Any]:
        """What ``runs.facts`` records of it."""
        return {"id": self.repo_id, "requested": self.requested or "main", "revision": self.revision,
                "folder": str(self.folder)}


def hub_cache_dir() -> Path:
    """The cache folder, by huggingface_hub's rule, read from the environment now (its ``constants`` are read
    once, at import)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                              "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``spec`` is written like a hub id (``name``, ``org/name``,
    ``org/name@revision``), else None (a path). Whether a local path of that name exists is the caller's
    question: a folder that exists is always taken as a folder."""
    if not spec or spec.startswith((".", "/", "~", "-")) or "\\" in spec:
        return None
    repo_id, at, revision = spec.partition("@")
    if not REPO_ID.fullmatch(repo_id) or repo_id.endswith((".", "-")) or "/." in repo_id or "/-" in repo_id:
        return None
    if at and (not revision or revision.startswith("/") or ".." in revision.split("/")):
        raise HeadsweepError(f"{spec!r}: the revision after '@' must be a branch, tag or commit of {repo_id} "
                             "(e.g. main, v1.0, or a commit's hex digits)")
    return repo_id, (revision if at else None)


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` names a hub model rather than a local path (it does not exist on disk, and reads as an
    id)."""
    return bool(spec) and not Path(spec).expanduser().exists() and parse_hub_id(spec) is not None


def model_label(path: str) -> str:
    """What ``runs.model`` shows for ``model.path``: a folder's name, or for a hub id (pinned to its commit by the
    driver) ``org/name@<first 7 of the commit>`` (the whole commit is in ``runs.facts.hub``)."""
    if is_hub_id(path):
        repo_id, revision = parse_hub_id(path)
        return f"{repo_id}@{revision[:7]}" if revision else repo_id
    return Path(path).name


def fetch_command(repo_id: str, revision: str | None) -> str:
    """The command that puts ``repo_id`` at ``revision`` into the cache."""
    return f"headsweep fetch {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_snapshot(spec: str, require: str | None = "config.json") -> Snapshot:
    """The cached snapshot ``spec`` (a hub id, see :func:`parse_hub_id`) names, without any network call.

    ``require``: a file the snapshot must hold (``config.json`` for a model; None for a tokenizer folder).
    Raises a one-line :class:`HeadsweepError` that names ``headsweep fetch`` when the model or revision is
    not cached.
    """
    parsed = parse_hub_id(spec)
    if parsed is None:
        raise HeadsweepError(f"{spec!r} is not a Hugging Face Hub model id (org/name, name, or org/name@revision)")
    repo_id, requested = parsed
    cache = hub_cache_dir()
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    fetch = fetch_command(repo_id, requested)
    if not (repo_dir / "snapshots").is_dir():
        raise HeadsweepError(
            f"model {spec!r} is neither a local folder nor in the Hugging Face cache ({cache}); runs never "
            f"download: fetch it with `{fetch}` (or set the path to a local save_pretrained folder)"
        )
    revision = requested or "main"
    commit = _commit(repo_dir, revision)
    if commit is None:
        raise HeadsweepError(
            f"revision {revision!r} of {repo_id} is not in the Hugging Face cache ({repo_dir}): cached are "
            f"{_cached_revisions(repo_dir)}; fetch it with `{fetch}` or name one of those"
        )
    folder = repo_dir / "snapshots" / commit
    if not folder.is_dir():
        raise HeadsweepError(f"{repo_id} {revision} points at commit {commit}, whose snapshot is not in the cache "
                             f"({folder}): fetch it again with `{fetch}`")
    if require and not (folder / require).is_file():
        raise HeadsweepError(f"the cached snapshot of {repo_id} at {revision} ({folder}) has no {require}: an "
                             f"interrupted download (fetch it again with `{fetch}`) or not a transformers model")
    return Snapshot(repo_id, requested, commit, folder)


def _commit(repo_dir: Path, revision: str) -> str | None:
    """The commit ``revision`` names in the cache: a ref's commit, or the one cached commit it is a prefix of."""
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if not SHA.fullmatch(commit):
            raise HeadsweepError(f"{ref} does not hold a commit hash (a damaged cache?): fetch the model again")
        return commit
    if len(revision) < MIN_PREFIX or not HEX.fullmatch(revision):
        return None
    matches = sorted(d.name for d in (repo_dir / "snapshots").iterdir() if d.name.startswith(revision))
    if len(matches) > 1:
        raise HeadsweepError(f"revision {revision!r} is the start of {len(matches)} cached commits of "
                             f"{repo_dir.name} ({', '.join(matches)}): give more of its digits")
    return matches[0] if matches else None


def _cached_revisions(repo_dir: Path) -> str:
    """``main (1a2b3c4d5e6f), v2 (...)``, then cached commits no ref names; or ``none``."""
    named: dict[str, str] = {}
    refs = repo_dir / "refs"
    if refs.is_dir():
        for ref in sorted(p for p in refs.rglob("*") if p.is_file()):
            named[ref.relative_to(refs).as_posix()] = ref.read_text(encoding="utf-8").strip()
    listed = [f"{name} ({commit[:12]})" for name, commit in named.items()]
    listed += sorted(d.name for d in (repo_dir / "snapshots").iterdir() if d.name not in named.values())
    return ", ".join(listed) or "none"


def fetch(spec: str, revision: str | None = None, say=print) -> Snapshot:
    """Download ``spec`` (a hub id, optionally ``@revision``) at ``revision`` into the cache through
    ``huggingface_hub``: the files transformers loads (configs, tokenizer, weights: safetensors when the
    repository has them, else PyTorch's), not other frameworks' copies. ``say`` gets one status line.

    Offline (``HF_HUB_OFFLINE``) or with no network: a one-line :class:`HeadsweepError`.
    """
    parsed = parse_hub_id(spec)
    if parsed is None:
        raise HeadsweepError(f"{spec!r} is not a Hugging Face Hub model id (org/name or name, optionally @revision)")
    repo_id, at_revision = parsed
    if at_revision and revision and at_revision != revision:
        raise HeadsweepError(f"two revisions given: {spec} and --revision {revision}: give one")
    revision = revision or at_revision
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cache = hub_cache_dir()
    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        files = [s.rfilename for s in info.siblings or []]
        ignore = NOT_LOADED + (PICKLED_WEIGHTS if any(f.endswith(".safetensors") for f in files) else [])
        size = sum(s.size or 0 for s in info.siblings or [] if not _ignored(s.rfilename, ignore))
        say(f"headsweep: fetching {repo_id} at {revision or 'main'} (commit {info.sha}, {size / 1e9:.2f} GB) "
            f"into {cache}")
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, ignore_patterns=ignore)
    except OfflineModeIsEnabled:
        raise HeadsweepError(f"cannot fetch {repo_id}: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, and "
                             "fetching downloads from the Hugging Face Hub: unset it on a machine with network "
                             "access (or copy a cache that holds the model into HF_HUB_CACHE)") from None
    except HfHubHTTPError as exc:  # no such repository or revision, gated, server error: the Hub's own words
        raise HeadsweepError(f"cannot fetch {repo_id}{f' at {revision}' if revision else ''}: "
                             f"{_first_line(exc)}") from None
    except Exception as exc:
        # LocalEntryNotFoundError: the connection failed mid-way and the files are not all cached.
        if not (isinstance(exc, LocalEntryNotFoundError) or _network_error(exc)):
            raise
        raise HeadsweepError(f"cannot fetch {repo_id}: the Hugging Face Hub ({_endpoint()}) cannot be reached "
                             f"({type(exc).__name__}: {_first_line(exc)}); fetch needs network access (or copy a "
                             "cache that holds the model into HF_HUB_CACHE)") from None
    folder = Path(folder)
    return Snapshot(repo_id, revision, folder.name, folder)


def _ignored(name: str, patterns: list[str]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in patterns)


def _network_error(exc: BaseException) -> bool:
    """A connection that failed (huggingface_hub raises its HTTP client's transport errors as they are)."""
    chain = [exc, exc.__cause__, exc.__context__]
    return any(isinstance(e, (ConnectionError, TimeoutError)) or
               (e is not None and type(e).__module__.split(".")[0].startswith(("httpx", "requests", "urllib3")))
               for e in chain)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
