"""The explorer in a real browser: Debian's headless Chromium driven by Selenium (bench/browser.py), on the report of
the small real store (``headsweep report``), of a causal LM's perplexity run and of a synthetic store holding the
same model under two ablation methods.

The page loads from ``file://`` with no console errors; hovering a cell shows the head's numbers as the store holds
them; clicking the most harmful head's cell opens its drill-down, whose top example is the one a SQL query over the
store names, with the input stored for it; the method switch shows the other run's deltas. The cheap-vs-exact
scatter labels only the heads its note names, no two labels overlapping (at two window widths), and the note ranks
only heads whose exact effect is distinguishable from noise (ranks recomputed from SQL), or says that nothing
disagrees; a language model's drill-down has no column empty for every example. Each view's screenshot is written
under the test's temporary folder (``screenshots/``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from explorer_support import WORST_EXAMPLES_SQL, bench_module, mean_lm_store
from small_store import small_report, small_store

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
    """The small store's page, written by ``headsweep report`` once per session (test_report reads it too)."""
    store, run_id, checkpoints = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    page = small_report(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return page, str(store), run_id, checkpoints


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


# The labels and the note's list: "self:1:0 (#4 vs #1)" and "self:1:0 (#4 by gradient, #1 by harm)".
LABEL = re.compile(r"^(\S+) \(#(\d+) vs #(\d+)\)$")
LISTED = re.compile(r"(\w+:\d+:\d+) \(#(\d+) by gradient, #(\d+) by harm\)")

SCATTER_JS = """
const div = document.getElementById(arguments[0]);
const figure = div.getBoundingClientRect();
const note = div.nextElementSibling;
return {
  note: note && note.classList.contains('disagreement') ? note.textContent : null,
  figure: [figure.left, figure.top, figure.right, figure.bottom],
  labels: Array.from(div.querySelectorAll('g.annotation')).map(a => {
    const r = (a.querySelector('rect.bg') || a.querySelector('.annotation-text-g')).getBoundingClientRect();
    return [a.textContent, r.left, r.top, r.right, r.bottom];
  }),
};
"""


def scatter(chrome, element: str) -> dict:
    chrome.execute_script("arguments[0].scrollIntoView({block: 'start'})", chrome.find_element("id", element))
    browser.wait_for(chrome, f"return document.getElementById('{element}').dataset.drawn === 'yes'", 30)
    return chrome.execute_script(SCATTER_JS, element)


def test_scatter_labels_only_the_named_heads_and_never_overlaps(chrome, small_page, shots):
    """Each cheap-vs-exact scatter labels exactly the heads its note names, with the note's ranks, and no two label
    boxes overlap or leave the figure, at the test window's width and at a narrow one (plotly relays the figure out)."""
    page, _, run_id, checkpoints = small_page
    browser.open_page(chrome, page, everything=True)
    elements = [f"fig-{run_id}-ckpt{n}-cheap-vs-exact" for n in range(len(checkpoints))]
    labelled = 0
    try:
        for width in (1400, 900):
            chrome.set_window_size(width, 1000)
            for n, element in enumerate(elements):
                browser.wait_for(chrome, f"const d = document.getElementById('{element}'); return d._fullLayout && "
                                         f"Math.abs(d._fullLayout.width - d.getBoundingClientRect().width) < 2", 10)
                shown = scatter(chrome, element)
                labels = [LABEL.match(text).groups() for text, *_ in shown["labels"]]
                assert labels == LISTED.findall(shown["note"])
                boxes = [box for _, *box in shown["labels"]]
                left, top, right, bottom = shown["figure"]
                for i, (x0, y0, x1, y1) in enumerate(boxes):
                    assert left <= x0 and x1 <= right and top <= y0 and y1 <= bottom, (element, width, shown)
                    for (a0, b0, a1, b1) in boxes[i + 1:]:
                        assert x1 <= a0 or a1 <= x0 or y1 <= b0 or b1 <= y0, (element, width, shown["labels"])
                labelled += len(boxes)
                browser.screenshot(chrome, shots / f"cheap-vs-exact-{width}-ckpt{n}.png", element)
    finally:
        chrome.set_window_size(1400, 1000)
    assert labelled >= 2 * 3, "the small store's scatters name fewer than 3 heads: they no longer test the labels"


def test_disagreement_ranks_only_heads_distinguishable_from_noise(chrome, small_page):
    """The note under each scatter against SQL: the compared heads are those significant or with a 95% interval
    excluding zero, ranked among themselves (competition ranks, by scipy) by importance and by harm; the listed heads
    are the five whose ranks differ most, and a model where no head stands out says there is nothing to compare."""
    from scipy.stats import rankdata

    page, store, run_id, checkpoints = small_page
    browser.open_page(chrome, page)
    branches = set()
    for n, checkpoint in enumerate(checkpoints):
        with headsweep.open_store(store) as s:
            rows = s.sql("SELECT d.attention || ':' || d.layer || ':' || d.head, i.score, d.harm, d.significant, "
                         "d.ci_low, d.ci_high FROM deltas d JOIN importance i ON i.run_id = d.run_id AND "
                         "i.checkpoint = d.checkpoint AND (i.attention, i.layer, i.head) = (d.attention, d.layer, "
                         "d.head) WHERE d.run_id = ? AND d.checkpoint = ? AND d.experiment = 'single_head'",
                         [run_id, checkpoint]).fetchall()
        compared = [r for r in rows if r[3] or r[4] > 0 or r[5] < 0]
        assert len(compared) < len(rows), "every head stands out: the small store no longer tests the exclusion"
        cheap = rankdata([-r[1] for r in compared], method="min").astype(int)
        harm = rankdata([-r[2] for r in compared], method="min").astype(int)
        apart = sorted(((abs(c - h), r[0], c, h) for r, c, h in zip(compared, cheap, harm, strict=True) if c != h),
                       key=lambda t: (-t[0], t[1]))[:5]
        note = scatter(chrome, f"fig-{run_id}-ckpt{n}-cheap-vs-exact")["note"]
        if apart:
            branches.add("disagree")
            assert note.startswith("Heads where the cheap estimate and the exact answer disagree most, ranked among "
                                   f"the {len(compared)} heads whose exact effect is distinguishable from noise")
            assert LISTED.findall(note) == [(name, str(c), str(h)) for _, name, c, h in apart]
        elif compared:
            branches.add("agree")
            assert note.startswith("Nothing disagrees:")
        else:
            branches.add("nothing")
            assert note.startswith("Nothing to compare: no head's exact effect is distinguishable from noise")
            assert LISTED.findall(note) == []
    assert "disagree" in branches and branches & {"agree", "nothing"}, (
        f"the small store's two models show only {branches}: they no longer test the note's two kinds of line")


@pytest.fixture(scope="module")
def lm_page(tmp_path_factory, ray_address):
    store, run_id = mean_lm_store(tmp_path_factory, ray_address)
    page = write_report(ResultStore(str(store)), [run_id], tmp_path_factory.mktemp("lm-report") / "report")
    return page, str(store), run_id


def test_language_model_drilldown_has_no_empty_columns(chrome, lm_page, shots):
    """A perplexity run stores no outputs (SQL says so): its drill-down, opened by clicking the most harmful head's
    cell, leaves the output columns out, and every column it shows has a value in some row."""
    page, store, run_id = lm_page
    with headsweep.open_store(store) as s:
        (outputs,), = s.sql("SELECT count(*) FILTER (WHERE coalesce(output, '') <> '') FROM examples WHERE run_id = ?",
                            [run_id]).fetchall()
        (name,), = s.sql("SELECT name FROM heads WHERE run_id = ? ORDER BY harm DESC, name LIMIT 1",
                         [run_id]).fetchall()
    assert outputs == 0
    browser.open_page(chrome, page)
    browser.click_cell(chrome, f"fig-{run_id}-deltas", name, run_id)
    tables = chrome.execute_script(
        "return Array.from(document.querySelectorAll('#drill-' + arguments[0] + ' table.examples'))"
        ".map(t => Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.textContent.trim())))", run_id)
    assert tables, "the most harmful head's drill-down lists no examples: the run no longer tests this"
    for header, *body in tables:
        assert "baseline output" not in header and "output with the head masked" not in header
        assert header[:2] == ["example", "input"] and "window perplexity, baseline" in header
        assert body and all(any(row[c] for row in body) for c in range(len(header))), (header, body)
    assert browser.console_errors(chrome) == []
    browser.screenshot(chrome, shots / "lm-drilldown.png", f"drill-{run_id}")
