"""What every benchmark shares: its command line's ``--smoke`` mode, its ``RESULT`` and ``SKIP`` lines, the data
folder and the cache, and the quiet logging of the benchmarks that load fairseq.

A benchmark prints each ``RESULT <name> key=value ...`` line (``result``) the moment that part is measured, so a
crash in a later part cannot lose an earlier figure.

``--smoke`` runs a benchmark's own code path end to end on tiny sizes, in seconds, and still ends with its
``RESULT`` line(s); its figures mean nothing. ``tests/project/test_bench_smoke.py`` runs every benchmark so, which is
how a change that breaks one gets noticed. Data in smoke mode: ``smoke_data()``, a copy of the first few lines
of every file of ``../shared/data`` (same names and layout, so the benchmark reads it the way it reads the real
folder); models: tiny ones trained for seconds (``shrink``). Both are cached under ``CACHE/smoke-<key>``, apart
from the real benchmark models, so the benchmarks of one test session share them. A module whose sizes shrink in
smoke mode registers its switch with ``on_smoke``; ``enable_smoke`` runs every registered switch, so a benchmark
also shrinks the support modules it imports (``bench/multi30k.py``'s data and vocabulary, say).

This module imports nothing of ``bench`` or ``headsweep``: tests/project/test_bench_smoke.py loads it by its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
CACHE = Path(os.environ.get("HEADSWEEP_BENCH_CACHE", Path.home() / ".cache" / "headsweep" / "bench"))

# Smoke sizes. Lines kept of each data file: a training split (enough for a SentencePiece vocabulary of
# SMOKE_VOCAB pieces and a few updates) and every other file (enough for a screened run: 20 examples at least
# in its first fraction); benchmarks evaluate SMOKE_EXAMPLES of them where they can choose.
SMOKE_TRAIN_LINES = 400
SMOKE_DATA_LINES = 60
SMOKE_EXAMPLES = 12
SMOKE_VOCAB = 300
# A 1+1-layer fairseq Transformer with 2 heads a layer (6 heads over the three attention types), trained a few
# epochs of SMOKE_TRAIN_LINES pairs, at a learning rate that makes it end its hypotheses within a few tokens.
SMOKE_TRAIN = {"encoder_layers": 1, "decoder_layers": 1, "embed_dim": 32, "ffn_dim": 64, "attention_heads": 2,
               "dropout": 0.0, "lr": 1e-2, "warmup_updates": 5, "max_tokens": 2048, "max_epochs": 8,
               "max_seconds": 20.0}

SMOKE = False  # set by add_argument's --smoke (enable_smoke): the benchmarks' size functions read it
_SMOKE_SWITCHES: list[Callable[[], None]] = []


def command_line(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: described by the first line of its module docstring ``doc``, with ``--smoke``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_argument(parser)
    return parser


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--smoke`` flag every benchmark takes."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, a few seconds: checks that the benchmark's code path runs (the test "
                             "suite's mode; its figures mean nothing)")


def on_smoke(switch: Callable[[], None]) -> Callable[[], None]:
    """Register ``switch``, a module's change to its smoke sizes, for ``enable_smoke`` to run; returns it (a
    decorator)."""
    _SMOKE_SWITCHES.append(switch)
    return switch


def enable_smoke(args: argparse.Namespace) -> bool:
    """Turn smoke mode on for this process when ``args.smoke``, running every registered switch; returns it."""
    global SMOKE
    SMOKE = bool(getattr(args, "smoke", False))
    if SMOKE:
        for switch in _SMOKE_SWITCHES:
            switch()
    return SMOKE


def log(text: str) -> None:
    """Print ``text`` flushed (a benchmark's progress, in order with its subprocesses' output)."""
    print(text, flush=True)


def skip(name: str, reason: str) -> NoReturn:
    """Print ``SKIP <name>: <reason>`` and exit 0: the benchmark cannot run here (its data is absent, say)."""
    print(f"SKIP {name}: {reason}")
    sys.exit(0)


def quiet_logging() -> None:
    """Warnings and fairseq's per-step INFO lines off: a benchmark's output is its own figures."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


def read_gz(path: Path) -> list[str]:
    """The lines of a gzipped text file, without their newlines."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def result(name: str, **fields: object) -> str:
    """Print (flushed) and return the line ``RESULT <name> key=value ...``, in the order given."""
    parts = [name] + [f"{k}={v}" for k, v in fields.items()]
    bad = [p for p in parts if not str(p) or any(c.isspace() for c in str(p)) or str(p).endswith("=")]
    if bad:
        raise ValueError(f"RESULT {name}: empty or spaced fields {bad}")
    line = "RESULT " + " ".join(parts)
    print(line, flush=True)
    return line


def smoke_key() -> str:
    """Ten hex digits naming the smoke sizes: a change of sizes gets a fresh smoke cache."""
    sizes = [SMOKE_TRAIN_LINES, SMOKE_DATA_LINES, SMOKE_VOCAB, SMOKE_TRAIN]
    return hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:10]


def smoke_cache() -> Path:
    """Where smoke-mode data and models are cached (beside, never inside, the real benchmark models)."""
    return CACHE / f"smoke-{smoke_key()}"


def smoke_data() -> Path:
    """A copy of ``../shared/data`` with the first lines of each file (``train*``: SMOKE_TRAIN_LINES, others:
    SMOKE_DATA_LINES; a TSV's header counts apart), made once; the real folder's path when it is absent (so
    the benchmark skips as it does without data)."""
    if not DATA.is_dir():
        return DATA
    dest = smoke_cache() / "data"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Built in a temporary folder and renamed: a run stopped half-way leaves no partial copy behind.
    tmp = Path(tempfile.mkdtemp(prefix="data-", dir=dest.parent))
    for src in sorted(DATA.rglob("*")):
        if not src.is_file() or not src.name.endswith((".gz", ".tsv", ".txt")):
            continue
        n = SMOKE_TRAIN_LINES if src.name.startswith("train") else SMOKE_DATA_LINES
        n += src.name.endswith(".tsv")
        out = tmp / src.relative_to(DATA)
        out.parent.mkdir(parents=True, exist_ok=True)
        opener = gzip.open if src.name.endswith(".gz") else open
        with opener(src, "rt", encoding="utf-8", newline="") as f:
            lines = [line for _, line in zip(range(n), f, strict=False)]
        with opener(out, "wt", encoding="utf-8", newline="") as f:
            f.writelines(lines)
    try:
        tmp.rename(dest)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def shrink(settings):
    """``settings`` (fairseq ``TrainSettings``) as they are, or in smoke mode the tiny model's."""
    return dataclasses.replace(settings, **SMOKE_TRAIN) if SMOKE else settings
