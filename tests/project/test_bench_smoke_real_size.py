"""``python -m bench.real_size --smoke`` (a real shape of each family at smoke size), in a file of its own so that the
suite's two test processes run it beside the other smoke runs (test_bench_smoke.py) rather than after them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench_smoke import OWN_FILE, SLOW_SMOKE, SMOKE, results, run_smoke


@pytest.mark.slow  # SLOW_SMOKE in test_bench_smoke.py says why
def test_real_size_smoke(tmp_path: Path) -> None:
    assert "real_size" in OWN_FILE and "real_size" in SLOW_SMOKE  # test_bench_smoke.py leaves it to this file
    proc = run_smoke("real_size", tmp_path / "bench-cache")
    assert proc.returncode == 0, (f"real_size --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    found = results(proc.stdout)
    assert [name for name, _ in found] == SMOKE["real_size"], proc.stdout[-3000:]
    assert all(fields for _, fields in found)
