"""Stores written by older schema versions keep reading; a store from a newer version is refused.

``tests/data/store_v1`` is a real store written by schema version 1 (see make_store_v1.py): the
tiny BERT over two checkpoints, and a tiny fairseq model (pruning within enc_dec, and globally
in a second run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from conftest import run_cli
from report_pages import parse

from headsweep.results.query import run_query
from headsweep.results.schema import SCHEMA_HISTORY, SCHEMA_VERSION, TABLES
from headsweep.results.store import ResultStore
from headsweep.results.views import VIEWS

STORE_V1 = Path(__file__).resolve().parents[1] / "data" / "store_v1"
CLASSIFIER, TRANSLATION = "20261122-180235-883e36", "20261122-180259-b00d8e"
TRANSLATION_GLOBAL = "20261122-180323-e73df3"


@pytest.fixture(scope="module")
def v1() -> ResultStore:
    return ResultStore(str(STORE_V1))


def test_fixture_is_version_1_and_small(v1):
    runs = v1.read("runs").to_pylist()
    assert sorted(r["run_id"] for r in runs) == sorted([CLASSIFIER, TRANSLATION, TRANSLATION_GLOBAL])
    assert {r["schema_version"] for r in runs} == {1} and {r["status"] for r in runs} == {"complete"}
    assert sum(p.stat().st_size for p in STORE_V1.rglob("*") if p.is_file()) < 400_000


def test_every_version_says_what_it_changed():
    assert sorted(SCHEMA_HISTORY) == list(range(1, SCHEMA_VERSION + 1))


def test_tables_read_with_todays_columns(v1):
    """Tables v1 never wrote read empty; columns its files lack read null; the rest reads as written."""
    for table, schema in TABLES.items():
        read = v1.read(table)
        assert read.column_names == ["run_id", *schema.names]
        folder = STORE_V1 / table
        if not folder.is_dir():
            assert read.num_rows == 0, table
            continue
        written = ds.dataset(folder, format="parquet", partitioning="hive").to_table()
        assert read.num_rows == written.num_rows > 0
        for name in schema.names:
            if name not in written.column_names:
                assert read.column(name).null_count == read.num_rows, (table, name)
        # The same rows as pyarrow reads straight from the files.
        common = ["run_id", *(n for n in written.column_names if n in schema.names)]
        assert rows(read.select(common)) == rows(written.select(common)), table


def rows(table) -> list[str]:
    return sorted(json.dumps(r, default=str, sort_keys=True) for r in table.to_pylist())


def test_views_on_the_v1_store(v1):
    # A view over tables a v1 store already had shows its rows; `roles` (head_roles, schema v3) is
    # queryable and empty there.
    for view in VIEWS:
        n = run_query(v1, f"SELECT count(*) AS n FROM {view}").column("n")[0].as_py()
        assert (n == 0) if view == "roles" else (n > 0), view
    heads = run_query(v1, "SELECT run_id, checkpoint, name FROM heads").to_pylist()
    # 8 heads x 2 checkpoints for the classifier; 24 heads (3 attention types) for each translation run.
    assert len(heads) == 16 + 24 + 24 == len({tuple(h.values()) for h in heads})
    layers = run_query(v1, "SELECT run_id, attention, layer, best_head FROM layers").to_pylist()
    assert len(layers) == 2 * 2 + 3 * 2
    pruning = run_query(v1, "SELECT run_id, scope, attention FROM pruning").to_pylist()
    assert sorted({(p["run_id"], p["scope"], p["attention"]) for p in pruning}) == [
        (CLASSIFIER, "global", None), (TRANSLATION, "enc_dec", "enc_dec"), (TRANSLATION_GLOBAL, "global", None)]
    assert len(pruning) == 2 * 3 + 5 + 3


def test_runs_query_and_report_commands_on_the_v1_store(tmp_path):
    runs = run_cli("runs", "--store", str(STORE_V1), "--format", "json")
    assert runs.returncode == 0, runs.stderr
    rows = {r["run_id"]: r for r in map(json.loads, runs.stdout.splitlines())}
    assert set(rows) == {CLASSIFIER, TRANSLATION, TRANSLATION_GLOBAL}
    assert (rows[CLASSIFIER]["n_checkpoints"], rows[CLASSIFIER]["n_heads"]) == (2, 8)
    assert rows[TRANSLATION]["metric"] == "bleu" and rows[TRANSLATION]["n_heads"] == 24
    # Runs written before weights were fingerprinted: compared as before (one model by its name), no warning.
    compared = run_cli("compare", TRANSLATION, TRANSLATION_GLOBAL, "--store", str(STORE_V1), "--format", "csv")
    assert compared.returncode == 0 and "warning" not in compared.stderr, compared.stderr
    query = run_cli("query", "SELECT count(*) AS n FROM efficiency", "--store", str(STORE_V1), "--format", "csv")
    assert query.returncode == 0 and query.stdout.split() == ["n", "0"], query.stderr
    out = tmp_path / "report"
    report = run_cli("report", CLASSIFIER, TRANSLATION, TRANSLATION_GLOBAL, "--store", str(STORE_V1), "--out", str(out))
    assert report.returncode == 0, report.stderr
    links = parse(Path(report.stdout.strip()))
    assert len(links.images) == 2 * 2 + 1 + 2 + 1 + 1 + 1  # classifier, translation, global (no single-head run)
    for name in [i["src"] for i in links.images] + links.links:
        assert (out / name).is_file(), name
    text = " ".join(links.text)
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0" in text  # the sacrebleu signature
    # The global run's figure also draws the enc_dec curve of the other run of the same model and data.
    assert f"enc_dec (run {TRANSLATION})" in text


def test_a_store_from_a_newer_version_is_refused(tmp_path):
    store_dir = tmp_path / "store"
    shutil.copytree(STORE_V1, store_dir)
    store = ResultStore(str(store_dir))
    [row] = store.read("runs", CLASSIFIER).to_pylist()
    store.write_rows("runs", "future-run", [{**row, "schema_version": SCHEMA_VERSION + 1}], "run")
    expected = (f"headsweep: error: store {store_dir} holds runs written with results schema version "
                f"{SCHEMA_VERSION + 1}; this headsweep reads versions 1 to {SCHEMA_VERSION}: upgrade headsweep to "
                "read it\n")
    for args in (["runs"], ["report", CLASSIFIER, "--out", str(tmp_path / "r")]):
        proc = run_cli(*args, "--store", str(store_dir))
        assert (proc.returncode, proc.stderr) == (2, expected), args


def test_readme_documents_every_column_of_every_table_and_view(v1):
    lines = (Path(__file__).resolve().parents[2] / "results" / "README.md").read_text().splitlines()
    columns = {name: schema.names for name, schema in TABLES.items()}
    columns.update({view: run_query(v1, f"SELECT * FROM {view} LIMIT 0").column_names for view in VIEWS})
    for name, names in columns.items():
        [row] = [line for line in lines if line.startswith(f"| `{name}` |")]
        assert [c for c in names if f"`{c}`" not in row] == [], name
