"""Training dynamics: one run over several checkpoints of a model, a pruning curve for each."""

from __future__ import annotations

import yaml
from conftest import run_cli
from tiny_models import save_tiny_classifier

from headsweep.results.store import ResultStore
from headsweep.sweep.demo.sentiment import generate, write_tsv


def test_pruning_curve_per_checkpoint(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    second = save_tiny_classifier(tmp_path / "epoch2", seed=1)
    train = write_tsv(generate(40, seed=5), tmp_path / "train.tsv")
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "checkpoints": [str(tiny_bert_dir), str(second)],
        "data": {"path": str(tiny_dev_tsv)},
        "sweep": {"experiments": ["baseline", "importance", "prune_level"]},
        "importance": {"data": {"path": str(train)}},
        "prune": {"levels": [0.0, 0.5, 1.0]},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "s"), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    store = ResultStore(str(tmp_path / "s"))
    evals = store.read("evaluations").to_pylist()
    assert len(evals) == 2 * (1 + 3)
    for i, ckpt in enumerate([str(tiny_bert_dir), str(second)]):
        mine = [e for e in evals if e["checkpoint"] == ckpt]
        [base] = [e for e in mine if e["experiment"] == "baseline"]
        assert base["eval_id"] == f"ckpt{i}/baseline"
        levels = sorted((e for e in mine if e["experiment"] == "prune_level"), key=lambda e: e["level"])
        assert [e["n_masked"] for e in levels] == [0, 4, 8]
        assert levels[0]["score"] == base["score"]
        assert all(e["baseline_score"] == base["score"] and e["delta"] == e["score"] - base["score"] for e in levels)
    imp = store.read("importance").to_pylist()
    assert sorted({r["checkpoint"] for r in imp}) == sorted([str(tiny_bert_dir), str(second)])
    assert len(imp) == 16
    sig = store.read("significance").to_pylist()
    assert len({s["eval_id"] for s in sig}) == 6
    [run] = store.read("runs").to_pylist()
    assert run["status"] == "complete" and run["n_done"] == run["n_planned"] == 8


def listing(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() \
        else {}


def test_every_checkpoint_is_checked_before_anything_is_written(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    """A missing or differently shaped later checkpoint stops the run before its first row."""
    from conftest import error_line

    other = save_tiny_classifier(tmp_path / "three-layers", layers=3, seed=2)
    store = tmp_path / "s"
    store.mkdir()
    cases = [
        ([str(tiny_bert_dir), str(tmp_path / "missing")], "checkpoints entry 2 ("),
        ([str(tiny_bert_dir), str(other)], "has other attention heads than the first (self 3x4 vs self 2x4)"),
    ]
    for checkpoints, message in cases:
        cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "checkpoints": checkpoints,
               "data": {"path": str(tiny_dev_tsv)}, "sweep": {"experiments": ["baseline", "single_head"]}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        before = listing(store)
        proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address, "--quiet")
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert message in error_line(proc.stderr)
        assert listing(store) == before
        assert ResultStore(str(store)).read("runs").num_rows == 0


# -- a Pythia-style training history ---------------------------------------------------------------------------

PYTHIA_WINDOW = 16
PYTHIA_STEPS = (0, 10, 20)


def save_pythia_history(folder):
    """A tiny GPT-NeoX (Pythia's architecture: fused per-head query_key_value, parallel residual, rotary) trained
    for a few steps on text over the test vocabulary, saved at each of ``PYTHIA_STEPS`` as Pythia's revisions are
    (``step0``, ``step10``, ...): one folder per checkpoint, each with the tokenizer."""
    import torch
    from tiny_models import build_lm_tokenizer, lm_text
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tokenizer = build_lm_tokenizer()
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, rotary_pct=0.25, bos_token_id=2,
                        eos_token_id=3, pad_token_id=0, attn_implementation="eager")
    model = GPTNeoXForCausalLM(cfg)
    ids = tokenizer(lm_text(600, seed=21), add_special_tokens=False)["input_ids"]
    windows = torch.tensor([ids[s : s + PYTHIA_WINDOW] for s in range(0, len(ids) - PYTHIA_WINDOW + 1, PYTHIA_WINDOW)])
    optimiser = torch.optim.AdamW(model.parameters(), lr=5e-3)
    folders, step = [], 0
    for target in PYTHIA_STEPS:
        model.train()
        while step < target:
            batch = windows[torch.randint(len(windows), (8,), generator=torch.Generator().manual_seed(step))]
            model(input_ids=batch, labels=batch).loss.backward()
            optimiser.step()
            optimiser.zero_grad()
            step += 1
        out = folder / f"step{target}"
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)
        folders.append(out)
    return folders


def window_perplexity(model_dir, corpus, zeroed=()) -> float:
    """The perplexity convention written out independently: tokens without special tokens, windows of 16 without
    overlap (the last partial one dropped), each scoring its tokens after the first; ``zeroed`` (layer, head) pairs
    have their input columns of ``attention.dense`` zeroed (weight surgery)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(corpus.read_text(), add_special_tokens=False)["input_ids"]
    windows = torch.tensor([ids[s : s + PYTHIA_WINDOW] for s in range(0, len(ids) - PYTHIA_WINDOW + 1, PYTHIA_WINDOW)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer, head in zeroed:
            d = model.config.hidden_size // model.config.num_attention_heads
            model.gpt_neox.layers[layer].attention.dense.weight[:, head * d : (head + 1) * d] = 0.0
        nll = sum(float(model(input_ids=w[None], labels=w[None]).loss) * (PYTHIA_WINDOW - 1) for w in windows)
    return float(torch.tensor(nll / (len(windows) * (PYTHIA_WINDOW - 1)), dtype=torch.float64).exp())


def test_a_pythia_style_training_history_is_swept_checkpoint_by_checkpoint(tmp_path, ray_address, one_thread):
    """docs/pythia.md's worked example, small: `checkpoints` over a GPT-NeoX's training steps gives each step's
    baseline (equal to a plain forward of that step's weights) and each head's effect at that step."""
    import duckdb
    import pytest
    from tiny_models import lm_text

    folders = save_pythia_history(tmp_path)
    corpus = tmp_path / "heldout.txt"
    corpus.write_text(lm_text(200, seed=22))
    cfg = {"model": {"kind": "hf_causal_lm", "path": str(folders[0]), "attn_implementation": "eager"},
           "checkpoints": [str(f) for f in folders],
           "data": {"path": str(corpus), "window": PYTHIA_WINDOW},
           "sweep": {"experiments": ["baseline", "single_head"], "workers": 1}}
    (tmp_path / "pythia.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("run", str(tmp_path / "pythia.yaml"), "--store", str(tmp_path / "s"), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    con = duckdb.connect()
    rows = con.sql(f"SELECT checkpoint, experiment, layer, head, score, delta FROM read_parquet('{tmp_path}/s/"
                   "evaluations/*/*.parquet', hive_partitioning=true, hive_types={'run_id': VARCHAR}, "
                   "union_by_name=true) ORDER BY checkpoint, layer, head").fetchall()
    base = {c: s for c, e, _, _, s, _ in rows if e == "baseline"}
    effect = {c: [d for c2, e, _, _, _, d in rows if c2 == c and e == "single_head"] for c in base}
    assert sorted(base) == sorted(str(f) for f in folders)
    assert all(len(v) == 8 for v in effect.values())
    for folder in folders:
        # other: float32 forwards summed in float64 by both routes, SDPA-free eager attention on both sides
        assert base[str(folder)] == pytest.approx(window_perplexity(folder, corpus), rel=1e-5)
    first, last = (str(folders[0]), str(folders[-1]))
    assert base[last] < base[first]  # training lowered held-out perplexity
    assert effect[first] != effect[last]  # the heads' effects moved over training
    # One head at the last step against weight surgery on that step's weights.
    [(score,)] = [(s,) for c, e, layer, head, s, _ in rows if (c, e, layer, head) == (last, "single_head", 1, 2)]
    assert score == pytest.approx(window_perplexity(folders[-1], corpus, zeroed=[(1, 2)]), rel=1e-5)
