"""What weights a run was made with, and running a config whose run is complete, through the real CLI.

A run keeps the SHA-256 of its model's weight files (``facts.weights``, checked here against hashlib on the file);
once the files are changed in place (same shapes), continuing the run, ``export --from-run`` and
``report --attention`` are refused in one line with nothing written, while the same config makes a new run of the
new weights, which ``compare`` sets beside the old one with a warning. A complete run is not run again: the same
command (or ``--resume`` of that run) says so and writes nothing, also once the weights are back after a run of
other ones. (fairseq checkpoints: tests/families/translation/test_translation_sweep.py; hub ids:
tests/families/test_hub_cache.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import yaml
from conftest import error_line, run_cli

from headsweep.results.store import ResultStore


def expected_fingerprint(model_dir: Path) -> str:
    """The run's fingerprint of a folder with one ``model.safetensors``, from hashlib on the file's bytes."""
    file_hash = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    return hashlib.sha256(f"model.safetensors\0{file_hash}\n".encode()).hexdigest()


def perturb_in_place(model_dir: Path) -> None:
    """Other weights of the same shapes, written over the folder's own file (as a fine-tuning script might)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("attention.output.dense.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, path, metadata={"format": "pt"})


def listing(store: Path) -> dict[str, int | None]:
    return {str(p.relative_to(store)): p.stat().st_mtime_ns if p.is_file() else None for p in store.rglob("*")}


def ok(proc) -> str:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.stdout.strip()


def refused(proc, *parts: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    line = error_line(proc.stderr)
    for part in parts:
        assert part in line, line
    return line


def test_a_run_keeps_its_weights_and_a_complete_run_is_not_run_again(tmp_path, tiny_bert_dir, tiny_dev_tsv,
                                                                      ray_address):
    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    original = (model / "model.safetensors").read_bytes()
    assert original != b""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"kind": "hf_classifier", "path": str(model)}, "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "single_head"], "workers": 1, "batch_size": 20}}))
    store = tmp_path / "store"
    reader = ResultStore(str(store))

    def run(*extra: str):
        return run_cli("run", str(config), *extra, "--store", str(store), "--address", ray_address, "--quiet")

    run_id = ok(run())
    [row] = reader.read("runs").to_pylist()
    assert row["status"] == "complete"
    weights = json.loads(row["facts"])["weights"]
    assert weights == [{"model": str(model), "sha256": expected_fingerprint(model), "bytes": len(original)}]
    # Run once more: it is complete, so nothing is written and its id is printed.
    before = listing(store)
    again = run()
    assert ok(again) == run_id
    assert (f"run {run_id} of this config is complete in store {store}: nothing to do, nothing written "
            "(headsweep run --new starts a second run of it)") in again.stderr
    assert listing(store) == before
    # --resume of the complete run: the same, not a rewrite of its row.
    resumed = run("--resume", run_id)
    assert ok(resumed) == run_id
    assert (f"run {run_id} of this config is complete in store {store}: nothing to do, nothing written "
            "(headsweep run --new starts a second run of it)") in resumed.stderr
    assert listing(store) == before

    # The weights changed in place (same shapes): continuing the run would mix two models in it (refused before Ray
    # starts; the same check as for an unfinished run the same command continues).
    perturb_in_place(model)
    assert expected_fingerprint(model) != weights[0]["sha256"]
    refused(run("--resume", run_id), f"run {run_id} of this config was made with other weights than {model} holds now",
            f"{weights[0]['sha256'][:12]}... then, {expected_fingerprint(model)[:12]}... now",
            "continuing it would mix two models' results in one run", "--new")
    assert listing(store) == before

    # Nor is the run's mask exported onto these weights, nor are its drill-downs recomputed from them.
    out = tmp_path / "pruned"
    refused(run_cli("export", str(config), "--from-run", run_id, "--eval-id", "single_head/self:0:1", "--out",
                    str(out), "--store", str(store)),
            f"run {run_id} was made with other weights than {model} holds now",
            "export --from-run", "--new")
    assert not out.exists()
    page = tmp_path / "report"
    refused(run_cli("report", run_id, "--attention", "--store", str(store), "--out", str(page)),
            f"run {run_id} was made with other weights than {model} holds now", "leave out --attention")
    assert not page.exists() and listing(store) == before

    # The same config on the new weights is a new run (the complete one is of other weights); compare warns.
    other = ok(run())
    assert other != run_id
    assert json.loads(reader.run(other)["facts"])["weights"][0]["sha256"] == expected_fingerprint(model)
    compared = run_cli("compare", run_id, other, "--store", str(store), "--format", "json")
    ok(compared)
    assert (f"headsweep: warning: runs {run_id} and {other} are of two models with the same heads (weights sha256 "
            f"{weights[0]['sha256'][:12]}... and {expected_fingerprint(model)[:12]}...)") in compared.stderr
    assert json.loads(compared.stdout.splitlines()[0])["quantity"] == "single_head_delta"
    # The original weights back: the complete run of these is the first one, not the newest of the config; nothing
    # to do. (--new, a deliberate second run of a complete config: test_resume.py::test_resume_refuses_another_config,
    # on the run that module makes once for several tests.)
    (model / "model.safetensors").write_bytes(original)
    before = listing(store)
    back = run()
    assert ok(back) == run_id
    assert f"run {run_id} of this config is complete in store {store}: nothing to do" in back.stderr
    assert listing(store) == before
    assert {r["run_id"]: r["status"] for r in reader.read("runs").to_pylist()} == {
        run_id: "complete", other: "complete"}
