"""``model.dtype: bfloat16`` for both transformers families: a sweep through the real CLI (reuse on, masks packed
by the activation budget, gradient importance on held-out data) with the workers holding the model in bfloat16,
and importance differentiating in float32 (``EvalAdapter.loss_batches``' dtype). The exactness checks in bfloat16
(gates, reuse, packing) are the family contract suite's (tests/contract, ``FamilyCase.dtypes``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import lm_text, save_tiny_causal_lm, save_tiny_classifier

import headsweep
from headsweep.sweep.configuration.reader import from_dict
from headsweep.workers.analyses.importance import gate_gradients, loss_batches_of
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.families.registry import model_family


@pytest.fixture(scope="module")
def families(tmp_path_factory, tiny_dev_tsv) -> dict[str, dict]:
    """Per family: the ``model`` section (in bfloat16), the evaluation data and held-out data, and its head count."""
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    tmp = tmp_path_factory.mktemp("bfloat16")
    corpus, train = tmp / "corpus.txt", tmp / "train.txt"
    corpus.write_text(lm_text(160, seed=7))
    train.write_text(lm_text(120, seed=8))
    lm_data = {"window": 16, "max_windows": 6}
    return {
        "hf_classifier": {
            "model": {"kind": "hf_classifier", "path": str(save_tiny_classifier(tmp / "bert")), "dtype": "bfloat16"},
            "data": {"path": str(tiny_dev_tsv)},
            "heldout": {"path": str(write_tsv(generate(32, seed=5), tmp / "train.tsv"))},
            "heads": 2 * 4,
        },
        "hf_causal_lm": {
            "model": {"kind": "hf_causal_lm", "path": str(save_tiny_causal_lm(tmp / "llama", "llama_8q2kv")),
                      "dtype": "bfloat16"},
            "data": {"path": str(corpus), **lm_data},
            "heldout": {"path": str(train), **lm_data},
            "heads": 2 * 8,
        },
    }


# The classifier's sweep is the slow variant: model.dtype takes the same route from the config through the driver to
# the worker as the causal LM's (the hf_causal_lm case here), and a classifier's gates, reuse and packing in bfloat16
# are tests/contract/test_family_contract.py's (classifier-bert-eager-bfloat16, classifier-distilbert-sdpa-bfloat16).
@pytest.mark.parametrize("family", [pytest.param("hf_classifier", marks=pytest.mark.slow), "hf_causal_lm"])
def test_a_bfloat16_sweep_through_the_cli(families, family, tmp_path, ray_address):
    """Baseline, every single head and gradient importance, stored and read back: the workers held the model in
    bfloat16 (runs.facts), every head has a finite importance, and most single heads move the score."""
    f = families[family]
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "model": f["model"], "data": f["data"],
        "sweep": {"experiments": ["baseline", "single_head", "importance"], "batch_size": 8},
        "importance": {"method": "gradient", "data": f["heldout"]},
        "significance": {"n_resamples": 100},
    }))
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    with headsweep.open_store(str(store)) as s:
        (facts, status), = s.sql("SELECT facts, status FROM runs").fetchall()
        scores = s.sql("SELECT experiment, score, baseline_score FROM evaluations").fetchall()
        importance = [row[0] for row in s.sql("SELECT score FROM importance").fetchall()]
    facts = json.loads(facts)
    assert status == "complete" and facts["dtype"] == "bfloat16"
    assert not facts["reuse"].startswith("off"), facts["reuse"]  # reuse ran (on by default)
    single = [(score, base) for experiment, score, base in scores if experiment == "single_head"]
    assert len(single) == f["heads"]
    assert sum(score != base for score, base in single) >= f["heads"] // 2
    assert len(importance) == f["heads"] and np.isfinite(importance).all() and min(importance) >= 0


@pytest.mark.parametrize("family", ["hf_classifier", "hf_causal_lm"])
def test_importance_differentiates_in_float32(families, family):
    """A bfloat16 model's gate gradients and training loss come out in float32: importance sets float32 gates and
    asks ``loss_batches`` for a float32 loss."""
    f = families[family]
    kind = model_family(family)
    adapter = kind.load(from_dict(kind.model_config, f["model"], "model"),
                        from_dict(kind.data_config, f["heldout"], "data"), RuntimeOptions(batch_size=8))
    assert adapter.model.dtype == torch.bfloat16
    batch = next(gate_gradients(adapter, []))
    assert {g.dtype for g in batch.grads.values()} == {torch.float32}
    assert all(g.abs().sum() > 0 for g in batch.grads.values())
    with torch.no_grad():
        assert loss_batches_of(adapter, None).batches[0].loss().dtype == torch.float32
