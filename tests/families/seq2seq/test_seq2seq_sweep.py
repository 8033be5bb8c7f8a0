"""An hf_seq2seq sweep through the real CLI and Ray on a tiny Marian model, and the inputs it refuses in one line
before Ray starts."""

from __future__ import annotations

import pytest
import sacrebleu
import yaml
from conftest import error_line, run_cli, run_refused
from tiny_models import save_tiny_causal_lm
from tiny_seq2seq import build_tokenizer, save_tiny_seq2seq, write_pairs

from headsweep.results.store import ResultStore
from headsweep.workers.core.heads import Head


def config(model_dir, source, target, **model):
    return {"name": "tiny-seq2seq",
            "model": {"kind": "hf_seq2seq", "path": str(model_dir), "max_new_tokens": 10, **model},
            "data": {"source": str(source), "target": str(target)},
            "sweep": {"batch_size": 4, "workers": 1, "experiments": ["baseline", "single_head"]}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seq2seq_sweep")
    model_dir = save_tiny_seq2seq(folder / "marian", "marian")
    source, target = write_pairs(folder, 6)
    return folder, model_dir, source, target


@pytest.fixture(scope="module")
def sweep_run(files, ray_address):
    folder, model_dir, source, target = files
    heldout_source, heldout_target = write_pairs(folder, 8, seed=5, split="valid")
    cfg = config(model_dir, source, target)
    cfg["data"]["metric"] = "chrf"  # BLEU, the default, is the same path with other statistics (test_seq2seq_gates)
    cfg["sweep"]["experiments"] = ["baseline", "single_head", "importance", "prune_level", "roles"]
    # LRP relevance (gradient importance on this family: the contract suite's test_gradient_importance_on_held_out_data)
    cfg["importance"] = {"method": "lrp", "data": {"source": str(heldout_source), "target": str(heldout_target)}}
    cfg["prune"] = {"levels": [0.0, 0.5, 1.0]}
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(folder / "c.yaml"), "--store", str(folder / "store"), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    return ResultStore(str(folder / "store")), proc.stdout.strip()


def test_every_head_of_every_attention_type_with_chrf_from_its_stored_hypotheses(sweep_run, files):
    store, run_id = sweep_run
    references = files[3].read_text().splitlines()
    evals = store.read("evaluations", run_id).to_pylist()
    single = [e for e in evals if e["experiment"] == "single_head"]
    assert sorted((e["attention"], e["layer"], e["head"]) for e in single) == sorted(
        (a, layer, h) for a in ("enc_self", "enc_dec", "dec_self") for layer in range(2) for h in range(4))
    [run] = store.read("runs", run_id).to_pylist()
    assert run["status"] == "complete" and run["metric"] == "chrf"
    assert "hf_seq2seq" in run["config"] and "nc:6|nw:0" in run["facts"]
    rows = store.read("examples", run_id).to_pylist()
    for e in evals:
        mine = sorted((r for r in rows if r["eval_id"] == e["eval_id"]), key=lambda r: int(r["example_id"]))
        hypotheses = [r["output"] for r in mine]
        # other: float64 chrF from the stored per-sentence statistics' sum against sacrebleu's own
        assert e["score"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score, rel=1e-12)
        assert all(len(r["stats"]) == 18 for r in mine)
    significance = store.read("significance", run_id).to_pylist()
    assert {r["eval_id"] for r in significance} >= {e["eval_id"] for e in single}
    assert {r["test"] for r in significance} == {"paired_bootstrap"}


# data.path files that are not pairs: (file name, its bytes, data keys besides path, parts of the one line).
BAD_PAIR_FILES = {
    "tsv_three_columns": ("p.tsv", b"a b\tc d\nx\ty\tz\n", {},
                          ("p.tsv: line 2 has 3 tab-separated column(s), not 2",)),
    "tsv_empty_target": ("p.tsv", b"a b\tc d\n\nx\t \n", {},
                         ("p.tsv: line 3: the target (column 2) is empty",)),
    "jsonl_not_object": ("p.jsonl", b'{"en": "a", "de": "b"}\n["x", "y"]\n',
                         {"source_field": "en", "target_field": "de"},
                         ("p.jsonl: line 2 is a JSON list, not an object with the fields 'en', 'de'",)),
    "jsonl_missing_field": ("p.jsonl", b'{"source": "a", "target": "b"}\n{"source": "x"}\n', {},
                            ("p.jsonl: line 2 has no field 'target'", "set data.source_field / data.target_field",
                             "fields here: 'source'")),
    "jsonl_field_not_text": ("p.jsonl", b'{"source": "a", "target": 7}\n', {},
                             ("p.jsonl: line 1: field 'target' is int, not text",)),
    "undecodable_tsv": ("p.tsv", b"a\tb\nx\t\xe9t\xe9\n", {},
                        ("p.tsv: line 2 is not valid utf-8 text (byte 0xe9", "set data.encoding")),
    "path_and_source": ("p.tsv", b"a\tb\n", {"source": "x.src"},
                        ("data.path and data.source / data.target are two ways of giving the data",)),
}


# Slow variants (each CLI run loads transformers on the driver): export_stock_marian, whose reason the export itself
# gives in test_seq2seq_pruning.py::test_stock_export_refused_with_the_reason_and_nothing_written, with an export
# refused through the CLI (one line, exit 2, no folder) in test_albert.py::test_single_head_run_through_the_cli_and_
# export_refused; causal_lm_as_seq2seq and seq2seq_as_causal_lm, whose lines the family checks give in
# test_a_folder_of_the_other_kind_is_refused_with_the_kind_to_set below, with a folder of the wrong kind refused
# through the CLI in test_family_checks.py
@pytest.mark.parametrize("case", [pytest.param("causal_lm_as_seq2seq", marks=pytest.mark.slow),
                                  pytest.param("seq2seq_as_causal_lm", marks=pytest.mark.slow),
                                  "multilingual_without_codes", "unaligned_data", "resample_decoder", "patch",
                                  "per_position_mean", "unknown_metric",
                                  pytest.param("export_stock_marian", marks=pytest.mark.slow), *BAD_PAIR_FILES])
def test_refused_in_one_line_before_ray(case, files, tmp_path, ray_address):
    folder, model_dir, source, target = files
    cfg = config(model_dir, source, target)
    if case in BAD_PAIR_FILES:
        name, content, keys, parts = BAD_PAIR_FILES[case]
        (tmp_path / name).write_bytes(content)
        cfg["data"] = {"path": str(tmp_path / name), **keys}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        run_refused(tmp_path / "c.yaml", tmp_path / "store", ray_address, *parts)
        return
    if case == "export_stock_marian":  # headsweep export: one line, exit 2, no folder written
        parts = ("MarianMTModel's config derives the head size from the hidden size (d_model / attention heads)",
                 "export without --stock")
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        proc = run_cli("export", str(tmp_path / "c.yaml"), "--mask", "enc_self:0:1,enc_dec:1:0,dec_self:0:2",
                       "--stock", "--out", str(tmp_path / "out"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stderr
        line = error_line(proc.stderr)
        assert all(part in line for part in parts), line
        assert not (tmp_path / "out").exists()
        return
    if case == "causal_lm_as_seq2seq":
        cfg["model"]["path"] = str(save_tiny_causal_lm(tmp_path / "lm"))
        parts = ("holds a causal language model", "set model.kind: hf_causal_lm")
    elif case == "seq2seq_as_causal_lm":
        cfg["model"] = {"kind": "hf_causal_lm", "path": str(model_dir)}
        cfg["data"] = {"path": str(source)}
        parts = ("holds an encoder-decoder model (MarianMTModel)", "set model.kind: hf_seq2seq")
    elif case == "multilingual_without_codes":
        from transformers import M2M100Config, M2M100ForConditionalGeneration

        m2m = tmp_path / "m2m"
        M2M100ForConditionalGeneration(M2M100Config(
            vocab_size=len(build_tokenizer()), d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32)).save_pretrained(m2m)
        build_tokenizer().save_pretrained(m2m)
        cfg["model"]["path"] = str(m2m)
        cfg["model"]["source_lang"] = "en"
        parts = ("is a multilingual model (m2m_100): set model.target_lang",)
    elif case == "patch":  # the line suggests what the family runs instead (resample on enc_self heads, mean)
        cfg["sweep"]["ablation"] = "patch"
        parts = ("hf_seq2seq has no paired data format (data.task: paired); use sweep.ablation resample or mean",)
    elif case == "per_position_mean":
        cfg["sweep"]["ablation"] = "mean"
        cfg["ablation"] = {"positions": "per_position"}
        parts = ("ablation.positions: per_position is not available for hf_seq2seq models",
                 "use ablation.positions: all")
    elif case == "unknown_metric":
        cfg["data"]["metric"] = "meteor"
        parts = ("data.metric must be one of bleu, chrf", "got 'meteor'")
    elif case == "resample_decoder":  # a donor fills enc_self heads only: a decoder head is refused, as fairseq's
        cfg["sweep"]["ablation"] = "resample"
        cfg["sweep"]["attention"] = ["enc_self", "dec_self"]
        parts = ("sweep.ablation resample is available for hf_seq2seq models on enc_self heads only",
                 "sweep.attention takes in dec_self heads", "decoder attention cannot take another sentence's states",
                 "set sweep.attention: [enc_self], or use sweep.ablation mean")
    else:
        short = tmp_path / "short.tgt"
        short.write_text("\n".join(target.read_text().splitlines()[:-1]) + "\n")
        cfg["data"]["target"] = str(short)
        parts = ("data.source has 6 lines but data.target has 5",)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_refused(tmp_path / "c.yaml", tmp_path / "store", ray_address, *parts)


def test_a_folder_of_the_other_kind_is_refused_with_the_kind_to_set(files, tmp_path):
    """The lines of causal_lm_as_seq2seq and seq2seq_as_causal_lm above, from the checks a run makes of the folder:
    the seq2seq family's driver check (``check_model``) of a causal LM, and the architecture check every
    transformers loader makes of ``config.json``, for a Marian folder given as a causal LM."""
    import json

    from headsweep.errors import HeadsweepError
    from headsweep.workers.families.hf_shared.architecture import check_architecture
    from headsweep.workers.families.registry import model_family

    _, model_dir, _, _ = files
    seq2seq = model_family("hf_seq2seq")
    lm = save_tiny_causal_lm(tmp_path / "lm")
    cases = [(lambda: seq2seq.check_model(seq2seq.model_config(path=str(lm))),
              (f"{lm} holds a causal language model", "set model.kind: hf_causal_lm")),
             (lambda: check_architecture(model_dir, json.loads((model_dir / "config.json").read_text()),
                                         "hf_causal_lm"),
              (f"{model_dir} holds an encoder-decoder model (MarianMTModel)", "set model.kind: hf_seq2seq"))]
    for check, parts in cases:
        with pytest.raises(HeadsweepError) as info:
            check()
        line = str(info.value)
        assert all(part in line for part in parts) and "\n" not in line, line


def test_roles_of_every_head(sweep_run):
    """roles through the CLI: a row per head of every attention type (the maps themselves are checked against
    transformers' own attentions in test_seq2seq_gates)."""
    store, run_id = sweep_run
    rows = store.read("head_roles", run_id).to_pylist()
    assert sorted((r["attention"], r["layer"], r["head"]) for r in rows) == sorted(
        (a, layer, h) for a in ("enc_self", "enc_dec", "dec_self") for layer in range(2) for h in range(4))
    assert all(0 < r["confidence"] <= 1 and r["n_tokens"] > 0 for r in rows)


def test_lrp_importance_of_every_head_and_prune_levels_follow_it(sweep_run, files, one_thread):
    """importance.method lrp through the CLI: a row per head, each layer's shares summing to 1, the raw relevance the
    worker computed (against the same estimate in this process on an adapter of the held-out pairs), and the pruning
    levels masking the least relevant heads first."""
    from headsweep.workers.analyses.lrp import lrp_relevance
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.registry import model_family

    store, run_id = sweep_run
    importance = store.read("importance", run_id).to_pylist()
    assert len(importance) == 24 and {r["method"] for r in importance} == {"lrp"}
    for site in {(r["attention"], r["layer"]) for r in importance}:
        # float64 shares of one layer total, read back from Parquet
        assert sum(r["score_normalized"] for r in importance if (r["attention"], r["layer"]) == site) == (
            pytest.approx(1.0))
    folder, model_dir = files[0], files[1]
    family = model_family("hf_seq2seq")
    adapter = family.load(family.model_config(path=str(model_dir), max_new_tokens=10),
                          family.data_config(source=str(folder / "valid.src"), target=str(folder / "valid.tgt")),
                          RuntimeOptions(batch_size=4))
    here = lrp_relevance(adapter)
    # float32 relevance from another process with its own thread count (reduction order)
    assert [r["score"] for r in importance] == pytest.approx(
        [here.raw[Head(r["attention"], r["layer"], r["head"])] for r in importance], rel=1e-4, abs=1e-6)
    assert any(abs(r["score"]) > 1e-3 for r in importance)
    levels = sorted((e for e in store.read("evaluations", run_id).to_pylist() if e["experiment"] == "prune_level"),
                    key=lambda e: e["n_masked"])
    assert [e["n_masked"] for e in levels] == [0, 12, 24]
    ranked = sorted(importance, key=lambda r: r["score_normalized"])  # importance.normalize: per layer
    half = {f"{r['attention']}:{r['layer']}:{r['head']}" for r in ranked[:12]}
    assert set(levels[1]["heads_masked"]) == half
