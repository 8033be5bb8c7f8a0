"""Export of pruned transformers models: save_pretrained directories that load back and compute the same.

The fairseq checkpoint export is tested beside the fairseq pruning checks in
test_physical_pruning.py (it reuses that module's trained model).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import tiny_classifier
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.pruning.export import choose, export_pruned
from headsweep.workers.core.gates import HeadGates, site_inventory
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_classifier.pruning import load_pruned
from headsweep.workers.families.hf_shared.pruning import save_pruned
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.pruning.removal import count_parameters

pytestmark = pytest.mark.usefixtures("one_thread")




def test_load_pruned_of_a_full_model_and_bad_weights(tmp_path):
    model = tiny_classifier("bert", "eager")
    save_pruned(model, tmp_path / "full")
    assert count_parameters(load_pruned(tmp_path / "full")) == count_parameters(model)
    # weights that do not match the recorded heads are refused, not silently reinitialised
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config["pruned_heads"] = {"0": [1]}
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsweepError, match="do not fit its pruned config"):
        load_pruned(tmp_path / "full")


def test_mask_choice_errors(tmp_path):
    inventory = site_inventory(find_sites(tiny_classifier("bert", "eager")))
    assert choose(inventory, None, None, None, None, ["self:1:3", "self:0:0"]).heads == (
        Head("self", 0, 0), Head("self", 1, 3))
    cases = [
        (dict(mask=["self:0:9"]), "out of range"),
        (dict(mask=["self:0:1"], from_run="r"), "leave out --from-run"),
        (dict(level=0.5), "--from-run RUN_ID and one of"),
        (dict(from_run="r", level=0.5, eval_id="baseline"), "one of --level / --eval-id"),
        (dict(from_run="nope", level=0.5), "has no evaluations"),
    ]
    for kwargs, message in cases:
        args = {"store": ResultStore(str(tmp_path / "store")), "from_run": None, "level": None, "eval_id": None,
                "mask": None, **kwargs}
        with pytest.raises(HeadsweepError, match=message):
            choose(inventory, **args)


def test_export_cli(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "pruned"
    proc = run_cli("export", str(tmp_path / "c.yaml"), "--mask", "self:1:0,self:0:3,self:1:2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    manifest = json.loads((out / "headsweep-export.json").read_text())
    assert manifest["heads_removed"] == ["self:0:3", "self:1:0", "self:1:2"]
    assert manifest["heads_kept"] == {"self:0": [0, 1, 2], "self:1": [1, 3]}
    assert manifest["n_params_full"] - manifest["n_params_pruned"] == 3 * 8 * (3 * 33 + 32)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    full = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).eval()
    pruned = load_pruned(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the model
    inputs = tokenizer(["the film was not good", "a fine but dull plot"], padding=True, return_tensors="pt")
    gates = HeadGates(find_sites(full))
    with torch.no_grad(), gates.masked([Head("self", 0, 3), Head("self", 1, 0), Head("self", 1, 2)]):
        gated = full(**inputs).logits
    with torch.no_grad():
        # summation order: the exported model's narrower projections; 2 layers plus the pooler and classifier
        assert_routes_agree(pruned(**inputs).logits, gated, depth=2 + 1, width=64)
    with pytest.raises(HeadsweepError, match=f"--out {out} exists and is not empty: choose a new folder"):
        export_pruned(load_config(tmp_path / "c.yaml"), out, mask=["self:0:1"])


@pytest.mark.slow  # export: test_export_cli; sweeping an export: test_causal_lm_pruning
def test_an_exported_model_is_swept_like_any_other(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """`headsweep run` on an export: its baseline is the full model under the removed mask, evaluation by
    evaluation, and only the kept heads are swept (layer 1, emptied, has none)."""
    removed = "self:0:3,self:1:0,self:1:1,self:1:2,self:1:3"
    full_cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
                "sweep": {"experiments": ["custom"], "masks": [removed.split(",")]}}
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(full_cfg))
    out = tmp_path / "pruned"
    assert run_cli("export", str(tmp_path / "full.yaml"), "--mask", removed, "--out", str(out)).returncode == 0
    pruned_cfg = {"model": {"kind": "hf_classifier", "path": str(out)}, "data": {"path": str(tiny_dev_tsv)},
                  "sweep": {"experiments": ["baseline", "single_head"]}}
    (tmp_path / "pruned.yaml").write_text(yaml.safe_dump(pruned_cfg))
    store = str(tmp_path / "store")
    runs = [run_cli("run", str(tmp_path / name), "--store", store, "--address", ray_address, "--quiet")
            for name in ("full.yaml", "pruned.yaml")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    full_id, pruned_id = (r.stdout.strip() for r in runs)
    reader = ResultStore(store)
    evals = {(e["run_id"], e["eval_id"]): e for e in reader.read("evaluations").to_pylist()}
    custom_id = "custom/" + removed
    assert evals[(pruned_id, "baseline")]["score"] == evals[(full_id, custom_id)]["score"]
    outputs = {(x["run_id"], x["eval_id"], x["example_id"]): x["output"] for x in reader.read("examples").to_pylist()}
    for (run, eval_id, example), output in outputs.items():
        if run == pruned_id and eval_id == "baseline":
            assert output == outputs[(full_id, custom_id, example)]
    swept = sorted(e for (run, e) in evals if run == pruned_id and e.startswith("single_head/"))
    assert swept == ["single_head/self:0:0", "single_head/self:0:1", "single_head/self:0:2"]
