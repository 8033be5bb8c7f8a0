"""A kind declares its parts: a kind defined here, with a setting, a table, a view and a report part, added by one
module and no edit of headsweep, runs through the real CLI; its rows read back from Parquet, its view through
``headsweep query``, its part appears in ``headsweep report``."""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml
from conftest import install_entry_point, run_cli

from headsweep.errors import HeadsweepError
from headsweep.results.schema import TABLES
from headsweep.results.store import ResultStore
from headsweep.results.views import VIEWS
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.experiments import KINDS, register

# The whole kind: the module a user writes, installed as a ``headsweep.kinds`` entry point, and the one name its
# config lists (``probe``).
PROBE_MODULE = textwrap.dedent('''
    """A kind outside headsweep: one row per repeat with the setting's label, a view, a report part."""

    from dataclasses import dataclass

    import pyarrow as pa

    from headsweep.errors import HeadsweepError
    from headsweep.results.schema import Table
    from headsweep.results.views import View
    from headsweep.sweep.experiments.base import Experiment


    @dataclass
    class ProbeSection:
        """The ``probe`` config section."""

        label: str = "probe"
        repeats: int = 1

        def check(self) -> None:
            if self.repeats < 1:
                raise HeadsweepError(f"probe.repeats must be at least 1, got {self.repeats}")


    class Probe(Experiment):
        name = "probe"
        section = "probe"
        settings = ProbeSection
        table = "probe_rows"
        tables = (Table("probe_rows", pa.schema([("checkpoint", pa.string()), ("label", pa.string()),
                                                 ("n_heads", pa.int32()), ("repeat", pa.int32())])),)
        views = (View("probe_summary", "CREATE VIEW probe_summary AS SELECT run_id, any_value(label) AS label, "
                                       "count(*) AS n FROM probe_rows GROUP BY run_id"),)

        def run(self, ctx):
            p = ctx.cfg.probe
            rows = [{"checkpoint": ctx.checkpoint, "label": p.label, "n_heads": len(ctx.inventory.heads),
                     "repeat": i} for i in range(p.repeats)]
            ctx.write("probe_rows", rows, name="probe")

        def report(self, part):
            rows = part.of_model("probe_rows", "repeat")
            if rows:
                part.page.add("<h4>Probe part</h4>")
                part.table(rows, [("label", "label"), ("n_heads", "heads"), ("repeat", "repeat")])


    PROBE = Probe()
''')


@pytest.fixture
def probe_module(tmp_path):
    """The kind's module on a folder of its own (a ``PYTHONPATH`` entry) with its entry point, imported here too."""
    folder = tmp_path / "kinds"
    folder.mkdir()
    (folder / "probe_kind.py").write_text(PROBE_MODULE)
    install_entry_point(folder, "headsweep.kinds", "probe", "probe_kind:PROBE")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("probe_kind", None)


@pytest.fixture
def registries():
    """The registries as they were before the test (a kind registered here leaves no table or view behind)."""
    from headsweep.results.schema import RENAMED
    from headsweep.results.views import PRUNING_CURVES
    from headsweep.sweep.configuration.sections import SECTIONS

    saved = [(r, dict(r)) for r in (KINDS, TABLES, RENAMED, VIEWS, PRUNING_CURVES, SECTIONS)]
    yield
    for registry, contents in saved:
        registry.clear()
        registry.update(contents)


def config(tiny_bert_dir, tiny_dev_tsv, experiments: list[str], **extra) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
            "sweep": {"experiments": experiments, "batch_size": 16}, **extra}


HERE = Path(__file__).parent  # test_experiment_kinds (first_heads) and conftest must import in the CLI's process


@pytest.fixture(scope="module")
def kinds_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """One CLI run of two kinds installed as entry points, for the two tests below that read it (one run instead of
    one each): ``probe`` (this module's, with its setting, table, view and report part) and ``first_heads``
    (test_experiment_kinds's, mask evaluations). Returns the folder, the store, the run id and the CLI's env."""
    tmp = tmp_path_factory.mktemp("kinds_cli")
    folder = tmp / "kinds"
    folder.mkdir()
    (folder / "probe_kind.py").write_text(PROBE_MODULE)
    install_entry_point(folder, "headsweep.kinds", "probe", "probe_kind:PROBE")
    install_entry_point(folder, "headsweep.kinds", "first_heads", "test_experiment_kinds:FIRST_HEADS")
    env = {"PYTHONPATH": os.pathsep.join([str(folder), str(HERE), str(HERE.parent)])}
    probe = {"label": "from the config", "repeats": 3}
    cfg = config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "probe", "first_heads"], probe=probe)
    cfg["sweep"]["flush_every"] = 4  # first_heads's six rows over two flushes, as test_experiment_kinds runs it
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp / "store"
    proc = run_cli("run", str(tmp / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    return tmp, store, proc.stdout.strip(), env


def test_a_kind_with_a_setting_a_table_and_a_report_part_runs_through_the_cli(kinds_run):
    tmp_path, store, run_id, env = kinds_run

    # The table, straight from its Parquet files: one row per repeat, with the config's setting.
    rows = ds.dataset(store / "probe_rows", format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted((r["run_id"], r["label"], r["n_heads"], r["repeat"]) for r in rows) == [
        (run_id, "from the config", 8, i) for i in range(3)]
    # The setting is part of the run's config and its identity.
    [run] = ResultStore(str(store)).read("runs", run_id).to_pylist()
    assert json.loads(run["config"])["probe"] == {"label": "from the config", "repeats": 3}
    assert run["status"] == "complete"

    # Its view, through the CLI (the store's runs name the kind: the reader registers it).
    query = run_cli("query", "SELECT label, n FROM probe_summary", "--store", str(store), "--format", "json", env=env)
    assert query.returncode == 0, query.stderr
    assert [json.loads(line) for line in query.stdout.splitlines()] == [{"label": "from the config", "n": 3}]

    # Its report part, in the run's section of the HTML report.
    out = tmp_path / "report"
    report = run_cli("report", run_id, "--store", str(store), "--out", str(out), env=env)
    assert report.returncode == 0, report.stderr
    page = (out / "index.html").read_text()
    assert "<h4>Probe part</h4>" in page and page.count('<td class="text">from the config</td>') == 3
    # Where the kind cannot be imported, the report says so in one line and leaves its part out.
    bare = run_cli("report", run_id, "--store", str(store), "--out", str(tmp_path / "bare"))
    assert bare.returncode == 0, bare.stderr
    assert ("headsweep: warning: experiment kind 'probe' is not installed here (no 'headsweep.kinds' entry point of "
            "that name)") in bare.stderr
    assert "Probe part" not in (tmp_path / "bare" / "index.html").read_text()


def test_a_kind_installed_as_an_entry_point_runs_through_the_cli(kinds_run, tiny_bert_dir, tiny_dev_tsv):
    """first_heads (test_experiment_kinds), installed as an entry point: its evaluations and their significance."""
    tmp_path, store, run_id, _ = kinds_run
    reader = ResultStore(str(store))
    evals = reader.read("evaluations", run_id).to_pylist()
    assert sorted(e["experiment"] for e in evals) == ["baseline"] + ["first_heads"] * 6
    assert len({s["eval_id"] for s in reader.read("significance", run_id).to_pylist()}) == 6
    # Without the entry point installed, the name is an unknown kind, even where the module can be imported.
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(
        config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "first_heads"])))
    missing = run_cli("run", str(tmp_path / "missing.yaml"), "--store", str(tmp_path / "other"),
                      env={"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])})
    assert missing.returncode == 2 and "unknown experiment kind 'first_heads' in sweep.experiments" in missing.stderr


def test_registering_the_kind_adds_its_section_table_and_view(probe_module, registries, tiny_bert_dir,
                                                               tiny_dev_tsv):
    PROBE = importlib.import_module("probe_kind").PROBE  # noqa: N806 - the kind as its module names it

    assert "probe_rows" not in TABLES and "probe_summary" not in VIEWS
    assert register(PROBE) is PROBE
    assert "probe_rows" in TABLES and "probe_summary" in VIEWS
    cfg = build_config(config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "probe"], probe={"repeats": 2}))
    assert (cfg.probe.label, cfg.probe.repeats) == ("probe", 2)
    # The section is checked like a built-in one, and belongs to the configs that name the kind.
    with pytest.raises(HeadsweepError, match="probe.repeats must be at least 1, got 0"):
        build_config(config(tiny_bert_dir, tiny_dev_tsv, ["baseline", "probe"], probe={"repeats": 0}))
    with pytest.raises(HeadsweepError, match="unknown config key 'probe'"):
        build_config(config(tiny_bert_dir, tiny_dev_tsv, ["baseline"], probe={"repeats": 2}))
    assert not hasattr(build_config(config(tiny_bert_dir, tiny_dev_tsv, ["baseline"])), "probe")
    # Another kind may not take its table under another schema, nor its section.
    clash = type(PROBE)()
    clash.name, clash.tables = "probe_clash", (type(PROBE.tables[0])("probe_rows", TABLES["runs"]),)
    with pytest.raises(HeadsweepError, match="declares results table 'probe_rows', which is another table already"):
        register(clash)
    assert "probe_clash" not in KINDS
