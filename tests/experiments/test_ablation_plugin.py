"""An ablation method is one object registered by name: a method defined for this test alone
(tests/experiments/scaled_plugin.py, "scaled": a gated-off head's output times ``ablation.factor``, a setting of its
own), installed as a ``headsweep.ablations`` entry point, runs through the real CLI, and its stored per-example
losses equal weight surgery on the stock model (the head's output-projection input columns scaled by the factor, no
hooks), as the contract suite checks the built-in methods. Its setting is read, range-checked and refused like a
built-in one's, is part of the config hash, and the configuration reference's check lists it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import error_line, install_entry_point, run_cli
from scaled_plugin import DEFAULT_FACTOR, SCALED

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.configuration.reader import from_dict
from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.ablation.registry import METHODS
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import model_family

HERE = Path(__file__).parent  # the plugin's module must import in the CLI's process and its workers
ENTRY_POINT = "scaled_plugin:SCALED"
FACTOR = 0.25  # what the run sets: not the default, so a setting that never reached the workers fails the route
BATCH = 16


def write_config(folder: Path, model_dir: Path, data_file: Path, settings: dict | None = None, **sweep) -> Path:
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data_file)},
        "sweep": {"experiments": ["baseline", "single_head"], "batch_size": BATCH, "workers": 1, "reuse": False,
                  "masks_per_batch": 1, **sweep},
        "significance": {"n_resamples": 50}, **({"ablation": settings} if settings else {})}))
    return path


def surgery_losses(model_dir: Path, data_file: Path, heads: list[Head], factor: float) -> dict[Head, dict]:
    """Per head, the stock model's loss per example id with that head's input columns of its output projection
    multiplied by ``factor`` (in place, put back after), through the family's evaluation of the empty mask with the
    gate hooks taken off."""
    family = model_family("hf_classifier")
    adapter = family.load(from_dict(family.model_config, {"kind": "hf_classifier", "path": str(model_dir)}, "model"),
                          from_dict(family.data_config, {"path": str(data_file)}, "data"),
                          # the plain path: prefix reuse would keep the first weights' states
                          RuntimeOptions(batch_size=BATCH, reuse=False, masks_per_batch=1))
    ids = adapter.describe().example_ids
    adapter.gates.remove()
    sites = {s.key: s for s in adapter.gates.sites}
    out = {}
    for head in heads:
        site = sites[head.site]
        weight = site.out_proj.weight  # nn.Linear: (out, in); the head's inputs are a slice of its columns
        span = slice(head.head * site.head_dim, (head.head + 1) * site.head_dim)
        saved = weight.detach()[:, span].clone()
        with torch.no_grad():
            weight[:, span] *= factor
        try:
            (result,) = adapter.evaluate([[]])
        finally:
            with torch.no_grad():
                weight[:, span] = saved
        assert result.loss is not None
        out[head] = dict(zip(ids, np.asarray(result.loss, dtype=np.float64).tolist(), strict=True))
    return out


def test_a_method_installed_as_an_entry_point_runs_through_the_cli(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    plugins = install_entry_point(tmp_path / "site", "headsweep.ablations", "scaled", ENTRY_POINT)
    env = {"PYTHONPATH": os.pathsep.join([str(plugins), str(HERE), str(HERE.parent)])}
    config = write_config(tmp_path, tiny_bert_dir, tiny_dev_tsv, {"factor": FACTOR}, ablation="scaled")
    # no --address: the embedded Ray instance's workers inherit PYTHONPATH, where the plugin is installed
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    store = ResultStore(str(tmp_path / "store"))
    [run] = store.read("runs", run_id).to_pylist()
    assert run["ablation"] == "scaled"
    assert json.loads(run["config"])["ablation"]["factor"] == FACTOR  # the stored config holds the method's setting
    assert json.loads(run["facts"])["ablation"] == {"method": "scaled", "keep_first": False}  # what it records
    evals = store.read("evaluations", run_id).to_pylist()
    assert {e["ablation"] for e in evals} == {"scaled"}
    singles = {Head.parse(e["heads_masked"][0]): e["eval_id"] for e in evals if e["experiment"] == "single_head"}
    stored: dict[Head, dict] = {h: {} for h in singles}
    by_eval = {eval_id: h for h, eval_id in singles.items()}
    for row in store.read("examples", run_id).to_pylist():
        if row["eval_id"] in by_eval:
            stored[by_eval[row["eval_id"]]][row["example_id"]] = row["loss"]

    heads = sorted(singles)
    scaled = surgery_losses(tiny_bert_dir, tiny_dev_tsv, heads, FACTOR)
    zeroed = surgery_losses(tiny_bert_dir, tiny_dev_tsv, heads, 0.0)
    moved = 0
    for head in heads:
        ids = sorted(scaled[head])
        assert sorted(stored[head]) == ids, head
        got = np.array([stored[head][i] for i in ids])
        want = np.array([scaled[head][i] for i in ids])
        zero = np.array([zeroed[head][i] for i in ids])
        # summation order at most: both routes multiply the same exact products (x * f w == f x * w for f a power of
        # two, in binary floating point) in projections of the same shapes; float32 rounding carried through two layers
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(head))
        # other: the route can fail: scaling the head by FACTOR is not removing it
        moved += int(not np.allclose(got, zero, rtol=1e-5, atol=1e-6))
    assert moved >= len(heads) // 2, f"scaling by {FACTOR} hardly differs from zero ablation"


def test_without_its_entry_point_the_name_is_refused(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    config = write_config(tmp_path, tiny_bert_dir, tiny_dev_tsv, {"factor": FACTOR}, ablation="scaled")
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"),
                   env={"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_line(proc.stderr).startswith("headsweep: error: unknown sweep.ablation 'scaled' (known: zero, mean, "
                                              "resample, optimal, patch")
    assert not (tmp_path / "store").exists()


def test_a_bad_value_of_its_setting_is_refused_in_one_line(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    """Refused by the CLI in one line (exit 2, no traceback) before Ray starts, nothing written, as a built-in
    method's setting out of its range is."""
    plugins = install_entry_point(tmp_path / "site", "headsweep.ablations", "scaled", ENTRY_POINT)
    config = write_config(tmp_path, tiny_bert_dir, tiny_dev_tsv, {"factor": 1.5}, ablation="scaled")
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"),
                   env={"PYTHONPATH": os.pathsep.join([str(plugins), str(HERE), str(HERE.parent)])})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert error_line(proc.stderr) == "headsweep: error: ablation.factor must be in [0, 1), got 1.5"
    assert "workers ready" not in proc.stderr
    assert not (tmp_path / "store").exists()


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The method installed as an entry point on this process's path (as pip installs it), not registered yet;
    taken out of the registry again after the test."""
    monkeypatch.syspath_prepend(str(install_entry_point(tmp_path / "site", "headsweep.ablations", "scaled",
                                                        ENTRY_POINT)))
    assert SCALED.name not in METHODS
    try:
        yield
    finally:
        METHODS.pop(SCALED.name, None)


def test_its_setting_is_part_of_the_config_hash_and_of_the_reference(installed, tmp_path):
    """Its setting under another method is refused naming it (found among the installed methods), and another
    method's setting under it likewise; ``ablation.factor`` away from its default changes the config's identity (at
    it, the identity is that of the config without it); the built-in methods' configs keep theirs; the configuration
    reference's check (the keys, defaults and ranges tests/project/test_docs.py compares docs/configuration.md with)
    lists the setting for a config naming the method, and a page without its row fails that check."""
    from project.test_docs import CONFIGURATION, code_keys, code_ranges, compare, documented_keys

    def config(method: str, **ablation) -> dict:
        return {"model": {"kind": "hf_classifier", "path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.tsv")},
                "sweep": {"ablation": method}, **({"ablation": ablation} if ablation else {})}

    mean = build_config(config("mean"))
    for method, key, owner in (("mean", "factor", "scaled"), ("scaled", "resamples", "resample")):
        with pytest.raises(HeadsweepError) as refused:
            build_config(config(method, **{key: 4 if key == "resamples" else FACTOR}))
        assert str(refused.value) == (f"ablation.{key} is set but sweep.ablation is {method}, which does not read it: "
                                      f"it is a setting of {owner}; remove it, or set sweep.ablation: {owner}")
    assert SCALED.name in METHODS  # registered from its entry point by the first refusal

    default = build_config(config("scaled"))
    assert build_config(config("scaled", factor=DEFAULT_FACTOR)).hash() == default.hash()
    hashes = {build_config(config("scaled", factor=f)).hash() for f in (FACTOR, 0.125)}
    assert len(hashes | {default.hash()}) == 3
    assert json.loads(default.to_json())["ablation"]["factor"] == DEFAULT_FACTOR
    after = build_config(config("mean"))  # a built-in method's config is as it was before the method came
    assert after.hash() == mean.hash() and after.to_json() == mean.to_json()

    keys = code_keys("scaled")
    assert keys[("ablation",)]["ablation.factor"] == DEFAULT_FACTOR
    assert code_ranges("scaled")[(("ablation",), "ablation.factor")].text() == "in [0, 1)"
    documented, _ = documented_keys(CONFIGURATION.read_text())
    assert compare(documented, keys) == [
        "ablation: keys the code reads but docs/configuration.md does not document: ablation.factor"]


@dataclass(frozen=True)
class Undefaulted:
    factor: float


@dataclass(frozen=True)
class KeepsFirst:
    keep_first: bool = True


@dataclass(frozen=True)
class OtherSeed:
    seed: int = 7  # resample's and optimal's seed defaults to 0


def method(name: str, **declarations) -> AblationMethod:
    return type(name.title(), (AblationMethod,), {"name": name, **declarations})()


@pytest.mark.parametrize(("declarations", "message"), [
    ({"settings": {"factor": 0.5}}, "ablation method 'odd': settings {'factor': 0.5} is not a dataclass"),
    ({"settings": Undefaulted}, "ablation method 'odd': its setting ablation.factor has no default"),
    ({"settings": KeepsFirst}, "ablation method 'odd' declares ablation.keep_first, which every method honours"),
    ({"reference": "optional"}, "ablation method 'odd' reads ablation.reference (optional) but its settings do not "
                                "declare ablation.reference"),
])
def test_a_method_whose_settings_break_the_contract_is_refused(declarations, message):
    with pytest.raises(HeadsweepError) as refused:
        METHODS.register(method("odd", **declarations))
    assert str(refused.value).startswith(message)
    assert "odd" not in METHODS


def test_a_key_two_methods_read_means_one_thing():
    """A method reading ``ablation.seed`` with another default than the built-in methods' is refused when a config
    names it, in one line; the registry is left as it was after the test."""
    from headsweep.sweep.configuration.ablation import section_for

    METHODS.register(method("seeded", settings=OtherSeed))
    try:
        with pytest.raises(HeadsweepError) as refused:
            section_for("seeded")
    finally:
        METHODS.pop("seeded")
    assert str(refused.value) == ("ablation method 'seeded' declares ablation.seed unlike resample does (type, default "
                                  "or range): one key means one thing in a config; name the setting otherwise")


# name -> (fill kind, with ablation.positions: per_position, reference, pairs, trained, fold): docs/ablation-methods.md
DECLARED = {"zero": ("none", "none", "none", False, False, "nothing"),
            "mean": ("constant", "per_position", "optional", False, False, "constants"),
            "resample": ("per_example", "per_example", "none", False, False, "refused"),
            "optimal": ("constant", "per_position", "training", False, True, "constants"),
            "patch": ("per_example", "per_example", "none", True, False, "refused")}


@pytest.mark.parametrize("name", list(DECLARED))
def test_builtin_methods_declare_what_the_docs_say(name):
    from headsweep.workers.ablation.registry import ablation_method

    method = ablation_method(name)
    assert method.name == name
    got = (method.fill_kind(AblationSpec(name)), method.fill_kind(AblationSpec(name, per_position=True)),
           method.reference, method.needs_pairs, method.trained, method.fold)
    assert got == DECLARED[name]
