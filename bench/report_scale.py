"""Benchmark: ``headsweep report`` of a run with 1,024 heads and 2,000 examples, opened in headless Chromium.

The store is synthetic, built here through ``ResultStore.write`` (no sweep): a classifier-like accuracy run of 32
layers x 32 heads, every head ablated alone, each evaluation with its 2,000 per-example rows, significance and
gradient importance rows, pruning levels and the run's inputs, plus a second run of the same model and data under
mean ablation (so the page carries the method switch). It times the report's writing (``write_report``, the
static PNG part included), measures the folder (``page_mib``: index.html and plotly.min.js, PNGs and config beside
them), then opens the page from ``file://`` in Debian's headless Chromium (``bench/browser.py``) until every
figure is drawn (``open_s``) and clicks the most harmful head's cell until its drill-down shows (``click_s``).

Targets (issue: an explorer): write < 60 s, page < 15 MB, open and click < 2 s each.

Run: ``python -m bench.report_scale`` (``--smoke``: 2 x 4 heads, 40 examples). The last line is
``RESULT report_scale heads=<n> examples=<n> write_s=<x> page_mib=<x> open_s=<x> click_s=<x>``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import browser, common
from bench.synthetic_store import build_store

LAYERS, HEADS, EXAMPLES = 32, 32, 2000
LEVELS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


@common.on_smoke
def use_smoke() -> None:
    """2 layers x 4 heads, 40 examples."""
    global LAYERS, HEADS, EXAMPLES, LEVELS
    LAYERS, HEADS, EXAMPLES, LEVELS = 2, 4, 40, [0.0, 0.5, 1.0]


def most_harmful(store_root: Path, run_id: str) -> str:
    """The head whose removal hurts most (ties by name), as the heads view says."""
    import headsweep

    with headsweep.open_store(str(store_root)) as s:
        return s.sql("SELECT name FROM heads WHERE run_id = ? ORDER BY harm DESC, name LIMIT 1", [run_id]).fetchone()[0]


def folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    args = common.command_line(__doc__).parse_args()
    common.enable_smoke(args)
    missing = browser.available()
    if missing:
        common.skip("report_scale", missing)
    from headsweep.results.store import ResultStore
    from headsweep.sweep.reporting.report import write_report

    tmp = Path(tempfile.mkdtemp(prefix="report-scale-"))
    try:
        start = time.perf_counter()
        run_ids = build_store(tmp / "store", LAYERS, HEADS, EXAMPLES, levels=LEVELS)
        common.log(f"synthetic store of {LAYERS * HEADS} heads x {EXAMPLES} examples, 2 runs: "
                   f"{time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        page = write_report(ResultStore(str(tmp / "store")), [run_ids[0]], tmp / "report")
        write_s = time.perf_counter() - start
        page_mib = folder_mib(page.parent)
        common.log(f"index.html {page.stat().st_size / 2**20:.2f} MiB, folder {page_mib:.2f} MiB")
        head = most_harmful(tmp / "store", run_ids[0])
        with browser.chromium() as driver:
            browser.open_page(driver, page)  # a first load warms the browser's caches (as a reader's second look)
            open_s = browser.open_page(driver, page)
            errors = browser.console_errors(driver)
            if errors:
                raise SystemExit(f"console errors: {errors[:3]}")
            element = f"fig-{run_ids[0]}-deltas"
            driver.execute_script(f"document.getElementById('{element}').scrollIntoView()")
            click_s = browser.click_cell(driver, element, head, run_ids[0])
        # the machine's load beside the times: on a shared machine the browser's figures move with it
        common.result("report_scale", heads=LAYERS * HEADS, examples=EXAMPLES, write_s=round(write_s, 2),
                      page_mib=round(page_mib, 2), open_s=round(open_s, 3), click_s=round(click_s, 3),
                      load1=round(os.getloadavg()[0], 1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
