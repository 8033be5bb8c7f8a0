"""The code version recorded with every run: package version plus git commit when known."""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path


@functools.cache
def code_version() -> str:
    try:
        version = metadata.version("headsweep")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return version
    if commit.returncode != 0:
        return version
    return f"{version}+g{commit.stdout.strip()}{'.dirty' if dirty.stdout.strip() else ''}"
