"""Config files: includes, overrides, strict keys, relative paths."""

from __future__ import annotations

import pytest

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import apply_overrides, build_config, load_config, read_yaml
from headsweep.sweep.configuration.reader import settings_changed
from headsweep.sweep.configuration.sections import SignificanceSection, SweepSection


def test_include_overrides_and_relative_paths(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "base.yaml").write_text("model: {kind: hf_classifier, path: model}\ndata: {path: dev.tsv}\n"
                                        "sweep: {workers: 1, batch_size: 8}\n")
    (tmp_path / "run.yaml").write_text("include: base.yaml\nname: x\nsweep: {workers: 3}\n")
    cfg = load_config(tmp_path / "run.yaml", ["sweep.batch_size=4", "sweep.experiments=[baseline,single_head]",
                                              "significance.correction=holm"])
    assert cfg.name == "x" and cfg.sweep.workers == 3 and cfg.sweep.batch_size == 4
    assert cfg.sweep.experiments == ["baseline", "single_head"]
    assert cfg.significance.correction == "holm"
    assert cfg.model.path == str((tmp_path / "model").resolve())  # exists next to the config
    assert cfg.data.path == "dev.tsv"  # does not: left relative to the working directory
    assert cfg.hash() == load_config(tmp_path / "run.yaml", ["sweep.batch_size=4",
                                     "sweep.experiments=[baseline,single_head]",
                                     "significance.correction=holm"]).hash()
    assert cfg.hash() != load_config(tmp_path / "run.yaml").hash()


def test_every_data_section_takes_relative_paths_from_the_config_file(tmp_path):
    """``importance.data``, ``l0.data``, ``roles.data`` and ``ablation.reference`` resolve a relative path as ``data``
    does: relative to the config file where the file is there."""
    sections = {"importance": "data", "l0": "data", "roles": "data", "ablation": "reference"}
    for key in sections:
        (tmp_path / f"{key}.tsv").write_text(f"{key}\n")
    lines = [f"{key}: {{{field}: {{path: {key}.tsv}}}}" for key, field in sections.items()]
    (tmp_path / "c.yaml").write_text("model: {kind: hf_classifier, path: m}\ndata: {path: dev.tsv}\n"
                                     + "\n".join(lines) + "\n")
    merged = read_yaml(tmp_path / "c.yaml")
    assert {key: merged[key][field]["path"] for key, field in sections.items()} == \
        {key: str((tmp_path / f"{key}.tsv").resolve()) for key in sections}


def test_the_hash_leaves_out_defaults_so_new_keys_keep_old_runs_resumable():
    base = {"model": {"kind": "hf_classifier", "path": "/models/m"}, "data": {"path": "/data/dev.tsv"}}
    default = SweepSection()
    spelled = {**base, "sweep": {"workers": default.workers, "batch_size": default.batch_size,
                                 "reuse": default.reuse},
               "significance": {"alpha": SignificanceSection().alpha}}
    assert build_config(spelled).hash() == build_config(base).hash()
    changed = {**base, "sweep": {"workers": default.workers + 1}}
    assert build_config(changed).hash() != build_config(base).hash()
    # what the canonical form holds: only the settings that differ, and each section's type
    assert settings_changed(build_config(changed)) == {
        "model": {"__type__": "ClassifierModel", "path": "/models/m"},
        "data": {"__type__": "ClassifierData", "path": "/data/dev.tsv"},
        "sweep": {"__type__": "SweepSection", "workers": default.workers + 1}}
    # another family with the same (default) keys is another computation
    other = {"model": {"kind": "hf_causal_lm", "path": "/models/m"}, "data": {"path": "/data/dev.tsv"}}
    assert build_config(other).hash() != build_config(base).hash()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"kind": "hf_classifier"}, "sweeps": {}}, "unknown config key 'sweeps'"),
        ({"model": {"kind": "nope"}}, "unknown model.kind 'nope'"),
        ({"model": {"kind": "hf_classifier", "paht": "x"}}, "unknown config key 'model.paht'"),
        ({"model": {"kind": "hf_classifier"}, "sweep": {"workers": "two"}}, "'sweep.workers' must be int"),
        ({"model": {"kind": "hf_classifier"}, "sweep": {"experiments": ["custom"]}}, "needs sweep.masks"),
        ({"model": {"kind": "hf_classifier"}, "significance": {"tests": ["wilcoxon"]}}, "unknown test 'wilcoxon'"),
        ({"model": {"kind": "hf_classifier"}, "significance": {"correction": "fdr"}}, "correction 'fdr'"),
        ({"model": {"kind": "hf_classifier"}, "significance": {"alpha": 2}}, "alpha must be in (0, 1)"),
        ({}, "'model.kind' is required"),
    ],
)
def test_bad_configs(data, message):
    with pytest.raises(HeadsweepError) as err:
        build_config(data)
    assert message in str(err.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(HeadsweepError, match="config file not found"):
        read_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(HeadsweepError, match="not valid YAML"):
        read_yaml(tmp_path / "bad.yaml")
    # The message names the file, the line and the column (1-based) where the parser stopped.
    (tmp_path / "tab.yaml").write_text("model:\n  kind: hf_classifier\n\tpath: m\n")
    with pytest.raises(HeadsweepError) as err:
        read_yaml(tmp_path / "tab.yaml")
    assert f"config file {tmp_path / 'tab.yaml'} is not valid YAML: line 3, column 1: " in str(err.value)
    (tmp_path / "latin1.yaml").write_bytes("model: {kind: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(HeadsweepError, match="is not UTF-8 text"):
        read_yaml(tmp_path / "latin1.yaml")
    with pytest.raises(HeadsweepError, match="expected key=value"):
        apply_overrides({}, ["sweep.workers"])


def test_every_example_config_validates():
    from pathlib import Path

    from conftest import REPO

    files = sorted((REPO / "conf").glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        cfg = build_config(read_yaml(Path(path)))
        assert cfg.model.kind in ("hf_classifier", "fairseq_translation", "hf_causal_lm"), path
