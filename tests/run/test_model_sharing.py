"""A worker holds one copy of the weights: its adapter on other data (importance.data) uses the model it already
holds (headsweep.workers.memory.model_sharing), and neither adapter's gates act on the other's passes.

Checked in a real Ray actor against independent routes loaded on their own in this process: the importance the
worker computes on the shared model equals that of an adapter with its own copy, and the evaluation adapter's
masked results are the same before and after the other adapter ran (its gates set and cleared on the same model).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headsweep.workers.analyses.importance import gradient_importance, importance_on_worker
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.core.work import WorkUnit
from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel
from headsweep.workers.families.registry import model_family


def holds_one_copy(worker, data_cfg) -> tuple[bool, int]:
    """Worker-side: whether the adapter on ``data_cfg`` runs the evaluation adapter's model, and how many models
    of that size the worker's adapters hold (distinct objects)."""
    models = {id(a.model) for a in worker.held_adapters()}
    return worker.adapter(data_cfg).model is worker.adapter().model, len(models)


def test_the_adapter_on_other_data_shares_the_workers_model(ray_address, tiny_bert_dir, tiny_dev_tsv, tmp_path):
    import sys

    import ray
    from ray import cloudpickle

    from headsweep.workers.actor.eval_worker import EvalWorker

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # holds_one_copy runs in the worker

    lines = tiny_dev_tsv.read_text().splitlines()
    heldout = tmp_path / "heldout.tsv"
    heldout.write_text("\n".join(lines[:1] + lines[1:][::-1][:24]) + "\n")  # other examples, another order
    model_cfg = ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager")
    data_cfg, other_cfg = ClassifierData(path=str(tiny_dev_tsv)), ClassifierData(path=str(heldout))
    runtime = RuntimeOptions(batch_size=8, seed=0, threads=1)
    head = Head("self", 1, 2)
    units = [WorkUnit("plain", "x", ()), WorkUnit("masked", "x", (head,))]

    worker = EvalWorker.options(num_cpus=1).remote("w", "hf_classifier", model_cfg, data_cfg, runtime)
    try:
        ray.get(worker.load.remote())
        before = dict(ray.get(worker.evaluate.remote(units)))
        got = ray.get(worker.run.remote(importance_on_worker, other_cfg, True, False))
        shared, models = ray.get(worker.run.remote(holds_one_copy, other_cfg))
        after = dict(ray.get(worker.evaluate.remote(units)))
    finally:
        ray.kill(worker)
    assert shared and models == 1

    family = model_family("hf_classifier")
    own_copy = family.load(model_cfg, other_cfg, runtime)
    want = gradient_importance(own_copy, per_token=True, normalize=False)
    # exact: the same weights, kernels and batches; only whose gates hook the model differs
    assert got.raw == want.raw and got.loss == want.loss
    for eval_id in ("plain", "masked"):
        np.testing.assert_array_equal(after[eval_id].stats, before[eval_id].stats)
        np.testing.assert_array_equal(after[eval_id].loss, before[eval_id].loss)
    assert not np.array_equal(before["masked"].loss, before["plain"].loss)


@pytest.mark.parametrize("change", ["dtype", "attn_implementation"])
def test_a_model_loaded_otherwise_is_not_shared(tiny_bert_dir, tiny_dev_tsv, change):
    """The offered model serves only a config that would load the same model (folder, dtype, device, attention)."""
    from headsweep.workers.memory.model_sharing import offered

    family = model_family("hf_classifier")
    runtime = RuntimeOptions(batch_size=8, threads=1)
    data_cfg = ClassifierData(path=str(tiny_dev_tsv))
    main = family.load(ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager"), data_cfg, runtime)
    other = {"dtype": {"dtype": "float64"}, "attn_implementation": {"attn_implementation": "sdpa"}}[change]
    with offered(main.model):
        same = family.load(ClassifierModel(path=str(tiny_bert_dir), attn_implementation="eager"), data_cfg, runtime)
        differs = family.load(ClassifierModel(path=str(tiny_bert_dir), **{"attn_implementation": "eager", **other}),
                              data_cfg, runtime)
    assert same.model is main.model
    assert differs.model is not main.model
    assert next(differs.model.parameters()).dtype == (torch.float64 if change == "dtype" else torch.float32)
