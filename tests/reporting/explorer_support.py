"""What the explorer tests share: bench/browser.py and bench/synthetic_store.py loaded by their paths (the suite does
not put the repository root on sys.path), and the SQL that names a head's most harmed example straight from the
store (the independent route for the drill-downs and ``Store.head``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` loaded by its path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# An accuracy run's examples in the order the drill-down lists those a head's removal makes worse: the baseline's
# correct minus the masked one's (positive: harmed), most first, ties by example id; ``?``: run, head's eval id,
# baseline's eval id.
WORST_EXAMPLES_SQL = """
SELECT m.example_id, b.stats[1] - m.stats[1] AS harm, m.output, b.output AS baseline_output
FROM examples m JOIN examples b ON b.run_id = m.run_id AND b.example_id = m.example_id
WHERE m.run_id = ? AND m.eval_id = ? AND b.eval_id = ? AND b.stats[1] - m.stats[1] > 0
ORDER BY harm DESC, m.example_id
"""
