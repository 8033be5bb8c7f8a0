"""Models by hub id from the local Hugging Face cache, laid out here as huggingface_hub writes it
(``models--org--name/snapshots/<commit>/`` of links into ``blobs/``, ``refs/<branch>``) in the session's own
cache (conftest's ``HUB_CACHE``, which the session's Ray workers see too), with ``HF_HUB_OFFLINE=1``:
ids and ``id@revision`` (branch, commit, commit prefix) resolve; a model or revision not cached is one line
naming ``headsweep fetch``; two revisions are two runs through the real CLI, for the classifier and the
causal LM; ``headsweep fetch`` refuses cleanly with no network."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import HUB_CACHE, error_line, run_cli
from tiny_models import build_lm_tokenizer, lm_text, save_tiny_causal_lm, save_tiny_classifier

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.models.hub_pins import pin_hub_models
from headsweep.workers.hub.cache import resolve_snapshot

BERT_A = "1a2b3c4d" + "0" * 32  # org/tiny-bert main
BERT_B = "9f8e7d6c" + "1" * 32  # org/tiny-bert v2: other weights
BERT_C = "1a2b3f" + "2" * 34  # org/tiny-bert "broken": no config.json; shares "1a2b3" with BERT_A
LM_A = "5e5e" + "a" * 36  # tiny-lm (no namespace, like gpt2) main
LM_B = "7c7c" + "b" * 36  # tiny-lm v2: other weights, no tokenizer files
TOK = "3d3d" + "c" * 36  # org/lm-tokenizer main: tokenizer files only


def lay_out(repo_id: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """A cache entry as huggingface_hub writes it: files in blobs/ by content hash, snapshots of relative links."""
    repo = HUB_CACHE / f"models--{repo_id.replace('/', '--')}"
    for commit, source in snapshots.items():
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / commit / file.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for name, commit in refs.items():
        (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    return repo


def snapshot(repo_id: str, commit: str) -> Path:
    return HUB_CACHE / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub-sources")
    tokenizer_only = tmp / "tok"
    build_lm_tokenizer().save_pretrained(tokenizer_only)
    lay_out("org/tiny-bert", {BERT_A: save_tiny_classifier(tmp / "bert-a", seed=0),
                              BERT_B: save_tiny_classifier(tmp / "bert-b", seed=1),
                              BERT_C: tokenizer_only},
            {"main": BERT_A, "v2": BERT_B, "broken": BERT_C})
    lay_out("tiny-lm", {LM_A: save_tiny_causal_lm(tmp / "lm-a", seed=0),
                        LM_B: save_tiny_causal_lm(tmp / "lm-b", seed=1, tokenizer=False)},
            {"main": LM_A, "v2": LM_B})
    lay_out("org/lm-tokenizer", {TOK: tokenizer_only}, {"main": TOK})
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(200, seed=3))
    return corpus


def test_ids_and_revisions_resolve_to_cached_snapshots(hub, tmp_path, monkeypatch):
    from headsweep.workers.families.hf_shared.loading import resolve_model_dir

    main = resolve_snapshot("org/tiny-bert")
    assert (main.revision, main.folder) == (BERT_A, snapshot("org/tiny-bert", BERT_A))
    assert (main.folder / "config.json").is_file()
    for spec in ("org/tiny-bert@v2", f"org/tiny-bert@{BERT_B}", f"org/tiny-bert@{BERT_B[:7]}"):
        assert resolve_snapshot(spec).folder == snapshot("org/tiny-bert", BERT_B), spec
    assert resolve_snapshot("org/tiny-bert@1a2b3c").revision == BERT_A  # the one commit starting so
    assert resolve_snapshot("tiny-lm").revision == LM_A
    assert resolve_model_dir("tiny-lm@v2") == snapshot("tiny-lm", LM_B)
    assert resolve_snapshot("org/lm-tokenizer", require=None).revision == TOK  # a tokenizer needs no config.json
    # A folder that exists is a folder, whatever its name looks like.
    monkeypatch.chdir(tmp_path)
    save_tiny_classifier(tmp_path / "org" / "tiny-bert")
    assert resolve_model_dir("org/tiny-bert") == Path("org/tiny-bert")


def test_cache_misses_are_one_line_that_names_the_fetch(hub):
    def refused(spec: str, *parts: str) -> None:
        with pytest.raises(HeadsweepError) as info:
            resolve_snapshot(spec)
        message = str(info.value)
        assert "\n" not in message and all(p in message for p in parts), message

    refused("org/absent", "'org/absent' is neither a local folder nor in the Hugging Face cache", str(HUB_CACHE),
            "`headsweep fetch org/absent`")
    refused("org/absent@v3", "`headsweep fetch org/absent --revision v3`")
    cached = f"cached are broken ({BERT_C[:12]}), main ({BERT_A[:12]}), v2 ({BERT_B[:12]})"
    refused("org/tiny-bert@v9", "revision 'v9' of org/tiny-bert is not in the Hugging Face cache", cached,
            "`headsweep fetch org/tiny-bert --revision v9`")
    refused("org/tiny-bert@abc", "revision 'abc' of org/tiny-bert is not")  # shorter than a commit prefix may be
    refused("org/tiny-bert@1a2b3", "'1a2b3' is the start of 2 cached commits", BERT_A, BERT_C)
    refused("org/tiny-bert@broken", "has no config.json", str(snapshot("org/tiny-bert", BERT_C)),
            "`headsweep fetch org/tiny-bert --revision broken`")
    refused("org/tiny-bert@", "the revision after '@' must be a branch, tag or commit")


def classifier_config(path: str, data: Path) -> dict:
    return {"model": {"kind": "hf_classifier", "path": path}, "data": {"path": str(data)},
            "sweep": {"experiments": ["baseline"]}}


def lm_config(path: str, corpus: Path, tokenizer: str | None = None) -> dict:
    return {"model": {"kind": "hf_causal_lm", "path": path, "tokenizer": tokenizer},
            "data": {"path": str(corpus), "window": 16, "max_windows": 6}, "sweep": {"experiments": ["baseline"]}}


def test_the_config_identity_is_the_commit(hub, tiny_dev_tsv):
    def pinned(spec: str):
        return pin_hub_models(build_config(classifier_config(spec, tiny_dev_tsv)))

    main, facts = pinned("org/tiny-bert")
    assert main.model.path == f"org/tiny-bert@{BERT_A}"
    assert facts == {"model.path": {"id": "org/tiny-bert", "requested": "main", "revision": BERT_A,
                                    "folder": str(snapshot("org/tiny-bert", BERT_A))}}
    assert main.hash() == pinned(f"org/tiny-bert@{BERT_A[:8]}")[0].hash() == pinned("org/tiny-bert@main")[0].hash()
    assert main.hash() != pinned("org/tiny-bert@v2")[0].hash()
    ref = HUB_CACHE / "models--org--tiny-bert" / "refs" / "main"
    ref.write_text(BERT_B)  # main moved: the same config is another run, the v2 one
    try:
        assert pinned("org/tiny-bert")[0].hash() == pinned("org/tiny-bert@v2")[0].hash()
    finally:
        ref.write_text(BERT_A)
    lm, lm_facts = pin_hub_models(build_config(lm_config("tiny-lm@v2", hub, "org/lm-tokenizer")))
    assert (lm.model.path, lm.model.tokenizer) == (f"tiny-lm@{LM_B}", f"org/lm-tokenizer@{TOK}")
    assert {k: v["revision"] for k, v in lm_facts.items()} == {"model.path": LM_B, "model.tokenizer": TOK}
    local = build_config(classifier_config(str(hub.parent / "bert-a"), tiny_dev_tsv))
    assert pin_hub_models(local) == (local, {})  # a local folder is left as written


def two_runs(tmp_path, ray_address, configs: list[dict]) -> dict[str, dict]:
    """Each config run through the CLI, side by side (each into a store of its own); the runs rows by the
    revision runs.facts records."""
    def run(index: int) -> list[dict]:
        path, store = tmp_path / f"run{index}.yaml", tmp_path / f"store{index}"
        path.write_text(yaml.safe_dump(configs[index]))
        proc = run_cli("run", str(path), "--store", str(store), "--address", ray_address, "--quiet")
        assert proc.returncode == 0, proc.stderr
        return ResultStore(str(store)).read("runs").to_pylist()

    with ThreadPoolExecutor(len(configs)) as pool:
        rows = [row for rows in pool.map(run, range(len(configs))) for row in rows]
    assert len(rows) == 2
    return {json.loads(r["facts"])["hub"]["model.path"]["revision"]: r for r in rows}


def check_two_runs(runs: dict[str, dict], repo_id: str, a: str, b: str) -> None:
    assert set(runs) == {a, b}
    assert runs[a]["run_id"] != runs[b]["run_id"] and runs[a]["config_hash"] != runs[b]["config_hash"]
    for commit, row in runs.items():
        hub = json.loads(row["facts"])["hub"]["model.path"]
        assert hub["folder"] == str(snapshot(repo_id, commit))
        assert json.loads(row["config"])["model"]["path"] == f"{repo_id}@{commit}"
        assert row["model"] == f"{repo_id}@{commit[:7]}"  # the whole commit is in facts.hub
        assert row["status"] == "complete"
        # The weights' fingerprint is of the files the id resolved to: the cache names each blob by its SHA-256.
        [weights] = json.loads(row["facts"])["weights"]
        blob = os.path.basename(os.readlink(snapshot(repo_id, commit) / "model.safetensors"))
        assert weights["sha256"] == hashlib.sha256(f"model.safetensors\0{blob}\n".encode()).hexdigest()
    assert runs[a]["baseline_score"] != runs[b]["baseline_score"]  # each loaded its own revision's weights


# Slow variant of test_two_revisions_are_two_runs_causal_lm: the driver pins a hub id to its commit the same way for
# either family (the causal LM's pair also pins a tokenizer id), and a tag (v2) resolving to its commit and to another
# config hash is test_the_config_identity_is_the_commit's, in process.
@pytest.mark.slow
def test_two_revisions_are_two_runs_classifier(hub, tiny_dev_tsv, tmp_path, ray_address):
    runs = two_runs(tmp_path, ray_address, [classifier_config("org/tiny-bert", tiny_dev_tsv),
                                            classifier_config("org/tiny-bert@v2", tiny_dev_tsv)])
    check_two_runs(runs, "org/tiny-bert", BERT_A, BERT_B)
    assert {json.loads(r["facts"])["hub"]["model.path"]["requested"] for r in runs.values()} == {"main", "v2"}


def test_two_revisions_are_two_runs_causal_lm(hub, tmp_path, ray_address):
    runs = two_runs(tmp_path, ray_address, [lm_config("tiny-lm", hub),
                                            lm_config(f"tiny-lm@{LM_B[:10]}", hub, tokenizer="org/lm-tokenizer")])
    check_two_runs(runs, "tiny-lm", LM_A, LM_B)
    assert json.loads(runs[LM_B]["facts"])["hub"]["model.tokenizer"]["revision"] == TOK


def test_missing_model_and_offline_fetch_are_one_line(tmp_path, tiny_dev_tsv, ray_address):
    config = tmp_path / "absent.yaml"
    config.write_text(yaml.safe_dump(classifier_config("org/absent@v3", tiny_dev_tsv)))
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not proc.stdout.strip()
    assert "`headsweep fetch org/absent --revision v3`" in error_line(proc.stderr)
    assert not store.exists()
    before = sorted(HUB_CACHE.rglob("*"))
    offline = run_cli("fetch", "org/absent", env={"HF_HUB_OFFLINE": "1"})
    # No network: a port nothing listens on, so that the test means the same on a machine with network.
    unreachable = run_cli("fetch", "org/absent", "--revision", "v3",
                          env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    for proc, message in ((offline, "cannot fetch org/absent: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set"),
                          (unreachable, "cannot fetch org/absent: the Hugging Face Hub (http://127.0.0.1:9) cannot "
                                        "be reached")):
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [error_line(proc.stderr)] and message in proc.stderr
        assert not proc.stdout
    assert sorted(HUB_CACHE.rglob("*")) == before  # nothing written into the cache
