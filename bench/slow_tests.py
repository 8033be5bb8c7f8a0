"""The suite's slow end-to-end variants (pytest marker ``slow``), kept out of ``make test``'s 20 minutes.

Each is an end-to-end variant of a code path another test in the suite covers faster (the marker's comment names
it). Run them before a release or after touching those paths: ``python -m bench.slow_tests`` (extra arguments go
to pytest). Final line: ``RESULT slow_tests passed=<n> failed=<n> seconds=<s>``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    """Run ``pytest -m slow`` from the repository root; its output, then the RESULT line; its exit status."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", *sys.argv[1:]], cwd=ROOT,
                          capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-20000:])
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error)", summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0)
    seconds = time.perf_counter() - start
    print(f"RESULT slow_tests passed={counts.get('passed', 0)} failed={failed} seconds={seconds:.0f}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
