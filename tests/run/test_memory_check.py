"""The driver's memory check (sweep/run/memory.py): a run whose workers cannot hold the model is refused before Ray
or any worker starts, in one line naming the sizes and what to change, with nothing written; the weights are sized
from the files (a hub id's cached snapshot, safetensors headers or PyTorch's ``.bin``, in ``model.dtype``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tiny_models import lm_text, save_tiny_causal_lm

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.run.memory import GIB, Need, check_gpus, check_memory, gpu_free_bytes, remedies
from headsweep.workers.families.hf_causal_lm.config import CausalLMModel
from headsweep.workers.families.registry import model_family

COMMIT = "c0ffee" + "0" * 34


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> tuple[Path, Path, int]:
    """A tiny causal LM (safetensors), an evaluation text, and the model's parameter count."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("memory")
    model_dir = save_tiny_causal_lm(tmp / "tiny-lm", "llama_8q2kv")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(200, seed=3))
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    return model_dir, corpus, params


def cached_as(repo_id: str, model_dir: Path) -> str:
    """``model_dir`` laid out as ``repo_id``'s snapshot in the session's Hugging Face cache (tests/conftest.py)."""
    repo = Path(os.environ["HF_HUB_CACHE"]) / f"models--{repo_id.replace('/', '--')}"
    if not repo.exists():
        shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
    return repo_id


def test_weights_are_sized_from_the_files(tiny_lm, tmp_path):
    """safetensors headers at model.dtype (a hub id read from its snapshot), PyTorch's ``.bin`` scaled from the dtype
    it was saved in; an unknown dtype is refused by name."""
    model_dir, _, params = tiny_lm
    family = model_family("hf_causal_lm")
    hub_id = cached_as("memcheck/sized-lm", model_dir)
    for path in (str(model_dir), hub_id):
        assert family.weight_bytes(CausalLMModel(path=path)) == 4 * params  # float32, the default
        assert family.weight_bytes(CausalLMModel(path=path, dtype="bfloat16")) == 2 * params
    # Weights saved in bfloat16, loaded in float32 (the default) or as saved
    saved_half = tmp_path / "saved-bfloat16"
    _loaded(model_dir).to(torch.bfloat16).save_pretrained(saved_half)
    assert family.weight_bytes(CausalLMModel(path=str(saved_half))) == 4 * params
    assert family.weight_bytes(CausalLMModel(path=str(saved_half), dtype="bfloat16")) == 2 * params
    # PyTorch's pickle format (transformers 5 writes only safetensors: saved as older transformers did)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(model_dir / "config.json", pickled)
    torch.save(torch.nn.Module.state_dict(_loaded(model_dir)), pickled / "pytorch_model.bin")
    size = (pickled / "pytorch_model.bin").stat().st_size
    assert 4 * params < size < 4 * params + 64 * 1024  # other: the float32 tensors and pickle's bookkeeping
    assert family.weight_bytes(CausalLMModel(path=str(pickled))) == size
    assert family.weight_bytes(CausalLMModel(path=str(pickled), dtype="bfloat16")) == size // 2
    with pytest.raises(HeadsweepError, match="model.dtype 'float8_e4m3fn' is not a dtype models are evaluated in"):
        family.weight_bytes(CausalLMModel(path=str(model_dir), dtype="float8_e4m3fn"))


def _loaded(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def write_config(path: Path, model: str, corpus: Path, **sweep) -> Path:
    path.write_text(yaml.safe_dump({
        "model": {"kind": "hf_causal_lm", "path": model},
        "data": {"path": str(corpus), "window": 16},
        "sweep": {"experiments": ["baseline", "single_head"], **sweep},
    }))
    return path


def test_a_model_the_workers_cannot_hold_is_refused(tiny_lm, tmp_path):
    """Two workers of about 1 GiB each (the tiny weights and the 1 GiB activation budget of a forward pass on a CPU)
    in a 1.5 GiB share of the machine: refused before Ray starts (the run has no --address: the embedded instance
    is never started), one line, exit 2, no store folder; the line names the sizes and the one worker that fits."""
    model_dir, corpus, params = tiny_lm
    hub_id = cached_as("memcheck/tiny-lm", model_dir)
    store = tmp_path / "store"
    config = write_config(tmp_path / "sweep.yaml", hub_id, corpus, workers=2, memory_limit_gib=1.5)
    proc = run_cli("run", str(config), "--store", str(store), "--quiet")
    assert proc.returncode == 2, proc.stderr
    weights = f"{4 * params / 2**20:.2f} MiB"
    per_worker = f"{(4 * params + 2**30) / 2**30:.2f} GiB"
    line = error_line(proc.stderr)
    assert line.startswith(f"headsweep: error: 2 workers cannot hold this model: its weights take {weights} in float32 "
                           f"(model.dtype), each worker needs about {per_worker} (the weights and the 1.00 GiB "
                           f"activation budget of a forward pass), "), line
    assert "is available (sweep.memory_limit_gib; the machine has " in line
    assert line.endswith(": use sweep.workers=1, or a larger sweep.memory_limit_gib or a machine with more "
                         "memory"), line
    assert "Traceback" not in proc.stderr and not store.exists()
    bad = run_cli("run", str(config), "sweep.memory_limit_gib=-1", "--store", str(store), "--quiet")
    assert bad.returncode == 2 and not store.exists()
    assert error_line(bad.stderr) == "headsweep: error: sweep.memory_limit_gib must be a positive number of GiB, got -1"


def test_the_check_passes_what_fits_and_skips_clusters(tiny_lm, tmp_path):
    """The same config with room for both workers passes; on a cluster (an address) nothing is checked: its workers
    run on other machines."""
    model_dir, corpus, _ = tiny_lm
    config = load_config(write_config(tmp_path / "sweep.yaml", str(model_dir), corpus, workers=2))
    models = [config.model]
    check_memory(dataclasses.replace(config, sweep=dataclasses.replace(config.sweep, memory_limit_gib=2.1)), models,
                 None)
    tight = dataclasses.replace(config, sweep=dataclasses.replace(config.sweep, memory_limit_gib=1.9))
    with pytest.raises(HeadsweepError, match="2 workers cannot hold this model"):
        check_memory(tight, models, None)
    check_memory(tight, models, "127.0.0.1:6379")


def test_the_efficiency_experiment_counts_one_pruned_copy_of_the_weights(tiny_lm, tmp_path):
    """With ``efficiency`` in the run, one worker holds the pruned model beside its own: a share that holds two
    workers and half a copy more passes without it and is refused with it, the line saying why."""
    model_dir, corpus, params = tiny_lm
    config = load_config(write_config(tmp_path / "sweep.yaml", str(model_dir), corpus, workers=2))
    weights = model_family("hf_causal_lm").weight_bytes(config.model)
    assert weights == 4 * params
    limit = (2 * (weights + GIB) + weights // 2) / GIB

    def with_experiments(experiments: list[str]):
        return dataclasses.replace(config, sweep=dataclasses.replace(config.sweep, memory_limit_gib=limit,
                                                                     experiments=experiments))

    check_memory(with_experiments(["baseline", "single_head"]), [config.model], None)
    with pytest.raises(HeadsweepError, match="in all with the efficiency experiment's pruned copy of the weights"):
        check_memory(with_experiments(["baseline", "efficiency"]), [config.model], None)
    need = Need(weights=4 * GIB, activations=GIB, pruned_copy=True)
    assert need.total(2) == 14 * GIB and need.fit(14 * GIB) == 2 and need.fit(13 * GIB) == 1
    assert remedies(need, 2, 13 * GIB, limited=False) == "use sweep.workers=1, or a machine with more memory"


def test_remedies_name_what_makes_the_workers_fit():
    """Fewer workers where some fit, bfloat16 where it fits more of them, more memory always."""
    need = Need(weights=4 * GIB, activations=GIB, bfloat16=2 * GIB)
    assert remedies(need, 2, 7 * GIB, limited=False) == ("use sweep.workers=1, or model.dtype: bfloat16 (weights "
                                                         "2.00 GiB), or a machine with more memory")
    assert remedies(need, 4, 4 * GIB, limited=True) == ("use model.dtype: bfloat16 with sweep.workers=1 (weights "
                                                        "2.00 GiB), or a larger sweep.memory_limit_gib or a machine "
                                                        "with more memory")
    assert remedies(Need(GIB, GIB), 3, 5 * GIB, limited=False) == "use sweep.workers=2, or a machine with more memory"


def test_the_workers_sharing_a_gpu_must_fit_the_freest(tiny_lm, tmp_path):
    """``sweep.num_gpus_per_worker: 0.5`` puts two of three workers on one GPU: their weights against the freest
    visible GPU (no GPU here: the free memory is given as nvidia-smi would report it)."""
    model_dir, corpus, _ = tiny_lm
    config = load_config(write_config(tmp_path / "sweep.yaml", str(model_dir), corpus, workers=3, device="cuda",
                                      num_gpus_per_worker=0.5))
    check_gpus(config, 10 * GIB, config.model, [12 * GIB, 21 * GIB])
    with pytest.raises(HeadsweepError) as refused:
        check_gpus(config, 10 * GIB, config.model, [12 * GIB, 19 * GIB])
    assert str(refused.value) == (
        "2 workers per GPU (sweep.num_gpus_per_worker=0.5) cannot hold this model: its weights take 10.00 GiB in "
        "float32 (model.dtype) per worker, and the freest GPU has 19.00 GiB free (nvidia-smi): use a larger "
        "sweep.num_gpus_per_worker (fewer workers per GPU), model.dtype: bfloat16, or GPUs with more memory")
    check_gpus(config, 10 * GIB, config.model, None)  # no nvidia-smi: nothing is known, nothing checked


def test_gpus_are_read_from_nvidia_smi_as_cuda_sees_them(monkeypatch):
    """``nvidia-smi``'s CSV (index, uuid, free MiB) filtered by CUDA_VISIBLE_DEVICES, by index or UUID prefix."""
    query = "0, GPU-aaaa1111-0000, 81000\n1, GPU-bbbb2222-0000, 40000\n"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_free_bytes(query) == [81000 << 20, 40000 << 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_free_bytes(query) == [40000 << 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert gpu_free_bytes(query) == [81000 << 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_free_bytes(query) == []
