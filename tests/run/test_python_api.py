"""The notebook API on the package itself: open a store, read views, run a config, load a pruned model."""

from __future__ import annotations

import pytest
import yaml
from small_store import small_store

import headsweep


@pytest.fixture(scope="module")
def small(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    return small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)


def test_open_store_views_and_parameters(small):
    store_dir, run_id, checkpoints = small
    with headsweep.open_store(str(store_dir)) as store:
        heads = store.view("heads").df()
        assert set(heads["run_id"]) == {run_id}
        assert len(heads) == 8 * len(checkpoints)  # tiny BERT: 2 layers x 4 heads, per checkpoint
        [(n,)] = store.sql("SELECT count(*) FROM evaluations WHERE run_id = ?", [run_id]).fetchall()
        assert n == store.view("evaluations").aggregate("count(*)").fetchall()[0][0] > 0
        with pytest.raises(Exception, match="disabled by configuration"):
            store.sql(f"COPY (SELECT 1) TO '{store_dir}/runs/x.parquet' (FORMAT parquet)").fetchall()
    assert not (store_dir / "runs" / "x.parquet").exists()


def test_run_a_config_and_read_it_back(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                                      "data": {"path": str(tiny_dev_tsv)},
                                      "sweep": {"experiments": ["baseline", "single_head"], "workers": 1}}))
    run_id = headsweep.run(str(config), ["sweep.batch_size=16"], store=str(tmp_path / "s"), address=ray_address,
                           show_progress=False)
    with headsweep.open_store(str(tmp_path / "s")) as store:
        rows = store.sql("SELECT status, n_done FROM runs WHERE run_id = ?", [run_id]).fetchall()
    assert rows == [("complete", 9)]
    with pytest.raises(headsweep.HeadsweepError, match="config file not found"):
        headsweep.run(str(tmp_path / "missing.yaml"), store=str(tmp_path / "s"))


def test_load_pruned_from_the_package(tmp_path):
    """``headsweep.load_pruned`` reads what export writes: same parameters, same logits as the pruned model."""
    import torch
    from tiny_models import random_batch, tiny_classifier

    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.hf_shared.pruning import save_pruned
    from headsweep.workers.pruning.removal import count_parameters, prune_heads

    model = tiny_classifier("bert", "sdpa", layers=2)
    full = count_parameters(model)
    prune_heads(model, [Head("self", 0, 1), Head("self", 1, 3)])
    save_pruned(model, tmp_path / "pruned")
    reloaded = headsweep.load_pruned(str(tmp_path / "pruned"))
    assert count_parameters(reloaded) == count_parameters(model) < full
    ids, mask = random_batch()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits,
                           model(input_ids=ids, attention_mask=mask).logits)  # exact: same weights and kernels
