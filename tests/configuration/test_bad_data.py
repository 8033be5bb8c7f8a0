"""Bad data and broken model files through the real CLI: one line naming the file and the cause, exit
code 2, and a store left exactly as it was (its runs and its files); suspicious data counted, not changed.

Every failure through the CLI runs against a copy of a store that already holds one complete run, so that
"unchanged" covers an existing store's files and rows, not only an empty folder. A few refusals the workers make
are checked in the worker's load in this process (``worker_refused``), where another case of the same family takes
that route through the CLI.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import error_line, run_cli
from small_store import small_store

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate

BAD = b"\xe9"  # latin-1 for "e acute": never valid UTF-8 on its own


# -- helpers -------------------------------------------------------------------------------------------
def classifier_config(tmp_path: Path, model_dir: Path, data: dict, name: str = "c.yaml", **sweep) -> Path:
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(model_dir)},
        "data": data,
        "sweep": {"experiments": ["baseline"], "workers": 1, **sweep},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def translation_config(tmp_path: Path, tiny, model: dict | None = None, data: dict | None = None, **sweep) -> Path:
    cfg = {
        "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint),
                  "data_bin": str(tiny.data.data_bin), "beam": 2, **(model or {})},
        "data": {"source": str(tiny.data.test_source), "target": str(tiny.data.test_target), **(data or {})},
        "sweep": {"experiments": ["baseline"], "workers": 1, "batch_size": 20, **sweep},
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def listing(store: Path) -> list[tuple]:
    """Every file under the store with its size and modification time, and every folder."""
    return sorted((str(p.relative_to(store)), *((p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else ()))
                  for p in store.rglob("*"))


def runs(store: Path) -> list[dict]:
    return sorted(ResultStore(str(store)).read("runs").to_pylist(), key=lambda r: r["run_id"])


def refused(store: Path, config: Path, address: str, *parts: str) -> str:
    """Run ``config`` into ``store``: it must fail with one ``headsweep: error:`` line holding ``parts``, exit
    code 2, no traceback and no output, and leave the store's files and ``runs`` as they were."""
    before = listing(store), runs(store)
    proc = run_cli("run", str(config), "--store", str(store), "--address", address, "--quiet")
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == "", proc.stderr
    for part in parts:
        assert part in line, line
    assert (listing(store), runs(store)) == before
    return line


def worker_refused(config: Path, *parts: str) -> str:
    """What a worker makes of ``config`` when it loads its model and data, in this process: the driver's file checks
    (``ModelFamily.check_model``) pass, and ``ModelFamily.load`` (the adapter each actor builds first) refuses with
    a ``HeadsweepError`` holding every one of ``parts``; returns its message.

    For refusals whose route through the CLI (the worker's error as the one line, exit code 2, the store as it was)
    another case of the same family covers, ``refused`` here: a CLI run costs an actor's start (torch and
    transformers imported again, 8-10 s) and would add nothing to the message checked."""
    from headsweep.sweep.configuration.config import load_config
    from headsweep.workers.families.registry import model_family

    cfg = load_config(config)
    family = model_family(cfg.model.kind)
    family.check_model(cfg.model)
    with pytest.raises(HeadsweepError) as refusal:
        family.load(cfg.model, cfg.data, family.runtime())
    message = str(refusal.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


def with_bad_byte(text: bytes, line_no: int, word: bytes) -> tuple[bytes, int]:
    """``text`` with one non-UTF-8 byte inside ``word`` on line ``line_no`` (1-based); and the byte's offset."""
    lines = text.split(b"\n")
    at = lines[line_no - 1].index(word) + 2
    lines[line_no - 1] = lines[line_no - 1][:at] + BAD + lines[line_no - 1][at:]
    offset = sum(len(x) + 1 for x in lines[: line_no - 1]) + at
    return b"\n".join(lines), offset


def write_rows(rows: list[tuple[str, int]], path: Path) -> Path:
    """The demo rows as TSV, CSV or JSONL (by the suffix of ``path``), UTF-8."""
    if path.suffix == ".tsv":
        text = "sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows)
    elif path.suffix == ".csv":
        text = "sentence,label\n" + "".join(f'"{s}",{y}\n' for s, y in rows)
    else:
        text = "".join(json.dumps({"sentence": s, "label": y}, ensure_ascii=False) + "\n" for s, y in rows)
    path.write_text(text, encoding="utf-8")
    return path


def examples_of(store: Path, run_id: str) -> list[tuple]:
    rows = ResultStore(str(store)).read("examples", run_id).to_pylist()
    return sorted((r["eval_id"], r["example_id"], tuple(r["stats"]), r["loss"]) for r in rows)


# -- fixtures ------------------------------------------------------------------------------------------
ROWS = generate(40, seed=7)


@pytest.fixture(scope="module")
def full_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv) -> Path:
    """A store holding one complete run: the session's small store (tests/small_store.py, over ``tiny_dev_tsv``,
    the same rows as ``ROWS``), which other modules on this process build or read anyway, so no run of its own."""
    store, _, _ = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    assert len(runs(store)) == 1
    return store


@pytest.fixture
def store(tmp_path, full_store) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(full_store, dest)
    return dest


@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny fairseq model (conftest.trained_tiny_fairseq: read, never changed)."""
    return trained_tiny_fairseq


# -- undecodable bytes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl"])
def test_a_byte_that_is_not_utf8_stops_the_run(tmp_path, store, tiny_bert_dir, ray_address, suffix):
    """Was: the text column read as bytes, every sentence "b'...'", exit 0 and a wrong accuracy."""
    clean = write_rows(ROWS, tmp_path / f"clean{suffix}")
    line_no = 5 if suffix != ".jsonl" else 4  # TSV and CSV have a header line
    word = ROWS[3][0].split()[0].encode()
    data, offset = with_bad_byte(clean.read_bytes(), line_no, word)
    bad = tmp_path / f"dev{suffix}"
    bad.write_bytes(data)
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(bad)})
    refused(store, config, ray_address, f"data file {bad}: line {line_no} is not valid utf-8 text",
            f"byte 0xe9 at byte offset {offset}", "set data.encoding")


def test_data_encoding_reads_a_latin1_file_as_its_utf8_twin(tmp_path, tiny_bert_dir, ray_address):
    """``data.encoding: latin-1`` reads the file above correctly: the same results as the same text in UTF-8."""
    rows = [(f"café {s}" if i % 3 == 0 else s, y) for i, (s, y) in enumerate(ROWS)]
    utf8 = write_rows(rows, tmp_path / "utf8.tsv")
    latin1 = tmp_path / "latin1.tsv"
    latin1.write_bytes(utf8.read_text(encoding="utf-8").encode("latin-1"))
    assert BAD in latin1.read_bytes()
    store = tmp_path / "store"
    run_ids = []
    for path, encoding in ((utf8, "utf-8"), (latin1, "latin-1")):
        config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(path), "encoding": encoding})
        proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
        assert proc.returncode == 0, proc.stderr
        run_ids.append(proc.stdout.strip().splitlines()[-1])
    first, second = (next(r for r in runs(store) if r["run_id"] == i) for i in run_ids)
    assert first["baseline_score"] == second["baseline_score"]
    assert json.loads(second["facts"])["encoding"] == "latin-1"
    strip = [(e[1:]) for e in examples_of(store, run_ids[0])]
    assert strip == [(e[1:]) for e in examples_of(store, run_ids[1])] and len(strip) == len(rows)


def test_an_unknown_encoding_is_one_line(tmp_path, store, tiny_bert_dir, ray_address):
    path = write_rows(ROWS, tmp_path / "dev.tsv")
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(path), "encoding": "utf-9"})
    refused(store, config, ray_address, "data.encoding 'utf-9' is not a text encoding")


@pytest.mark.parametrize("compressed", [False, True])
def test_a_byte_that_is_not_utf8_in_parallel_text(tmp_path, store, tiny, ray_address, compressed):
    lines = tiny.data.test_source.read_bytes()
    data, offset = with_bad_byte(lines, 3, lines.split(b"\n")[2].split()[0])
    source = tmp_path / ("test.src.gz" if compressed else "test.src")
    source.write_bytes(gzip.compress(data) if compressed else data)
    where = " of the decompressed text" if compressed else ""
    config = translation_config(tmp_path, tiny, data={"source": str(source)})
    refused(store, config, ray_address, f"{source}: line 3 is not valid utf-8 text",
            f"byte 0xe9 at byte offset {offset}{where}", "set data.encoding")


# -- lengths against the model -------------------------------------------------------------------------
LONG = " ".join(["good", "film"] * 50)  # 100 words: more than the tiny BERT's 64 positions


def test_max_length_above_the_models_positions(tmp_path, store, tiny_bert_dir, ray_address):
    """Was: a 99-line Ray traceback, exit 1 and a failed run row."""
    path = write_rows([*ROWS, (LONG, 1)], tmp_path / "dev.tsv")
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(path), "max_length": 512})
    refused(store, config, ray_address,
            "data.max_length 512 is above the model's maximum of 64 positions",
            f"{tiny_bert_dir}/config.json", "set data.max_length to 64 or less")


def test_a_source_longer_than_the_models_positions(tmp_path, tiny):
    """In the worker's load (``worker_refused``); the CLI route of a translation worker's refusal:
    ``test_a_text_file_as_fairseq_checkpoint``."""
    lines = tiny.data.test_source.read_text().splitlines()
    lines[1] = " ".join([lines[1]] * 60)
    source = tmp_path / "long.src"
    source.write_text("\n".join(lines) + "\n")
    config = translation_config(tmp_path, tiny, data={"source": str(source)})
    worker_refused(config, f"data.source {source}: line 2 is ", "more than the model's 256 source positions")


# -- broken model files --------------------------------------------------------------------------------
def truncated_copy(model_dir: Path, dest: Path, name: str) -> Path:
    shutil.copytree(model_dir, dest)
    file = dest / name
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return file


def test_a_truncated_config_json(tmp_path, store, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """Was: ``worker failed to load the model: Expecting value: line 9 column 12``, no file named."""
    file = truncated_copy(tiny_bert_dir, tmp_path / "model", "config.json")
    config = classifier_config(tmp_path, tmp_path / "model", {"path": str(tiny_dev_tsv)})
    refused(store, config, ray_address, f"{file} is not valid JSON", "looks truncated", "fetch the model again")


def test_a_truncated_model_safetensors(tmp_path, store, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """Was: ``Error while deserializing header``, no file named."""
    file = truncated_copy(tiny_bert_dir, tmp_path / "model", "model.safetensors")
    config = classifier_config(tmp_path, tmp_path / "model", {"path": str(tiny_dev_tsv)})
    refused(store, config, ray_address, f"{file} is truncated", "fetch the model again")


def test_a_text_file_as_fairseq_checkpoint(tmp_path, store, tiny, ray_address):
    """Was: ``worker failed to load the model: 101``."""
    text = tmp_path / "checkpoint_best.pt"
    text.write_text("hello, this is not a checkpoint\n")
    config = translation_config(tmp_path, tiny, model={"checkpoint": str(text)})
    refused(store, config, ray_address, f"{text} is not a fairseq checkpoint: it is a text file",
            "model.checkpoint must name the .pt file")


def test_a_truncated_fairseq_checkpoint(tmp_path, tiny):
    """In the worker's load (``worker_refused``): the checkpoint reader ``test_a_text_file_as_fairseq_checkpoint``
    takes through the CLI."""
    cut = tmp_path / "checkpoint_cut.pt"
    cut.write_bytes(tiny.checkpoint.read_bytes()[: tiny.checkpoint.stat().st_size // 2])
    config = translation_config(tmp_path, tiny, model={"checkpoint": str(cut)})
    worker_refused(config, f"checkpoint {cut} is truncated")


# -- suspicious data: counted and reported, never changed ----------------------------------------------------
def test_duplicate_ids_are_refused(tmp_path, store, tiny_bert_dir, ray_address):
    """Example ids key the stored per-example rows (and resuming): two examples with one id are an error."""
    path = tmp_path / "ids.tsv"
    path.write_text("id\tsentence\tlabel\n" + "".join(f"{i if i != 7 else 3}\t{s}\t{y}\n"
                                                      for i, (s, y) in enumerate(ROWS)))
    config = classifier_config(tmp_path, tiny_bert_dir, {"path": str(path), "id_column": "id"})
    # Rows of data count from 1, lines as an editor shows them (the header is line 1).
    refused(store, config, ray_address,
            "column 'id' has 1 duplicate ids (first: '3' in rows 4 (line 5) and 8 (line 9))")


SUSPICIOUS = [*ROWS, ("", 1), ("   ", 0), (ROWS[0][0], 1 - ROWS[0][1]), (ROWS[1][0], ROWS[1][1]), (LONG, 1)]


@pytest.fixture(scope="module")
def suspicious_run(tmp_path_factory, tiny_bert_dir, ray_address):
    """Empty texts, repeated inputs (one with another label) and a sentence longer than the model's
    positions, evaluated by two workers (each reads the data)."""
    tmp = tmp_path_factory.mktemp("suspicious")
    path = write_rows(SUSPICIOUS, tmp / "dev.tsv")
    config = classifier_config(tmp, tiny_bert_dir, {"path": str(path)}, workers=2)
    proc = run_cli("run", str(config), "--store", str(tmp / "store"), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    [run] = runs(tmp / "store")
    return proc, run, path


def test_suspicious_data_are_counted_in_runs_facts(suspicious_run):
    _, run, path = suspicious_run
    n = len(ROWS)
    assert run["status"] == "complete" and run["n_examples"] == len(SUSPICIOUS)  # nothing dropped
    facts = json.loads(run["facts"])
    assert {k: facts[k] for k in ("empty_texts", "duplicate_texts", "duplicate_texts_other_label",
                                  "truncated_examples", "max_length", "max_positions", "encoding")} == {
        "empty_texts": 2, "duplicate_texts": 2, "duplicate_texts_other_label": 1, "truncated_examples": 1,
        "max_length": 64, "max_positions": 64, "encoding": "utf-8"}
    [warning] = facts["warnings"]
    assert warning.startswith(f"data file {path}: empty texts: 2 (example ids {n}, {n + 1})"), warning
    assert f"repeated inputs with another label: 1 (example id {n + 2})" in warning
    assert f"truncated to it: 1 (example id {n + 4})" in warning


def test_suspicious_data_are_warned_once(suspicious_run):
    """Two workers read the data; the console has the one warning line once (the driver prints
    ``facts["warnings"]``)."""
    proc, run, _ = suspicious_run
    [warning] = json.loads(run["facts"])["warnings"]
    shown = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")]
    assert shown == [f"headsweep: warning: {warning}"], proc.stderr


def test_a_clean_file_has_zero_counts_and_no_warning(full_store):
    [run] = runs(full_store)
    facts = json.loads(run["facts"])
    assert facts["empty_texts"] == facts["duplicate_texts"] == facts["truncated_examples"] == 0
    assert "warnings" not in facts


def test_suspicious_parallel_text_is_counted(tmp_path, tiny, ray_address):
    src = tiny.data.test_source.read_text().splitlines()
    tgt = tiny.data.test_target.read_text().splitlines()
    src[4], tgt[6] = "", "  "
    src[9] = src[8]
    source, target = tmp_path / "s.src", tmp_path / "s.tgt"
    source.write_text("\n".join(src) + "\n")
    target.write_text("\n".join(tgt) + "\n")
    config = translation_config(tmp_path, tiny, data={"source": str(source), "target": str(target)})
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    [run] = runs(tmp_path / "store")
    assert run["n_examples"] == len(src)
    facts = json.loads(run["facts"])
    assert (facts["empty_sources"], facts["empty_targets"], facts["duplicate_sources"]) == (1, 1, 1)
    assert (facts["max_source_positions"], facts["max_target_positions"]) == (256, 256)
    [warning] = facts["warnings"]
    assert warning == (f"data {source} / {target}: empty source sentences: 1 (example id 4); "
                       "empty target sentences: 1 (example id 6); repeated source sentences: 1 (example id 9) "
                       "(counted in runs.facts)")
