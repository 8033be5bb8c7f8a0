"""Which format a data file is read as: the data section's ``format`` key, else the file's suffix. Every family
that reads tabular or JSONL files names formats, and refuses an unknown one, the same way."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from headsweep.errors import HeadsweepError

# File suffix -> format (a ``.gz`` suffix is looked through where a family reads gzipped text).
SUFFIX_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def file_format(path: str | Path, given: str | None, supported: Sequence[str], key: str = "data",
                through_gz: bool = False) -> str:
    """``given`` (config key ``<key>.format``) when it is one of ``supported``, else the format the suffix of
    ``path`` names (the one before ``.gz`` with ``through_gz``); one line refusing any other."""
    if given is not None:
        if given not in supported:
            raise HeadsweepError(f"{key}.format {given!r} is not a supported format (supported: "
                                 f"{', '.join(supported)})")
        return given
    name = Path(path).name
    if through_gz:
        name = name.removesuffix(".gz")
    fmt = SUFFIX_FORMATS.get(Path(name).suffix.lower())
    if fmt not in supported:
        raise HeadsweepError(f"cannot tell the format of data file {path} from its suffix: set {key}.format to "
                             f"one of {', '.join(supported)}")
    return fmt
