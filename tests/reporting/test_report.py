"""`headsweep report` on the small real store: the page names only files that exist, the PNGs decode
at the sizes the page declares, and the figures show the view's numbers on a zero-centred scale."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from PIL import Image
from report_pages import parse
from small_store import LEVELS, small_report, small_store

from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.report_parts import figures


@pytest.fixture(scope="module")
def small(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    store, run_id, checkpoints = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return ResultStore(str(store)), run_id, checkpoints


@pytest.fixture(scope="module")
def report(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """The small store's page, written by ``headsweep report`` once per session (the explorer's browser tests read
    it too)."""
    page = small_report(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return page, parse(page)


def test_every_named_file_exists_and_pngs_decode_at_their_sizes(report, small):
    page, links = report
    _, run_id, _ = small
    names = [img["src"] for img in links.images]
    # Per checkpoint a delta and an importance heat map, and one pruning figure for the run.
    assert sorted(names) == sorted([f"{run_id}-ckpt0-deltas.png", f"{run_id}-ckpt0-importance.png",
                                    f"{run_id}-ckpt1-deltas.png", f"{run_id}-ckpt1-importance.png",
                                    f"{run_id}-pruning.png"])
    for img in links.images:
        with Image.open(page.parent / img["src"]) as png:
            png.load()  # decodes every pixel
            assert png.format == "PNG"
            assert png.size == (int(img["width"]), int(img["height"]))
    width, height, _ = figures.heatmap_size([(2, 4)])
    with Image.open(page.parent / f"{run_id}-ckpt0-deltas.png") as png:
        assert png.size == (round(width * figures.DPI), round(height * figures.DPI))
    with Image.open(page.parent / f"{run_id}-pruning.png") as png:
        assert png.size == tuple(round(x * figures.DPI) for x in figures.PRUNING_SIZE)
    assert links.links == [f"{run_id}-config.yaml"]
    for name in links.links:
        assert (page.parent / name).is_file()
    assert not re.search(r"(src|href)=\"(https?:|/)", page.read_text())  # self-contained: nothing from outside


def test_page_carries_tables_and_reproducibility_facts(report, small):
    page, links = report
    store, run_id, checkpoints = small
    text = " ".join(links.text)
    [run] = store.read("runs", run_id).to_pylist()
    for fact in (run["config_hash"], run["code_version"], "12345", "(not a BLEU run)", "small-store",
                 "All-but-one", "Pruning curves", Path(checkpoints[1]).name):
        assert fact in text, fact
    # The config file the page links to loads back as the very config the run was started with.
    assert load_config(page.parent / f"{run_id}-config.yaml").hash() == run["config_hash"]
    best = run_query(store, "SELECT best_name FROM layers").column("best_name").to_pylist()
    assert len(best) == 4 and all(b in text for b in best)
    assert text.count("global, ckpt") >= 2 * len(LEVELS)  # the pruning table, one line per level and checkpoint


def test_delta_heatmap_shows_the_view_centred_on_zero(small):
    store, run_id, checkpoints = small
    heads = run_query(store, f"SELECT * FROM heads WHERE run_id = '{run_id}' AND checkpoint = '{checkpoints[0]}'"
                      ).to_pylist()
    fig = figures.delta_heatmap(heads, ["self"], "accuracy", "none", 0.4)
    [ax] = [a for a in fig.axes if a.images]
    image = ax.images[0]
    grid = np.full((2, 4), np.nan)
    for h in heads:
        grid[h["layer"], h["head"]] = h["delta"]
    assert np.array_equal(np.ma.filled(image.get_array(), np.nan), grid)
    assert image.norm.vmin == -image.norm.vmax == -np.abs(grid).max()
    marks = [t for t in ax.texts if t.get_text().endswith(figures.SIGNIFICANT_MARK)]
    assert len(marks) == sum(bool(h["significant"]) for h in heads) > 0
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("head", "layer")
    assert "delta accuracy (fraction correct" in fig.axes[-1].get_ylabel()  # the colour bar's unit


def test_unknown_run_is_one_line_error(small, tmp_path):
    store, _, _ = small
    proc = run_cli("report", "no-such-run", "--store", store.root, "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("headsweep: error: no run 'no-such-run' in store") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "r").exists()
