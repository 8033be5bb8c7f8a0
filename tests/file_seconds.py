"""Each test file's summed test time, which the suite's scheduling reads (``tests/conftest.py``: with
``--dist loadfile`` the longest files go first, so that the last file handed to a process is short and neither
process waits long for the other at the end).

Refresh it from a full run's durations: ``pytest -n 2 --dist loadfile --durations=0 > LOG`` then
``python tests/file_seconds.py LOG``, and commit ``tests/file_seconds.json``. A file missing from it (a new one)
counts as :data:`UNKNOWN_S`."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
UNKNOWN_S = 10.0
DURATION = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::")


def read_table() -> dict[str, float]:
    """``{tests/path.py: seconds}`` as last written; empty where there is no table."""
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


def from_log(text: str) -> dict[str, float]:
    """Summed setup, call and teardown seconds per file, from pytest's ``--durations=0`` lines."""
    seconds: Counter[str] = Counter()
    for line in text.splitlines():
        match = DURATION.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {path: round(s, 1) for path, s in sorted(seconds.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/file_seconds.py LOG (a pytest --durations=0 output)")
    table = from_log(Path(sys.argv[1]).read_text())
    if not table:
        sys.exit(f"{sys.argv[1]} has no --durations=0 lines")
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s summed: {TABLE}")
