"""Placement: configs the cluster cannot run, or that would starve it, fail before any work starts."""

from __future__ import annotations

import pytest
import yaml
from conftest import error_line, run_cli

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster.placement import NodeResources, check_placement, workers_per_node
from headsweep.sweep.configuration.config import load_config


def config(tmp_path, **sweep):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": "m"}, "data": {"path": "d.tsv"},
                                    "sweep": sweep}))
    return load_config(str(path), [])


def test_gpu_workers_on_a_cluster_without_gpus_fail_with_the_cpu_recipe(tmp_path):
    cfg = config(tmp_path, num_gpus_per_worker=1)
    with pytest.raises(HeadsweepError, match="has no GPUs; to run this config on CPU add sweep.device=cpu "
                                             "sweep.num_gpus_per_worker=0"):
        check_placement(cfg, [NodeResources(cpus=16, gpus=0)])
    cfg.sweep.wait_for_resources = True  # an autoscaling cluster adds GPU nodes when asked
    check_placement(cfg, [NodeResources(cpus=16, gpus=0)])


def test_fractional_gpus_pack_several_workers_per_gpu(tmp_path):
    assert workers_per_node(NodeResources(cpus=8, gpus=1), cpus=1, gpus=0.25) == 4
    assert workers_per_node(NodeResources(cpus=2, gpus=1), cpus=1, gpus=0.25) == 2  # CPUs bound it
    nodes = [NodeResources(cpus=8, gpus=1), NodeResources(cpus=8, gpus=2)]
    check_placement(config(tmp_path, workers=12, num_gpus_per_worker=0.25), nodes)
    with pytest.raises(HeadsweepError, match="fits 3 of the 4 workers"):
        check_placement(config(tmp_path, workers=4, num_gpus_per_worker=1), nodes)


def test_workers_never_take_every_cpu(tmp_path):
    with pytest.raises(HeadsweepError, match=r"2 x 1 CPUs would hold all 2 CPUs of the Ray cluster; .* "
                                             r"\(sweep.workers=1 or a smaller sweep.num_cpus_per_worker\)"):
        check_placement(config(tmp_path, workers=2), [NodeResources(cpus=2, gpus=0)])
    with pytest.raises(HeadsweepError, match=r"would hold more than all 4 CPUs"):
        check_placement(config(tmp_path, workers=3, num_cpus_per_worker=2), [NodeResources(cpus=4, gpus=0)])
    check_placement(config(tmp_path, workers=3, num_cpus_per_worker=0.5), [NodeResources(cpus=2, gpus=0)])


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ({"device": "cuda"}, "sweep.device=cuda needs sweep.num_gpus_per_worker > 0"),
        ({"device": "cpu", "num_gpus_per_worker": 1}, "would hold GPUs it never uses"),
        ({"num_gpus_per_worker": -1}, "sweep.num_gpus_per_worker must be at least 0, got -1"),
    ],
)
def test_contradictory_device_settings(tmp_path, sweep, message):
    with pytest.raises(HeadsweepError, match=message):
        config(tmp_path, **sweep)


def test_cli_refuses_gpu_workers_on_this_cpu_cluster_and_writes_nothing(tmp_path, tiny_bert_dir, tiny_dev_tsv,
                                                                         ray_address):
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline"], "num_gpus_per_worker": 0.5}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address)
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert "sweep.num_gpus_per_worker=0.5 but the Ray cluster has no GPUs" in line
    assert not (store / "runs").exists()
    ok = run_cli("run", str(tmp_path / "c.yaml"), "sweep.device=cpu", "sweep.num_gpus_per_worker=0", "--store",
                 str(store), "--address", ray_address, "--quiet")
    assert ok.returncode == 0, ok.stderr
