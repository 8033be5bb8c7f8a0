"""Data-file messages and config checks from the probe of a shared cluster service, each through the
real CLI where the user meets it: one line ``headsweep: error: ...``, exit code 2, no traceback, nothing written.

The driver-side cases need no Ray and no model, and run side by side; the workers' wait needs the session's Ray.
Rows of data count from 1, with the line an editor shows (``row 3 (line 4)``: a TSV or CSV header is line 1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import error_line, run_cli
from test_bad_data import ROWS, classifier_config, write_rows
from test_bad_input_probe import refused_before_any_worker

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import build_config
from headsweep.workers.data.example_subset import at_positions
from headsweep.workers.families.hf_classifier.config import ClassifierData
from headsweep.workers.families.hf_classifier.data import label_ids, read_examples

SEED_RANGE = "must be a whole number from 0 to 2**63 - 1"


def truncated_jsonl(path: Path) -> Path:
    """The demo rows as JSONL, cut off inside the last line's sentence (as a copy that stopped)."""
    text = write_rows(ROWS, path).read_text(encoding="utf-8").rstrip("\n")
    path.write_text(text[: text.rindex('"sentence": "') + 20], encoding="utf-8")
    return path


def expected_workers_remedy() -> str:
    """What the refusal of 64 workers in a 4 GiB share recommends here: 3 workers fit in memory (the tiny model and
    the 1 GiB activation budget each), no more than this machine's CPUs run at once."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 3:
        return f"use sweep.workers={cpus} (what the machine's {cpus} CPUs run at once; 3 fit in memory), "
    return "use sweep.workers=3, "


def driver_cases(tmp: Path, model_dir: Path) -> list[tuple[str, list[str], str]]:
    """``(case, headsweep run arguments, the line expected after "headsweep: error: ")``."""
    data = write_rows(ROWS, tmp / "dev.tsv")
    copy = tmp / "copy.tsv"
    shutil.copyfile(data, copy)
    comma = write_rows(ROWS, tmp / "dev.csv")
    cut = truncated_jsonl(tmp / "cut.jsonl")
    ragged = tmp / "ragged.csv"
    ragged.write_text("sentence,label\na fine film,1\n\ndull, long and loud,0\n")
    config = str(classifier_config(tmp, model_dir, {"path": str(data)}))
    last = len(ROWS)
    return [
        ("truncated jsonl", [config, f"data.path={cut}"],
         f"data file {cut}: line {last} is not JSON (Unterminated string starting at, column 14): it is the last "
         "line, so the file may be truncated (cut off mid-line); write or copy it again"),
        ("tsv on a comma-separated file", [config, f"data.path={comma}", "data.format=tsv"],
         f"data file {comma} is read as tsv (data.format) but its header line has no tab and looks comma-separated: "
         "set data.format=csv"),
        ("a csv row with a field too many", [config, f"data.path={ragged}"],
         f"cannot read data file {ragged} as csv: row 2 (line 4) has 3 field(s) where the header has 2 ('dull, long "
         "and loud,0'); a value holding a comma must be in double quotes"),
        ("csv on a tab-separated file", [config, "data.format=csv"],
         f"data file {data} is read as csv (data.format) but its header line has no comma and looks tab-separated: "
         "set data.format=tsv"),
        ("importance.data a copy of the evaluation file",
         [config, "sweep.experiments=[importance]", f"importance.data.path={copy}"],
         f"importance.data is the evaluation set ({copy} holds the same bytes as {data}); estimate importance on "
         "training or validation data, or set importance.allow_eval_data: true"),
        ("ablation.reference a copy of the evaluation file",
         [config, "sweep.ablation=optimal", f"ablation.reference.path={copy}"],
         f"ablation.reference is the evaluation set ({copy} holds the same bytes as {data}); train optimal "
         "ablation's constants on training or validation data, or set ablation.allow_eval_data: true"),
        ("ablation.seed -5", [config, "sweep.ablation=resample", "ablation.seed=-5"],
         f"ablation.seed {SEED_RANGE}, got -5"),
    ]


def test_data_and_config_problems_are_refused_before_any_worker(tmp_path, tiny_bert_dir):
    """Each case costs one CLI start: no Ray, no worker, no model (a case that reached the workers would start an
    embedded Ray instance and say ``workers ready``), no store."""
    refused_before_any_worker(driver_cases(tmp_path, tiny_bert_dir), tmp_path / "store", side_by_side=3)


def test_too_many_workers_are_held_to_the_cpus(tmp_path, tiny_bert_dir):
    """Was: 64 workers refused with "use sweep.workers=18" on a 2-CPU machine (what fits in memory), and 18 then
    loaded for minutes. Refused before Ray starts (no --address: the memory check runs on this machine)."""
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(write_rows(ROWS, tmp_path / "dev.tsv"))},
                               workers=64, memory_limit_gib=4)
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert line.startswith("headsweep: error: 64 workers cannot hold this model: "), line
    assert ", and 4.00 GiB is available (sweep.memory_limit_gib; the machine has " in line
    assert line.endswith(f": {expected_workers_remedy()}or a larger sweep.memory_limit_gib or a machine with more "
                         "memory"), line
    assert "Traceback" not in proc.stderr and "workers ready" not in proc.stderr
    assert not (tmp_path / "store").exists()


def test_workers_waiting_for_resources_are_reported(tmp_path, tiny_bert_dir, ray_address):
    """Was: silence until sweep.placement_timeout_s. A worker asking a GPU the cluster does not have (an
    autoscaling cluster's wait: sweep.wait_for_resources) is reported after 10 s, then refused at the timeout."""
    store = tmp_path / "store"
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(write_rows(ROWS, tmp_path / "dev.tsv"))},
                               num_gpus_per_worker=1, wait_for_resources=True, placement_timeout_s=13)
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address)
    assert proc.returncode == 2, proc.stderr
    free = r"each worker asks 1 CPU and 1 GPU; the cluster has [\d.]+ CPUs? and 0 GPUs free"
    waiting = [line for line in proc.stderr.splitlines() if "workers ready after" in line]
    assert len(waiting) == 1, proc.stderr
    assert re.fullmatch(rf"0 of 1 workers ready after 1\d s: 1 waiting for resources \({free}; "
                        r"sweep.placement_timeout_s: 13 s\)", waiting[0]), waiting[0]
    line = error_line(proc.stderr)
    assert re.fullmatch(rf"headsweep: error: 1 of 1 workers did not start within 13 s \(sweep.placement_timeout_s\): "
                        rf"{free}", line), line
    assert "Traceback" not in proc.stderr and not store.exists()


# -- the same rules, through the readers, where another CLI run would add only seconds ------------------------
def test_rows_count_from_1_with_the_line_they_are_on(tmp_path):
    """Blank lines, and a CSV value quoted across lines, move a row's line away from its number."""
    tsv = tmp_path / "d.tsv"
    tsv.write_text("sentence\tlabel\ngood\t1\n\nbad\t\nfine\t\n")
    with pytest.raises(HeadsweepError) as err:
        read_examples(ClassifierData(path=str(tsv)))
    assert str(err.value) == (f"data file {tsv}: empty label in rows 2 (line 4) and 3 (line 5) (column 'label'): "
                              "every example needs its label")
    csv = tmp_path / "d.csv"
    csv.write_text('sentence,label\n"a film\nin two lines",1\n\n"bad",\n')
    with pytest.raises(HeadsweepError) as err:
        read_examples(ClassifierData(path=str(csv)))
    assert str(err.value) == (f"data file {csv}: empty label in row 2 (line 5) (column 'label'): every example "
                              "needs its label")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"sentence": "good", "label": 1}\n\n{"sentence": "bad", "label": "awful"}\n')
    examples = read_examples(ClassifierData(path=str(jsonl)))
    with pytest.raises(HeadsweepError) as err:
        label_ids(examples.labels, {0: "negative", 1: "positive"}, str(jsonl), examples.row)
    assert str(err.value) == (f"data file {jsonl}: labels outside the model's label set: 'awful' in row 2 (line 3) "
                              "(model labels: 0=negative, 1=positive)")
    # A screening subset names the file's rows, not its own positions.
    subset = at_positions(examples, [1])
    with pytest.raises(HeadsweepError, match=r"'awful' in row 2 \(line 3\)"):
        label_ids(subset.labels, {0: "negative", 1: "positive"}, str(jsonl), subset.row)


@pytest.mark.parametrize(("name", "text", "line"), [
    ("missing.csv", "sentence,label\ngood,1\n\n\nbad\nfine,1\n",
     "row 2 (line 5) has 1 field(s) where the header has 2 ('bad'); each row needs one value per column of the "
     "header, separated by a comma"),
    ("quoted.csv", 'sentence,label\n"a film\nin two lines",1\ngood,0,1\n',
     "row 2 (line 4) has 3 field(s) where the header has 2 ('good,0,1'); a value holding a comma must be in double "
     "quotes"),
    ("unclosed.csv", 'sentence,label\ngood,1\n"bad,0\nfine,1\n',
     "row 2 (line 3) has 1 field(s) where the header has 2 ('\"bad,0'); a quote opened in it is never closed (a "
     'literal quote inside a quoted value is written twice: "")'),
    ("tab.tsv", "sentence\tlabel\ngood\t1\n\nbad\tworse\t0\n",
     "row 2 (line 4) has 3 field(s) where the header has 2 ('bad\\tworse\\t0'); tsv has no quoting: a value "
     "cannot hold a tab (or use data.format=csv with quoted values)"),
])
def test_a_malformed_row_is_named_by_its_row_and_line(tmp_path, name, text, line):
    """pyarrow's own parse error names no line (and, read on several threads, no row): the refusal names the row
    from 1 and the line an editor shows, past blank lines and quoted line breaks."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(HeadsweepError) as err:
        read_examples(ClassifierData(path=str(path)))
    assert str(err.value) == f"cannot read data file {path} as {name[-3:]}: {line}"


def test_a_bad_line_inside_a_jsonl_file_is_not_called_truncated(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"sentence": "good", "label": 1}\n{"sentence": "bad" "label": 0}\n{"sentence": "x", "label": 1}')
    with pytest.raises(HeadsweepError) as err:
        read_examples(ClassifierData(path=str(jsonl)))
    assert str(err.value) == f"data file {jsonl}: line 2 is not JSON (Expecting ',' delimiter, column 20)"
    jsonl.write_text('{"sentence": "good", "label": 1}\n[1, 2]\n')
    with pytest.raises(HeadsweepError) as err:
        read_examples(ClassifierData(path=str(jsonl)))
    assert str(err.value) == (f"data file {jsonl}: line 2 is a JSON list, not an object with the columns "
                              "('sentence', 'label')")


def test_a_file_of_the_same_size_is_not_a_copy(tmp_path, tiny_bert_dir):
    """Sizes match, bytes differ: other data (the hashes decide); the copy is refused at config time."""
    data = write_rows(ROWS, tmp_path / "dev.tsv")
    other = tmp_path / "train.tsv"
    other.write_bytes(data.read_bytes().replace(b"\t1\n", b"\t0\n", 1))
    assert other.stat().st_size == data.stat().st_size and other.read_bytes() != data.read_bytes()
    raw = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(data)},
           "sweep": {"experiments": ["importance"]}}
    build_config({**raw, "importance": {"data": {"path": str(other)}}})
    with pytest.raises(HeadsweepError, match="importance.data is the evaluation set"):
        build_config({**raw, "importance": {"data": {"path": str(shutil.copyfile(data, tmp_path / "copy.tsv"))}}})


@pytest.mark.parametrize(("key", "section"), [("seed", None), ("significance.seed", "significance"),
                                              ("l0.seed", "l0")])
def test_every_seed_is_checked_the_same_way(tmp_path, tiny_bert_dir, key, section):
    raw: dict = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
                 "data": {"path": str(write_rows(ROWS[:4], tmp_path / "dev.tsv"))}}
    value = 2**63 if key == "significance.seed" else -1
    raw.update({key: value} if section is None else {section: {"seed": value}})
    with pytest.raises(HeadsweepError) as err:
        build_config(raw)
    assert str(err.value) == f"{key} {SEED_RANGE}, got {value}"
    raw.update({key: 2**63 - 1} if section is None else {section: {"seed": 2**63 - 1}})
    build_config(raw)


def test_jsonl_rows_round_trip(tmp_path):
    """Read line by line, a JSONL file gives what pyarrow gave: text as written, labels as strings, ids by row."""
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in ROWS[:3]) + "\n")
    examples = read_examples(ClassifierData(path=str(jsonl)))
    assert examples.texts == [s for s, _ in ROWS[:3]] and examples.labels == [str(y) for _, y in ROWS[:3]]
    assert (examples.ids, examples.rows, examples.lines) == (["0", "1", "2"], [1, 2, 3], [1, 2, 3])
