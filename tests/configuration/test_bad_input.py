"""Bad input: a one-line error naming the problem, exit code 2, and a store that still reads."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO, default_sigint, run_cli
from test_bad_data import worker_refused

from headsweep.results.store import ResultStore


def config_file(tmp_path, model_dir, data_file, model=None, data=None, sweep=None, extra=None):
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(model_dir), **(model or {})},
        "data": {"path": str(data_file), **(data or {})},
        "sweep": {"experiments": ["baseline", "single_head"], **(sweep or {})},
        **(extra or {}),
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_clean_failure(proc, message, store):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("headsweep: error: ") and message in last, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == ""
    # The store reads, and holds no run of the failed attempt.
    assert ResultStore(str(store)).read("runs").num_rows == 0
    assert ResultStore(str(store)).read("evaluations").num_rows == 0


def fail(tmp_path, ray_address, config, message):
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert_clean_failure(proc, message, store)


def test_unknown_config_key(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    cfg = config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv, sweep={"wokers": 2})
    fail(tmp_path, ray_address, cfg, "unknown config key 'sweep.wokers'")


def test_unknown_override_and_experiment(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    cfg = config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv, sweep={"experiments": ["single_heads"]})
    fail(tmp_path, ray_address, cfg, "unknown experiment kind 'single_heads'")
    cfg = config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv)
    store = tmp_path / "store2"
    proc = run_cli("run", str(cfg), "data.colum=x", "--store", str(store))
    assert_clean_failure(proc, "unknown config key 'data.colum'", store)


def test_missing_model_directory_and_hub_id(tmp_path, tiny_dev_tsv, ray_address):
    fail(tmp_path, ray_address, config_file(tmp_path, tmp_path / "nope", tiny_dev_tsv), "model directory not found")
    fail(tmp_path, ray_address, config_file(tmp_path, "bert-base-uncased", tiny_dev_tsv),
         "'bert-base-uncased' is neither a local folder nor in the Hugging Face cache")


def test_model_without_attention(tmp_path, tiny_dev_tsv):
    """In the worker's load (``worker_refused``); a classifier worker's load refusing through the CLI:
    tests/configuration/test_bad_data.py::test_max_length_above_the_models_positions."""
    from transformers import FNetConfig, FNetForSequenceClassification

    from headsweep.sweep.demo.sentiment import build_tokenizer

    tok = build_tokenizer()
    model_dir = tmp_path / "fnet"
    FNetForSequenceClassification(FNetConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                             intermediate_size=32, num_labels=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    worker_refused(config_file(tmp_path, model_dir, tiny_dev_tsv),
                   "no attention modules recognised in FNetForSequenceClassification")


def test_data_problems(tmp_path, tiny_bert_dir, ray_address):
    """A missing column and an empty file through the CLI (the driver's checks); a label outside the model's label
    set in the worker's load (``worker_refused``), whose refusal through the CLI is
    tests/configuration/test_bad_input_probe.py::test_importance_data_labels_are_checked_before_the_baseline."""
    bad_cols = tmp_path / "cols.tsv"
    bad_cols.write_text("text\tlabel\nthe film was good\t1\n")
    fail(tmp_path, ray_address, config_file(tmp_path, tiny_bert_dir, bad_cols), "has no column 'sentence'")
    bad_labels = tmp_path / "labels.tsv"
    bad_labels.write_text("sentence\tlabel\nthe film was good\t1\nthe film was bad\t7\n")
    worker_refused(config_file(tmp_path, tiny_bert_dir, bad_labels),
                   "labels outside the model's label set: '7' in row 2 (line 3)")
    empty = tmp_path / "empty.tsv"
    empty.write_text("sentence\tlabel\n")
    fail(tmp_path, ray_address, config_file(tmp_path, tiny_bert_dir, empty), "has no examples")


def test_head_out_of_range_in_mask(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    cfg = config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv, sweep={"masks": [["self:0:1", "self:1:9"]]})
    fail(tmp_path, ray_address, cfg, "head self:1:9: head 9 out of range (self layer 1 has 4 heads, 0..3)")


def test_store_not_writable(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli("run", str(config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv)), "--store", str(blocker / "store"))
    assert proc.returncode == 2 and "is not writable" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_interrupted_run_is_marked_and_store_stays_valid(tmp_path, wide_bert_dir, tiny_dev_tsv, ray_address):
    # Ctrl-C after 3 rows of 33 (40 examples each): the run is long in masks, so that it is still going when the
    # signal comes even on a fast machine, and short per mask, so that the interrupt waits little.
    cfg = config_file(tmp_path, wide_bert_dir, tiny_dev_tsv,
                      sweep={"experiments": ["single_head", "all_but_one"], "batch_size": 8,
                             "masks_per_batch": 1, "flush_every": 1, "workers": 1})
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(cfg), "--store", str(store),
                             "--address", ray_address, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    reader = ResultStore(str(store))
    deadline = time.monotonic() + 600  # left as soon as the rows are there; a loaded machine is slow to start
    while time.monotonic() < deadline and reader.read("evaluations").num_rows < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "marked interrupted" in err
    [run] = reader.read("runs").to_pylist()
    assert run["status"] == "interrupted"
    evals = reader.read("evaluations").column("eval_id").to_pylist()
    assert 3 <= len(evals) < run["n_planned"] and len(set(evals)) == len(evals)
    assert run["n_done"] == len(evals)
    assert run["n_planned"] == 33  # baseline + 16 single-head + 16 all-but-one
    assert reader.read("examples").num_rows == 40 * len(evals)


@pytest.mark.parametrize("signum, code, by", [
    pytest.param(signal.SIGINT, 130, "", id="SIGINT"),
    # SIGTERM's handler, exit code 143 and "(SIGTERM)" in the line, mid-run: tests/run/test_resume.py::
    # test_killed_or_stopped_then_rerun_computes_only_the_missing (its SIGTERM step); before the first row: SIGINT here
    pytest.param(signal.SIGTERM, 143, " (SIGTERM)", id="SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_before_the_first_row_leaves_no_store(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address, signum,
                                                       code, by):
    """Ctrl-C or SIGTERM while optimal ablation trains its constants (before the run's first row): exit 130 or
    143 and one line that says nothing was written, no store made; the signal again during the cleanup changes
    nothing."""
    from headsweep.sweep.demo.sentiment import generate, write_tsv

    reference = write_tsv(generate(2000, seed=3), tmp_path / "reference.tsv")
    cfg = config_file(tmp_path, tiny_bert_dir, tiny_dev_tsv, sweep={"ablation": "optimal", "workers": 1},
                      extra={"ablation": {"reference": {"path": str(reference)}, "steps": 5000}})
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "headsweep", "run", str(cfg), "--store", str(store),
                             "--address", ray_address, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    seen = []
    while not any(line.startswith("optimal ablation: training") for line in seen):
        line = proc.stderr.readline()
        assert line, "".join(seen)  # the command ended before training
        seen.append(line)
    proc.send_signal(signum)
    time.sleep(0.3)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    lines = [x.rstrip("\n") for x in seen] + err.splitlines()
    assert proc.returncode == code, lines[-20:]
    assert [x for x in lines if x.startswith("headsweep: interrupted")] == \
        [f"headsweep: interrupted{by}: stopped before the run wrote anything; the store is as it was"], lines[-20:]
    assert "Traceback" not in err and out == ""
    assert not store.exists()


@pytest.mark.parametrize("argv", [["run"], ["query"], ["nosuch"]])
def test_usage_errors(argv):
    assert run_cli(*argv).returncode == 2
