"""What weights a run was made with: a content fingerprint of the model's weight files, kept in ``runs.facts``.

A model folder (or a fairseq checkpoint) may be overwritten in place after a run, with the same shapes: the run's
config still names it, so every later use of the run (``export --from-run``, ``report --attention``, resuming it)
would read weights that are not the run's without a word. The driver stores, per model of the run, the SHA-256 of its
weight files (``facts.weights``: ``[{model, sha256, bytes}]``, one entry per training checkpoint) and every later use
compares it with the files as they are now (:func:`check_same_weights`). A run written before fingerprints were kept
has none and is used as before.

Hashing reads every byte (0.8 to 3.6 s per 500 MB on a shared 2-core machine), so a file's digest is cached under
headsweep's cache keyed by its path, size, inode and modification and change times: a file written since (whatever
its mtime says: writing it moves its ctime) is hashed again, an unchanged one costs a ``stat``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.families.registry import model_family

CACHE_NAME = "weights-sha256.json"


def run_models(cfg: Any) -> list[tuple[str | None, Any]]:
    """``(checkpoint, model config)`` for each model of a run of ``cfg``: one, or one per training checkpoint."""
    if not cfg.checkpoints:
        return [(None, cfg.model)]
    key = model_family(cfg.model.kind).checkpoint_key
    return [(c, dataclasses.replace(cfg.model, **{key: c})) for c in cfg.checkpoints]


def _cache_path() -> Path:
    return Path(os.environ.get("HEADSWEEP_CACHE") or Path.home() / ".cache" / "headsweep") / CACHE_NAME


def _key(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_cache() -> dict[str, Any]:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache: dict[str, Any]) -> None:
    """Best effort: a cache that cannot be written costs the next command one more hash, nothing else."""
    path = _cache_path()
    cache = {f: entry for f, entry in cache.items() if os.path.exists(f)}  # files since deleted: forgotten
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_NAME}.", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(cache, out)
        os.replace(tmp, path)


def file_sha256(path: Path, cache: dict[str, Any] | None = None) -> str:
    """The SHA-256 of ``path``'s bytes (links followed), from ``cache`` where the file is unchanged since."""
    real = os.path.realpath(path)
    key = _key(os.stat(real))
    known = (cache or {}).get(real)
    if isinstance(known, dict) and known.get("key") == key and isinstance(known.get("sha256"), str):
        return known["sha256"]
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if cache is not None:
        cache[real] = {"key": key, "sha256": digest}
    return digest


def model_fingerprint(model_cfg: Any, cache: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``{model, sha256, bytes}`` of the weight files of ``model_cfg``'s model (a transformers folder or a hub id's
    cached snapshot: the files ``from_pretrained`` loads; a fairseq checkpoint file), or None where its family names
    no weight files (a plugin) or they cannot be read (loading the model then says why)."""
    family = model_family(model_cfg.kind)
    try:
        files = family.weight_files(model_cfg)
    except HeadsweepError:
        return None
    if not files:
        return None
    own = cache if cache is not None else _read_cache()
    whole = hashlib.sha256()
    total = 0
    try:
        for file in files:
            whole.update(f"{file.name}\0{file_sha256(file, own)}\n".encode())
            total += file.stat().st_size
    except OSError:
        return None
    if cache is None:
        _write_cache(own)
    return {"model": str(getattr(model_cfg, family.checkpoint_key)), "sha256": whole.hexdigest(), "bytes": total}


def run_fingerprints(model_cfgs: Sequence[Any]) -> list[dict[str, Any]]:
    """The fingerprints of a run's models (one, or one per training checkpoint) for ``facts.weights``; empty where
    a family names no weight files."""
    cache = _read_cache()
    prints = [model_fingerprint(m, cache) for m in model_cfgs]
    _write_cache(cache)
    return [p for p in prints if p is not None]


def stored_fingerprints(facts: str | dict | None) -> list[dict[str, Any]]:
    """``facts.weights`` of a run row (empty for a run written before fingerprints were kept)."""
    named = json.loads(facts or "{}") if not isinstance(facts, dict) else facts
    weights = named.get("weights")
    return [w for w in weights if isinstance(w, dict) and w.get("sha256")] if isinstance(weights, list) else []


def weights_differ(facts: str | dict | None, model_cfg: Any, index: int | None = None) -> tuple[str, str] | None:
    """``(then, now)`` short fingerprints where the run whose row holds ``facts`` was made with other weights than
    ``model_cfg``'s files hold now; None where they are the same, or either side has no fingerprint.

    ``index``: which of the run's models (training checkpoints) ``model_cfg`` is; None: the one whose file or folder
    it names (else the first)."""
    stored = stored_fingerprints(facts)
    if not stored:
        return None
    now = model_fingerprint(model_cfg)
    if now is None:
        return None
    if index is not None and index < len(stored):
        then = stored[index]
    else:
        then = next((s for s in stored if s.get("model") == now["model"]), stored[0])
    if then["sha256"] == now["sha256"]:
        return None
    return then["sha256"][:12], now["sha256"][:12]


def check_same_weights(run: dict, model_cfg: Any, use: str, index: int | None = None) -> None:
    """Refuse, in one line, ``use`` of ``run`` (a runs row) with weights other than those it was made with."""
    differ = weights_differ(run.get("facts"), model_cfg, index)
    if differ is None:
        return
    family = model_family(model_cfg.kind)
    where = getattr(model_cfg, family.checkpoint_key)
    raise HeadsweepError(
        f"run {run['run_id']} was made with other weights than {where} holds now (weights sha256 {differ[0]}... then, "
        f"{differ[1]}... now: the files were changed since): {use}; put the run's weights back, or run the config "
        "again with --new for results of these weights")


def same_run_weights(facts: str | dict | None, prints: Sequence[dict[str, Any]]) -> bool:
    """Whether a run whose row holds ``facts`` was made with the weights ``prints`` (:func:`run_fingerprints`) name;
    True where either side has none to compare."""
    stored = [w["sha256"] for w in stored_fingerprints(facts)]
    now = [w["sha256"] for w in prints]
    return not stored or not now or stored == now


def check_resumed_weights(run: dict, prints: Sequence[dict[str, Any]]) -> None:
    """Refuse to continue ``run`` (a runs row) with other weights than those its stored evaluations were made with:
    the rest would be evaluations of another model under the same run id."""
    if same_run_weights(run.get("facts"), prints):
        return
    then = ", ".join(w["sha256"][:12] + "..." for w in stored_fingerprints(run.get("facts")))
    now = ", ".join(w["sha256"][:12] + "..." for w in prints)
    models = ", ".join(str(w["model"]) for w in prints)
    raise HeadsweepError(
        f"run {run['run_id']} of this config was made with other weights than {models} holds now (weights sha256 "
        f"{then} then, {now} now: the files were changed since): continuing it would mix two models' results in one "
        "run; put the run's weights back to continue it, or add --new for a run of these weights")


def check_run_weights(run: dict, cfg: Any, use: str) -> None:
    """Refuse ``use`` of ``run`` (a runs row; ``cfg``: its config, read back) where any of its models' files hold
    other weights now than when it ran; a run without fingerprints is let through."""
    for index, (_, model_cfg) in enumerate(run_models(cfg)):
        check_same_weights(run, model_cfg, use, index)
