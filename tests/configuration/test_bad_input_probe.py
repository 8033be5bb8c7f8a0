"""The bad-input probe (config and data): each case through the real CLI refuses with the one line the
user should read, exit code 2, no traceback, and nothing written.

Config and data-file problems are found on the driver before Ray or a model starts (``check_data_files``): those
cases run side by side and must not reach the workers. Problems only the loaded model shows (labels against its
label set, heads per layer) are found by the workers before the first row, against a store holding a run; where
another case takes a check's route through the CLI, the check runs in the worker's load in this process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, error_line, run_cli
from small_store import small_store
from test_bad_data import ROWS, classifier_config, listing, runs, worker_refused, write_rows

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import Config, build_config, check_data_files
from headsweep.sweep.experiments.prune_level import check_min_heads
from headsweep.workers.core.heads import HeadInventory, LayerShape
from headsweep.workers.families.hf_causal_lm.config import CausalLMData
from headsweep.workers.families.hf_classifier.data import label_ids

KINDS = ("baseline, single_head, all_but_one, custom, importance, prune_level, efficiency, kv_group, roles, pairs, "
         "l0")
FAMILIES = "fairseq_translation, hf_causal_lm, hf_classifier, hf_seq2seq"
MODEL_LABELS = "(model labels: 0=negative, 1=positive)"


def refused(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Exit code 2, the one error line ``headsweep: error: <expected>`` last, no traceback, nothing on stdout."""
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert line == f"headsweep: error: {expected}", line
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == "", proc.stderr


# -- found before Ray or a model starts ----------------------------------------------------------------------
def driver_cases(tmp: Path, model_dir: Path, data: Path) -> list[tuple[str, list[str], str]]:
    """``(case, headsweep run arguments, the line expected after "headsweep: error: ")``."""
    config = classifier_config(tmp, model_dir, {"path": str(data)})
    empty_config = tmp / "empty.yaml"
    empty_config.write_text("# nothing yet\n")
    empty_label = tmp / "empty_label.tsv"
    empty_label.write_text("sentence\tlabel\nthe film was good\t1\nthe film was bad\t\nthe film was fine\t1\n")
    c = str(config)
    return [
        ("max_examples -1", [c, "data.max_examples=-1"],
         "data.max_examples must be a positive integer (how many examples to keep, from the start), got -1; "
         "leave it out to keep every example"),
        ("max_examples 0", [c, "data.max_examples=0"],
         "data.max_examples must be a positive integer (how many examples to keep, from the start), got 0; "
         "leave it out to keep every example"),
        ("format xml", [c, "data.format=xml"],
         "data.format 'xml' is not a supported format (supported: tsv, csv, jsonl, parquet)"),
        ("missing text_pair_column", [c, "data.text_pair_column=sentence2"],
         f"data file {data} has no column 'sentence2' (columns: sentence, label); set data.text_pair_column to one "
         "of them"),
        ("empty config file", [str(empty_config)],
         f"config file {empty_config} is empty: a config needs at least a model section (model.kind: one of "
         f"{FAMILIES}) and a data section"),
        ("model=foo", [c, "model=foo"],
         f"config key 'model' must be a mapping with model.kind (one of: {FAMILIES}, or an installed "
         "'headsweep.families' entry point) and the model's files, got 'foo'"),
        ("config is a directory", [str(tmp)], f"config file {tmp} is a directory, not a file: name the YAML config "
         "file"),
        ("data.path is a directory", [c, f"data.path={tmp}"],
         f"data file {tmp} is a directory, not a file: data.path must name a file"),
        ("empty label cell", [c, f"data.path={empty_label}"],
         f"data file {empty_label}: empty label in row 2 (line 3) (column 'label'): every example needs its label"),
        ("no experiments", [c, "sweep.experiments=[]"],
         f"sweep.experiments is empty: name the experiment kinds to run (known: {KINDS}; [baseline] evaluates the "
         "unmasked model alone)"),
        ("sweep.order without importance data", [c, "sweep.experiments=[single_head]", "sweep.order=importance"],
         "sweep.order: importance sends the masks of the most important heads first, so it needs head importance "
         "before the grid: set importance.data (training or validation data, kept apart from the evaluation set), "
         "or importance.method: ablation with importance.from_run (an earlier run's single-head deltas), or leave "
         "sweep.order at planned"),
        ("importance.data missing", [c, "sweep.experiments=[importance]", f"importance.data.path={tmp}/train.tsv"],
         f"importance.data file not found: {tmp}/train.tsv"),
        ("importance.data max_examples 0", [c, "sweep.experiments=[importance]", f"importance.data.path={data}",
                                            "importance.allow_eval_data=true", "importance.data.max_examples=0"],
         "importance.data.max_examples must be a positive integer (how many examples to keep, from the start), "
         "got 0; leave it out to keep every example"),
    ]


def test_config_and_data_problems_are_refused_before_any_worker(tmp_path, tiny_bert_dir):
    """Each case costs one CLI start and nothing more: no Ray, no worker, no model (run side by side)."""
    data = write_rows(ROWS, tmp_path / "dev.tsv")
    refused_before_any_worker(driver_cases(tmp_path, tiny_bert_dir, data), tmp_path / "store")


def test_unclear_messages_of_files_are_named_before_any_worker(tmp_path, tiny_bert_dir):
    """Was: "not found" for a FIFO or a device that exists (and a FIFO must never be opened: reading it blocks until
    someone writes); a model folder without tokenizer.json: transformers' "Couldn't instantiate the backend tokenizer
    from one of: ;" from the workers once Ray had started; a pickled pytorch_model.bin: torch's advice to load it
    with weights_only=False, which no setting here does. The conversion the last line names, run as given, gives a
    folder whose safetensors hold the same weights and that passes the checks."""
    import argparse

    import torch
    from safetensors.torch import load_file

    from headsweep.workers.families.hf_classifier.config import ClassifierModel
    from headsweep.workers.families.registry import model_family

    data = write_rows(ROWS, tmp_path / "dev.tsv")
    config = str(classifier_config(tmp_path, tiny_bert_dir, {"path": str(data)}))
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    no_vocabulary = shutil.copytree(tiny_bert_dir, tmp_path / "no-tokenizer-json")
    (no_vocabulary / "tokenizer.json").unlink()
    assert (no_vocabulary / "tokenizer_config.json").is_file()
    pickled = shutil.copytree(tiny_bert_dir, tmp_path / "pickled")
    weights = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    binary = pickled / "pytorch_model.bin"
    torch.save({**weights, "args": argparse.Namespace(lr=0.1)}, binary)
    script = (f"import torch; from safetensors.torch import save_file; s = torch.load('{binary}', weights_only=False); "
              "save_file({k: v.clone().contiguous() for k, v in s.items() if isinstance(v, torch.Tensor)}, "
              f"'{pickled / 'model.safetensors'}')")
    not_regular = "not a regular file: data.path must name a file on disk"
    refused_before_any_worker([
        ("config is a FIFO", [str(fifo)],
         f"config file {fifo} is a FIFO (named pipe), not a regular file: name the YAML config file"),
        ("config is /dev/zero", ["/dev/zero"],
         "config file /dev/zero is a character device, not a regular file: name the YAML config file"),
        ("data.path is a FIFO", [config, f"data.path={fifo}"],
         f"data file {fifo} is a FIFO (named pipe), {not_regular}"),
        ("data.path is /dev/urandom", [config, "data.path=/dev/urandom"],
         f"data file /dev/urandom is a character device, {not_regular}"),
        ("no tokenizer.json", [config, f"model.path={no_vocabulary}"],
         f"no tokenizer vocabulary in {no_vocabulary}: tokenizer.json is missing (of a tokenizer's files the folder "
         "has only tokenizer_config.json); save the model's tokenizer into that folder (tokenizer.save_pretrained)"),
        ("pickled pytorch_model.bin", [config, f"model.path={pickled}"],
         f"{binary} holds pickled Python objects beside its tensors (argparse.Namespace), which headsweep does not "
         "load (unpickling runs code from the file): convert it to safetensors once, on a machine where you trust "
         f'the file, e.g. python -c "{script}" (for a file holding a state dict), then move pytorch_model.bin out of '
         "the folder"),
    ], tmp_path / "store")
    exec(script, {})  # noqa: S102 - the command the line gives, on the file this test wrote
    binary.rename(tmp_path / "pytorch_model.bin")
    converted = load_file(pickled / "model.safetensors")
    assert converted.keys() == weights.keys() and all(torch.equal(converted[k], v) for k, v in weights.items())
    model_family("hf_classifier").check_model(ClassifierModel(path=str(pickled)))


def refused_before_any_worker(cases: list[tuple[str, list[str], str]], store: Path, side_by_side: int = 4) -> None:
    """Each case (name, ``headsweep run`` arguments, the expected error) through the CLI, ``side_by_side`` at once:
    refused with its line, no worker started, nothing written to ``store``."""
    def one(case: tuple[str, list[str], str]) -> subprocess.CompletedProcess:
        # No --address: a case that reached the workers would start a Ray instance of its own and say so.
        return subprocess.run([sys.executable, "-m", "headsweep", "run", *case[1], "--store", str(store)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)

    with ThreadPoolExecutor(max_workers=side_by_side) as pool:
        results = list(pool.map(one, cases))
    for (name, _, expected), proc in zip(cases, results, strict=True):
        try:
            refused(proc, expected)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from None
        assert "workers ready" not in proc.stderr, name
    assert not store.exists()


# -- found by the workers, before the first row ----------------------------------------------------------------
@pytest.fixture(scope="module")
def full_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv) -> Path:
    """A store holding one complete run of the tiny BERT: the session's small store (tests/small_store.py), which
    other modules on this process build or read anyway, so no run of its own."""
    store, _, _ = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return store


@pytest.fixture
def store(tmp_path, full_store) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(full_store, dest)
    return dest


def refused_run(store: Path, config: Path, address: str, overrides: list[str], expected: str) -> None:
    before = listing(store), runs(store)
    proc = run_cli("run", str(config), *overrides, "--store", str(store), "--address", address, "--quiet")
    refused(proc, expected)
    assert (listing(store), runs(store)) == before


def test_importance_data_labels_are_checked_before_the_baseline(tmp_path, store, tiny_bert_dir, ray_address):
    """Was: checked when importance ran, after the baseline: a failed run with one evaluation was left."""
    train = tmp_path / "train.tsv"
    train.write_text("sentence\tlabel\nthe film was good\tpositive\nthe film was bad\tawful\n")
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(write_rows(ROWS, tmp_path / "dev.tsv"))})
    refused_run(store, config, ray_address,
                ["sweep.experiments=[importance]", f"importance.data.path={train}"],
                f"data file {train}: labels outside the model's label set: 'awful' in row 2 (line 3) {MODEL_LABELS}")




def test_min_heads_per_layer_above_the_heads_of_a_layer(tmp_path, store, tiny_bert_dir, ray_address):
    """Was: eleven identical pruning levels with n_masked 0."""
    train = write_rows(ROWS[:20], tmp_path / "train.tsv")
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(write_rows(ROWS, tmp_path / "dev.tsv"))})
    refused_run(store, config, ray_address,
                ["sweep.experiments=[prune_level]", f"importance.data.path={train}", "prune.min_heads_per_layer=5"],
                "prune.min_heads_per_layer 5 is more than the 4 heads of self layer 0: a layer cannot keep more heads "
                "than it has; set it to 4 or less")


def test_export_from_a_run_of_another_model(tmp_path, store, tiny_bert_dir):
    """Was: exported with that run's mask ("head 5 out of range" where the shapes differ)."""
    from tiny_models import save_tiny_classifier

    other = save_tiny_classifier(tmp_path / "other-bert", seed=1)
    [run] = runs(store)
    config = classifier_config(tmp_path, other, {"path": str(tmp_path / "dev.tsv")})
    before = listing(store)
    out = tmp_path / "pruned"
    proc = run_cli("export", str(config), "--from-run", run["run_id"], "--eval-id", "baseline", "--out", str(out),
                   "--store", str(store))
    refused(proc, f"run {run['run_id']} is of model {tiny_bert_dir} (hf_classifier), this config's model is {other} "
                  "(hf_classifier): a stored mask fits only the model it was found on; export with that run's config, "
                  "or name a run of this model")
    assert listing(store) == before and not out.exists()


# -- the same checks, through the API, where a CLI run would add nothing -----------------------------------------
def test_empty_experiments_with_masks_is_a_custom_run(tiny_bert_dir, tiny_dev_tsv):
    """``sweep.masks`` implies ``custom``: an empty list is refused only when nothing else names a kind."""
    cfg = build_config({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                        "data": {"path": str(tiny_dev_tsv)}, "sweep": {"experiments": [], "masks": [["self:0:1"]]}})
    assert cfg.sweep.experiments == ["custom"]


def test_labels_mixing_ids_and_names(tmp_path, tiny_bert_dir):
    """Was: "labels outside the model's label set:  (model labels: ...)", the bad labels blank. In the worker's load
    (``worker_refused``): the label check whose refusal through the CLI is
    ``test_importance_data_labels_are_checked_before_the_baseline``."""
    mixed = tmp_path / "mixed.tsv"
    mixed.write_text("sentence\tlabel\nthe film was good\t1\nthe film was bad\tnegative\n")
    message = worker_refused(classifier_config(tmp_path, tiny_bert_dir, {"path": str(mixed)}))
    assert message == (f"data file {mixed}: labels mix label names and label ids: 'negative' in row 2 (line 3) is a "
                       f"name, '1' in row 1 (line 2) an id; write every label one way {MODEL_LABELS}")


def test_label_messages_name_the_labels_and_rows():
    id2label = {0: "negative", 1: "positive"}
    with pytest.raises(HeadsweepError) as err:
        label_ids(["1", " ", "7", "maybe", "7"], id2label, "f.tsv")
    assert str(err.value) == ("data file f.tsv: labels outside the model's label set: ' ' in row 2, '7' in rows 3 and "
                              f"5, 'maybe' in row 4 {MODEL_LABELS}")
    assert label_ids(["1", "0"], id2label, "f.tsv") == [1, 0]
    assert label_ids(["negative", "positive"], id2label, "f.tsv") == [0, 1]


def test_min_heads_rules():
    inventory = HeadInventory([LayerShape("self", 0, 4), LayerShape("self", 1, 2)])
    check_min_heads(2, inventory, None)  # the 2-head layer stays whole, the other is pruned down to 2
    with pytest.raises(HeadsweepError, match="is more than the 2 heads of self layer 1"):
        check_min_heads(3, inventory, None)
    with pytest.raises(HeadsweepError, match="keeps every head: each layer in scope has 4 heads or fewer"):
        check_min_heads(4, HeadInventory([LayerShape("self", 0, 4), LayerShape("self", 1, 4)]), None)


def config_of(model: dict, data: dict, **extra) -> Config:
    return build_config({"model": model, "data": data, **extra})


def test_other_families_data_files_are_checked_on_the_driver(tmp_path):
    """Translation and causal-LM data sections get the same driver-side checks (no model, no torch needed)."""
    source, target = tmp_path / "t.src", tmp_path / "t.tgt"
    source.write_text("a b\nc d\n")
    target.write_text("x y\n")
    model = {"kind": "fairseq_translation", "checkpoint": "c.pt", "data_bin": str(tmp_path)}
    for data, message in [
        ({"source": str(tmp_path), "target": str(target)},
         f"data.source: file {tmp_path} is a directory, not a file: data.source must name a file"),
        ({"source": str(source), "target": str(target), "max_examples": -1}, "data.max_examples must be a positive"),
        ({"source": str(source), "target": str(target)}, "data.source has 2 lines but data.target has 1"),
    ]:
        with pytest.raises(HeadsweepError) as err:
            check_data_files(config_of(model, data))
        assert message in str(err.value)
    lm = {"kind": "hf_causal_lm", "path": "m"}
    with pytest.raises(HeadsweepError, match=f"data file {tmp_path} is a directory, not a file: data.path must"):
        check_data_files(config_of(lm, {"path": str(tmp_path)}))
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n")
    cfg = config_of(lm, {"path": str(corpus)})
    assert isinstance(cfg.data, CausalLMData)
    check_data_files(cfg)
