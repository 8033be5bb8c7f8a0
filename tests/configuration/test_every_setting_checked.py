"""Settings that were accepted without a word, or ended in a traceback or an "unexpected" error (issue 45, items 6
and 7): each refused through the real CLI in one line, exit 2, no traceback, before Ray starts, nothing written.

The ``run`` cases run side by side (``refused_before_any_worker``: about a CLI start each). The ranges themselves are
declared once on the config fields (``headsweep.workers.core.setting_ranges``); ``tests/project/test_docs.py`` checks
that every numeric field has one and that docs/configuration.md states it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, error_line, run_cli
from local_cluster import free_ports
from test_bad_data import ROWS, classifier_config, write_rows
from test_bad_input_probe import refused, refused_before_any_worker

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster.jobs import BUNDLE_VAR
from headsweep.sweep.configuration.sections import SignificanceSection
from headsweep.sweep.statistics.significance import paired_bootstrap
from headsweep.sweep.statistics.significance_runner import bootstrap_bytes, check_resample_memory
from headsweep.workers.core.metrics import metric_by_name
from headsweep.workers.core.setting_ranges import Range


def _cases(tmp: Path, model_dir: Path, data: Path) -> list[tuple[str, list[str], str]]:
    """``(case, headsweep run arguments, the line after "headsweep: error: ")``."""
    c = str(classifier_config(tmp, model_dir, {"path": str(data)}))
    translation = tmp / "mt.yaml"
    translation.write_text(yaml.safe_dump({"model": {"kind": "fairseq_translation", "checkpoint": str(tmp / "m.pt"),
                                                     "data_bin": str(tmp)},
                                           "data": {"source": str(tmp / "s.txt"), "target": str(tmp / "t.txt")}}))
    mt = str(translation)
    deep = tmp / "deep.yaml"
    deep.write_text("name: " + "[" * 20_000 + "]" * 20_000 + "\n")
    twice = tmp / "twice.tsv"
    twice.write_text("sentence\tlabel\tlabel\n" + "".join(f"{s}\t{y}\t{y}\n" for s, y in ROWS))
    train = write_rows(ROWS[:20], tmp / "train.tsv")
    cpus = len(os.sched_getaffinity(0))
    tag = "name=!!python/object/apply:os.system [true]"
    return [
        ("flush_every 0", [c, "sweep.flush_every=0"], "sweep.flush_every must be at least 1, got 0"),
        ("flush_seconds -1", [c, "sweep.flush_seconds=-1"], "sweep.flush_seconds must be positive, got -1"),
        ("threads -1", [c, "sweep.threads_per_worker=-1"], "sweep.threads_per_worker must be at least 0, got -1"),
        ("masks_per_batch -1", [c, "sweep.masks_per_batch=-1"], "sweep.masks_per_batch must be at least 0, got -1"),
        ("threads 5000", [c, "sweep.threads_per_worker=5000"],
         f"sweep.threads_per_worker=5000 is more than the {cpus} CPUs this machine has: use at most {cpus} (or 0, "
         "the CPUs shared out among the workers)"),
        ("n_resamples 1e9", [c, "significance.n_resamples=1000000000"],
         "significance.n_resamples must be from 1 to 1000000, got 1000000000"),
        ("no tests", [c, "significance.tests=[]"],
         "significance.tests is empty while significance is enabled, so no evaluation would be tested: leave it out "
         "(the metric's own tests), name tests (e.g. significance.tests=[paired_bootstrap]), or set "
         "significance.enabled=false"),
        ("no levels", [c, "sweep.experiments=[prune_level]", f"importance.data.path={train}", "prune.levels=[]"],
         "prune.levels is empty, so prune_level would evaluate nothing: list the shares of heads to prune (e.g. "
         "prune.levels=[0.1,0.5]), or leave prune_level out of sweep.experiments"),
        ("level 1.5", [c, "sweep.experiments=[prune_level]", f"importance.data.path={train}", "prune.levels=[0.5,1.5]"],
         "each value of prune.levels must be from 0 to 1, got 1.5"),
        ("optimal, 0 steps", [c, "sweep.ablation=optimal", "ablation.steps=0"],
         "ablation.steps must be at least 1, got 0"),
        ("checkpoint twice", [c, f"checkpoints=[{model_dir},{model_dir}/.]"],
         f"checkpoints names {model_dir}/. twice (as {model_dir} and {model_dir}/.): name each checkpoint once"),
        ("override twice", [c, "sweep.workers=1", "sweep.workers=2"],
         "override sweep.workers is given twice (sweep.workers=1 and sweep.workers=2): give it once"),
        ("--workers and override", [c, "sweep.workers=1", "--workers", "2"],
         "--workers 2 and sweep.workers=1 both set the number of workers: give one"),
        ("override with a tag", [c, tag],
         f"bad override {tag!r}: could not determine a constructor for the tag "
         "'tag:yaml.org,2002:python/object/apply:os.system' (configs take only YAML's standard tags, as in a config "
         "file); quote the value if you mean it as text"),
        ("nested 20,000 deep", [str(deep)],
         f"config file {deep}: line 1, column 38: values nest more than 32 levels deep (a config needs a handful)"),
        ("nested override", [c, "sweep.masks=" + "[" * 100 + "]" * 100],
         "bad override 'sweep.masks=" + "[" * 100 + "]" * 100 + "': values nest more than 32 levels deep (a config "
         "needs a handful)"),
        ("column twice", [c, f"data.path={twice}"],
         f"data file {twice} names column 'label' 2 times (columns: sentence, label, label): give each column its own "
         "name"),
        ("max_len_b -1", [mt, "model.max_len_b=-1"], "model.max_len_b must be at least 1, got -1"),
        ("min_len -1", [mt, "model.min_len=-1"], "model.min_len must be at least 0, got -1"),
        ("no_repeat_ngram_size -1", [mt, "model.no_repeat_ngram_size=-1"],
         "model.no_repeat_ngram_size must be at least 0 (0: n-grams may repeat), got -1"),
        ("min_len above max_len_b", [mt, "model.min_len=20", "model.max_len_b=10"],
         "model.min_len=20 is longer than the longest output a one-token source may have (model.max_len_a * source "
         "length + model.max_len_b = 10): lower model.min_len or raise model.max_len_b"),
    ]


def test_settings_once_accepted_or_unexpected_are_refused_before_ray(tmp_path, tiny_bert_dir):
    data = write_rows(ROWS, tmp_path / "dev.tsv")
    refused_before_any_worker(_cases(tmp_path, tiny_bert_dir, data), tmp_path / "store")


def test_a_log_dir_that_is_a_file_is_refused(tmp_path, tiny_bert_dir):
    """Was: the logs went to the temporary folder without a word."""
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(write_rows(ROWS, tmp_path / "dev.tsv"))})
    not_a_folder = tmp_path / "logs.txt"
    not_a_folder.write_text("mine\n")
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), env={"HEADSWEEP_LOG_DIR": str(not_a_folder)})
    refused(proc, f"HEADSWEEP_LOG_DIR={not_a_folder} is a file, not a folder: point it at a folder for the log files "
                  "(made if missing), or unset it")
    assert not (tmp_path / "store").exists() and not_a_folder.read_text() == "mine\n"


def test_submit_refuses_a_runtime_env_that_is_no_object_and_warns_about_relative_paths(tmp_path, tiny_bert_dir):
    """Was: "unexpected TypeError" for ``--runtime-env-json '[1,2]'``, and no word about relative paths, which the
    job resolves in its own folder on the cluster. Both before the job API is asked (nothing listens there)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    write_rows(ROWS, conf / "dev.tsv")
    (conf / "c.yaml").write_text(yaml.safe_dump({"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                                                 "data": {"path": "dev.tsv"}, "sweep": {"experiments": ["baseline"]}}))
    (port,) = free_ports(1)  # nothing listens there
    address = f"http://127.0.0.1:{port}"
    common = [str(conf / "c.yaml"), "--address", address, "--store", str(tmp_path / "store")]
    bad = run_cli("submit", *common, "--runtime-env-json", "[1,2]")
    refused(bad, "--runtime-env-json must be a JSON object of runtime_env fields (e.g. "
                 "'{\"env_vars\": {\"HF_HOME\": \"/cache\"}}'), got [1, 2]")
    relative = run_cli("submit", *common, "roles.parses=p.conllu")
    assert relative.returncode == 2 and "Traceback" not in relative.stderr
    assert error_line(relative.stderr).startswith(f"headsweep: error: cannot reach the Ray job API at {address}")
    warning = [x for x in relative.stderr.splitlines() if x.startswith("headsweep: warning:")]
    assert warning == ["headsweep: warning: data.path=dev.tsv, roles.parses=p.conllu: relative paths resolve inside "
                       "the job's folder on the cluster, which holds only the config files; use absolute paths (or "
                       "URIs) that the cluster's nodes see"], relative.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("bundle", "expected"), [
    ("not json", f"${BUNDLE_VAR} is not the JSON `headsweep submit` writes (Expecting value: line 1 column 1 "
                 "(char 0)): submit the config again with headsweep submit"),
    ('{"files": [1]}', f"${BUNDLE_VAR} must be a JSON object {{\"files\": {{relative path: text}}}}, as headsweep "
                       "submit writes it: submit the config again with headsweep submit"),
    ('{"files": {"ABS": "name: x"}}', "config bundle path 'ABS' is not a relative path: a bundle names its files "
                                      "relative to its folder"),
    ('{"files": {"ok.yaml": "name: x", "../escape.yaml": "name: x"}}',
     "config bundle path '../escape.yaml' leaves its folder"),
])
def test_the_job_entry_point_refuses_a_bundle_it_did_not_get_from_submit(tmp_path, bundle, expected):
    """Was: a Python traceback on the cluster. Nothing is written: not the files before the bad one either."""
    absolute = tmp_path / "abs.yaml"
    bundle, expected = bundle.replace("ABS", str(absolute)), expected.replace("ABS", str(absolute))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, BUNDLE_VAR: bundle, "TMPDIR": str(scratch), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "headsweep.sweep.cluster.job_entry", "run", "ok.yaml"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"headsweep: error: {expected}"]
    assert not absolute.exists() and not (tmp_path / "escape.yaml").exists() and not list(scratch.iterdir())


# -- the resamples' memory ---------------------------------------------------------------------------------------
def test_the_bootstrap_memory_estimate_bounds_what_the_bootstrap_takes():
    """The estimate the check uses, against the peak numpy allocates in a real paired bootstrap of a full batch of
    tests (``tracemalloc`` sees numpy's buffers): at least the peak, and not far above it."""
    n_resamples, n_examples, systems = 3000, 200, 32
    rng = np.random.default_rng(0)
    baseline = rng.integers(0, 2, size=(n_examples, 1)).astype(np.float64)
    batch = rng.integers(0, 2, size=(systems, n_examples, 1)).astype(np.float64)
    accuracy = metric_by_name("accuracy").score_from_stats
    tracemalloc.start()
    try:
        paired_bootstrap(baseline, batch, accuracy, n_resamples=n_resamples, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = bootstrap_bytes(n_resamples, n_examples, systems)
    assert peak <= estimate <= 2 * peak, (peak, estimate)


def test_resamples_that_cannot_fit_are_refused_before_the_first_row():
    """The check ``open_run`` makes once the evaluation set's size is known: the machine's available memory, capped
    by ``sweep.memory_limit_gib``; tests without resamples, or significance off, are not held to it."""
    big = SignificanceSection(n_resamples=1_000_000)
    with pytest.raises(HeadsweepError) as err:
        check_resample_memory(big, ["paired_bootstrap"], 3000, available=8 << 30)
    assert str(err.value) == (
        "significance.n_resamples=1,000,000 paired-bootstrap resamples of 3,000 examples take about 15.5 GiB per "
        "batch of tests, more than half of the 8.0 GiB available (MemAvailable): use significance.n_resamples=243,"
        "207 or fewer (sacrebleu's default is 1,000)")
    fits = SignificanceSection(n_resamples=243_207)
    check_resample_memory(fits, ["paired_bootstrap"], 3000, available=8 << 30)
    with pytest.raises(HeadsweepError):
        check_resample_memory(SignificanceSection(n_resamples=243_208), ["paired_bootstrap"], 3000, 8 << 30)
    with pytest.raises(HeadsweepError, match=r"half of the 2.0 GiB available \(sweep.memory_limit_gib\)"):
        check_resample_memory(SignificanceSection(n_resamples=100_000), ["paired_bootstrap"], 3000, 8 << 30, 2.0)
    check_resample_memory(big, ["paired_ttest", "mcnemar_exact"], 3000, available=8 << 30)
    check_resample_memory(SignificanceSection(enabled=False, n_resamples=1_000_000), ["paired_bootstrap"], 3000,
                          available=8 << 30)
    check_resample_memory(SignificanceSection(), ["paired_bootstrap"], 3000, available=8 << 30)


def test_range_wording():
    """How the reference and the refusals write a range (the wording the docs test looks for)."""
    assert [Range(1).text(), Range(0, low_open=True).text(), Range(0, 1, True, True).text(), Range(0, 1).text(),
            Range(0, 1, high_open=True).text(), Range(high=5).text(), Range().text()] == \
        ["at least 1", "positive", "in (0, 1)", "from 0 to 1", "in [0, 1)", "at most 5", "any number"]
    assert Range(0, 1).contains(1) and not Range(0, 1, high_open=True).contains(1)
    assert not Range(0, low_open=True).contains(float("nan"))
    assert Range(1).refusal("a.b", 0.0) == "a.b must be at least 1, got 0"
    assert json.dumps(Range(0, low_open=True).refusal("x", 1e-5)) == '"x must be positive, got 1e-05"'


def test_threads_on_a_cluster_are_held_to_its_largest_node():
    """With ``--address`` the driver's machine says nothing of the workers': the check waits for the cluster's nodes."""
    from headsweep.sweep.cluster.placement import NodeResources, check_placement
    from headsweep.sweep.configuration.config import build_config

    def cfg(threads: int):
        return build_config({"model": {"kind": "hf_classifier", "path": "m"}, "data": {"path": "d.tsv"},
                             "sweep": {"threads_per_worker": threads}})

    nodes = [NodeResources(cpus=4, gpus=0), NodeResources(cpus=8, gpus=0)]
    check_placement(cfg(8), nodes)
    with pytest.raises(HeadsweepError) as err:
        check_placement(cfg(9), nodes)
    assert str(err.value) == ("sweep.threads_per_worker=9 is more than the 8 CPUs of the Ray cluster's largest node: "
                              "use at most 8 (or 0, the CPUs shared out among the workers)")
