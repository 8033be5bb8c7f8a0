"""The explorer in a real browser: Debian's headless Chromium driven by Selenium (bench/browser.py), on the report of
the small real store (the real CLI) and of a synthetic store holding the same model under two ablation methods.

The page loads from ``file://`` with no console errors; hovering a cell shows the head's numbers as the store holds
them; clicking the most harmful head's cell opens its drill-down, whose top example is the one a SQL query over the
store names, with the input stored for it; the method switch shows the other run's deltas. Each view's screenshot is
written under the test's temporary folder (``screenshots/``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli
from explorer_support import WORST_EXAMPLES_SQL, bench_module
from small_store import small_store

import headsweep
from headsweep.results.store import ResultStore
from headsweep.sweep.reporting.plots import num
from headsweep.sweep.reporting.report import write_report

browser = bench_module("browser")
synthetic = bench_module("synthetic_store")


@pytest.fixture(scope="module")
def chrome():
    missing = browser.available()
    if missing:
        pytest.fail(f"the browser tests need Chromium and Selenium: {missing}")
    with browser.chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def small_page(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    store, run_id, checkpoints = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    out = tmp_path_factory.mktemp("explorer") / "report"
    proc = run_cli("report", run_id, "--store", str(store), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip()), str(store), run_id, checkpoints


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def worst_head(store: str, run_id: str, checkpoint: str) -> dict:
    with headsweep.open_store(store) as s:
        rows = s.sql("SELECT h.name, h.delta, h.p_adjusted, h.p_value FROM heads h WHERE run_id = ? AND checkpoint = ? "
                     "ORDER BY harm DESC, name LIMIT 1", [run_id, checkpoint]).fetchall()
    name, delta, p_adjusted, p_value = rows[0]
    return {"name": name, "delta": delta, "p_adjusted": p_adjusted, "p_value": p_value}


def test_page_loads_without_console_errors(chrome, small_page, shots):
    page, _, run_id, _ = small_page
    open_s = browser.open_page(chrome, page, everything=True)
    assert open_s > 0
    assert browser.console_errors(chrome) == []
    figures = chrome.execute_script("return Array.from(document.querySelectorAll('.plot[id]')).map(d => d.id)")
    assert f"fig-{run_id}-ckpt0-deltas" in figures and f"fig-{run_id}-pruning" in figures
    assert browser.screenshot(chrome, shots / "page.png").stat().st_size > 0


def test_hover_shows_the_heads_numbers(chrome, small_page, shots):
    page, store, run_id, checkpoints = small_page
    head = worst_head(store, run_id, checkpoints[0])
    browser.open_page(chrome, page)
    text = browser.hover_cell(chrome, f"fig-{run_id}-ckpt0-deltas", head["name"])
    assert head["name"] in text
    assert f"delta {num(head['delta'])}" in text
    assert f"p {num(head['p_value'])}, adjusted {num(head['p_adjusted'])}" in text
    browser.screenshot(chrome, shots / "hover.png")


def test_click_opens_the_drilldown_of_the_example_sql_names(chrome, small_page, shots):
    page, store, run_id, checkpoints = small_page
    head = worst_head(store, run_id, checkpoints[0])
    with headsweep.open_store(store) as s:
        worst = s.sql(WORST_EXAMPLES_SQL, [run_id, f"ckpt0/single_head/{head['name']}", "ckpt0/baseline"]).fetchall()
        inputs = dict(s.sql("SELECT example_id, input FROM inputs WHERE run_id = ?", [run_id]).fetchall())
    assert worst, "the most harmful head changes no example: the small store no longer tests the drill-down"
    browser.open_page(chrome, page)
    key = f"{run_id}-ckpt0"
    browser.click_cell(chrome, f"fig-{key}-deltas", head["name"], key)
    first = chrome.execute_script(
        "const row = document.querySelector('#drill-' + arguments[0] + ' table.examples tr.example');"
        "return Array.from(row.cells).map(c => c.textContent)", key)
    example, text = worst[0][0], inputs[worst[0][0]]
    assert first[0] == example and first[1] == text
    assert first[3] == worst[0][3] and first[4].startswith(worst[0][2])  # baseline and masked predictions
    assert browser.console_errors(chrome) == []
    browser.screenshot(chrome, shots / "drilldown.png")


def test_method_switch_shows_the_other_runs_deltas(chrome, tmp_path, shots):
    root = tmp_path / "store"
    zero, mean = synthetic.build_store(root, 2, 4, 60, levels=[0.0, 0.5, 1.0])
    page = write_report(ResultStore(str(root)), [zero], tmp_path / "report")
    browser.open_page(chrome, page)
    element = f"fig-{zero}-deltas"
    with headsweep.open_store(str(root)) as s:
        deltas = {r: s.sql("SELECT layer, head, delta FROM heads WHERE run_id = ?", [r]).fetchall()
                  for r in (zero, mean)}

    def grid(run_id):
        z = [0.0] * 8
        for layer, h, d in deltas[run_id]:
            z[4 * layer + h] = d
        return z

    def shown() -> list[float]:
        return [v for row in browser.visible_heatmap(chrome, element) for v in row]

    assert shown() == pytest.approx(grid(zero))
    browser.press_button(chrome, element, "mean ablation")
    browser.wait_for(chrome, "const d = document.getElementById(arguments[0]); return d._fullData.some("
                     "t => t.type === 'heatmap' && t.visible === true && t.name.startsWith('mean'))".replace(
                         "arguments[0]", repr(element)))
    assert shown() == pytest.approx(grid(mean))
    assert grid(mean) != grid(zero)
    assert browser.console_errors(chrome) == []
    browser.screenshot(chrome, shots / "method-switch.png", element)


def test_pruning_band_is_the_baseline_plus_each_levels_interval(small_page):
    """The interactive pruning figure's band, read from the page, against the pruning levels' intervals in SQL (each
    around its own model's baseline)."""
    import json

    page, store, run_id, checkpoints = small_page
    text = page.read_text()
    start = text.index(f'data-target="fig-{run_id}-pruning">')
    figure = json.loads(text[text.index(">", start) + 1 : text.index("</script>", start)].replace("<\\/", "</"))
    with headsweep.open_store(store) as s:
        rows = s.sql("SELECT level, baseline_score + ci_low AS low, baseline_score + ci_high AS high FROM deltas "
                     "WHERE run_id = ? AND checkpoint = ? AND experiment = 'prune_level' AND eval_id LIKE "
                     "'%prune_level/global/%' ORDER BY level", [run_id, checkpoints[0]]).fetchall()
    [band] = [t for t in figure["data"] if t.get("fill") == "toself" and t["name"].startswith("global, ckpt0")]
    n = len(rows)
    assert band["x"][:n] == pytest.approx([100 * r[0] for r in rows])
    highs, lows = band["y"][:n], band["y"][n:][::-1]
    for (level, low, high), hi, lo in zip(rows, highs, lows, strict=True):
        assert (lo, hi) == pytest.approx((low, high)), level
