"""Config identity: ``Config.hash()`` (what a run resumes by) and the stored config JSON of representative configs,
pinned as literals computed before the sweep package was restructured, so that a restructuring of the
config code provably keeps every existing run resumable and every stored ``runs.config`` the same."""

from __future__ import annotations

import hashlib
import json

import pytest

from headsweep.sweep.configuration.config import build_config

CLS = {"model": {"kind": "hf_classifier", "path": "/models/bert"}, "data": {"path": "/data/dev.tsv"}}
LM = {"model": {"kind": "hf_causal_lm", "path": "/models/llama"}, "data": {"path": "/data/wiki.txt", "window": 64}}
MT = {"model": {"kind": "fairseq_translation", "checkpoint": "/models/mt/checkpoint.pt", "data_bin": "/models/mt/bin"},
      "data": {"source": "/data/test.de", "target": "/data/test.en"}}
CASES = {
    "classifier defaults": CLS,
    "causal LM defaults": LM,
    "translation defaults": MT,
    "session-only keys left out": {**CLS, "sweep": {"budget": {"evaluations": 10}, "order": "planned"}},
    "sweep and significance": {**CLS, "name": "x", "seed": 3, "sweep": {"workers": 2, "batch_size": 8,
                                "attention": ["self"]}, "significance": {"alpha": 0.05, "correction": "holm",
                                                                          "tests": ["paired_bootstrap"]}},
    "custom masks": {**CLS, "sweep": {"masks": [["self:0:0", "self:0:1"]]}},
    "roles": {**CLS, "sweep": {"experiments": ["baseline", "roles"]},
              "roles": {"relations": ["dobj", "amod"], "offsets": [-2, 1], "rare_top": 100,
                        "data": {"path": "/data/roles.tsv"}}},
    "l0": {**CLS, "sweep": {"experiments": ["baseline", "l0"]},
           "l0": {"lambdas": [0.0, 0.1], "data": {"path": "/data/train.tsv"}, "steps": 50, "train": "all",
                  "model_lr": 0.001, "attention": ["self"]}},
    "pairs": {**CLS, "sweep": {"experiments": ["baseline", "single_head", "pairs"]},
              "pairs": {"select": "single_head", "top_k": 4, "scope": "layer"}},
    "importance and prune": {**CLS, "sweep": {"experiments": ["baseline", "importance", "prune_level"]},
                             "importance": {"method": "gradient", "data": {"path": "/data/train.tsv"},
                                            "normalize": False},
                             "prune": {"levels": [0.0, 0.5], "min_heads_per_layer": 1}},
    "screen": {**CLS, "sweep": {"experiments": ["baseline", "single_head"], "screen": {"equivalence": 0.01}}},
    "efficiency": {**CLS, "sweep": {"experiments": ["baseline", "efficiency"]},
                   "efficiency": {"mask": ["self:0:0"], "batch_sizes": [1, 8], "repeats": 3}},
    "checkpoints": {**CLS, "checkpoints": ["/models/c1", "/models/c2"]},
    "translation roles": {**MT, "sweep": {"experiments": ["baseline", "roles"]},
                          "roles": {"frequencies": "dictionary", "positional_threshold": 0.8}},
}

# (case, Config.hash(), sha256 of Config.to_json() [:16]) as computed by the code before the restructuring.
PINNED = [
    ('classifier defaults', 'f3fcbe60cb0426a5', 'f3fd497a0bdd89fb'),
    ('causal LM defaults', 'bd2cf2d310114877', '3737c10f0c1e8838'),
    ('translation defaults', '89b9107ab97ec200', 'e341160e6939ddff'),
    ('session-only keys left out', 'f3fcbe60cb0426a5', '7d2d37845df81dee'),
    ('sweep and significance', 'bc08a6dc50ae8b01', '7ee67bc7ac141844'),
    ('custom masks', '1ed093cf3c955e0c', 'e7f53c88b12d76fe'),
    ('roles', '6a0a8f95cb9f2bc3', 'a8515a0fb8f2bd46'),
    ('l0', 'd9fb7a1df4a7fb9e', 'fe5f1d60f9fcc609'),
    ('pairs', 'ba5b0c5bdb2425d6', '1fe36e24173980f7'),
    ('importance and prune', '9b637d4950506690', '3dc18dbea0fb1f0e'),
    ('screen', '43d4600b388e2717', '2de949b15a274356'),
    ('efficiency', '875599dea5dd8bb3', '8cc3ddfb185fbdea'),
    ('checkpoints', '24d87f213c8e875f', 'b267acd722777bfb'),
    ('translation roles', 'c784590483dbecc0', '6f83396d035cefcc'),
]


def test_every_case_is_pinned():
    assert [name for name, _, _ in PINNED] == list(CASES)


# Keys added since the pins, at their defaults in every case: the stored config JSON gains them, and the rest of
# it (and the hash, which leaves defaults out) must stay as pinned.
ADDED = {"sweep": {"ablation": "zero", "memory_limit_gib": None, "context_cache": False}, "prune": {"uniform": None},
         "roles": {"sink_threshold": 0.5},
         "efficiency": {"stock": "auto", "prefill_batch_sizes": [1, 16], "decode_batch_sizes": [1],
                        "prompt_tokens": 128, "new_tokens": 32},
         "ablation": {"reference": None, "positions": "all", "keep_first": False, "seed": 0, "resamples": 1,
                      "allow_eval_data": False, "direction": "noising", "steps": 100, "lr": 0.01}}


@pytest.mark.parametrize(("name", "config_hash", "json_hash"), PINNED, ids=[p[0] for p in PINNED])
def test_config_identity_is_unchanged(name, config_hash, json_hash):
    cfg = build_config(CASES[name])
    assert cfg.hash() == config_hash
    stored = json.loads(cfg.to_json())
    assert stored.pop("ablation") == ADDED["ablation"]
    for section in ("sweep", "prune", "roles", "efficiency"):
        for key, default in ADDED[section].items():
            assert stored[section].pop(key) == default, (section, key)
    if stored["model"]["kind"] == "hf_causal_lm":  # data.task paired's and lm_eval's keys, at their defaults
        assert stored["data"].pop("max_pairs") is None
        lm_eval = {k: stored["data"].pop(k) for k in ("tasks", "include_path", "num_fewshot", "fewshot_seed", "limit",
                                                      "metric", "trust_task_code")}
        assert lm_eval == {"tasks": None, "include_path": None, "num_fewshot": None, "fewshot_seed": 1234,
                           "limit": None, "metric": None, "trust_task_code": False}
    if stored["model"]["kind"] == "hf_classifier":  # data.task (paired inputs), at its default
        assert stored["data"].pop("task") == "classification"
    pinned_json = json.dumps(stored, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(pinned_json.encode()).hexdigest()[:16] == json_hash
