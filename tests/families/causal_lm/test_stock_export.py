"""``headsweep export`` of uniform masks writes the model's own architecture, which stock transformers loads.

The proof runs in a separate Python process that never imports headsweep: ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer`` load each exported folder, count its parameters and compute its logits, and lm-eval's
``simple_evaluate(HFLM(pretrained=DIR))`` scores a task on it. Here the logits are compared with the full model's under
the same mask (head gates: the independent route), for Llama-style grouped-query cases with 8/2, 9/3 and 14/2
query/key-value heads, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms) and tied embeddings; the parameter count with
the removed heads' weights counted by hand. A prune_level run with ``prune.uniform: kv_groups`` goes through the
CLI: its stored score at a level is what the exported folder scores, lm-eval scores a task on the folder as a
``data.task: lm_eval`` sweep scores the level's mask, and the efficiency experiment times the level's stock export as
served. The refusals: one line, exit 2 (through the CLI once), nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tiny_models import LM_SPECIALS, LM_WORDS, build_lm_tokenizer, lm_batch, lm_logits, lm_text
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import load_config
from headsweep.sweep.pruning.export import export_pruned
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.families.hf_causal_lm.model.sites import find_sites

HEAD_DIM = 4
LAYERS = 2
VOCAB = len(LM_SPECIALS) + len(LM_WORDS)

# name: (config class, query heads, key/value heads, extra config, the mask: per layer, the removed heads)
CASES = {
    # transformers' LlamaConfig wants hidden_size (heads x 4 here) a multiple of the query heads kept
    "llama_8q2kv_heads": ("LlamaConfig", 8, 2, {}, {0: [0, 2, 5, 6], 1: [1, 3, 4, 7]}),  # two per group
    "llama_9q3kv_groups": ("LlamaConfig", 9, 3, {}, {0: [3, 4, 5], 1: [0, 1, 2]}),  # one whole group per layer
    "llama_14q2kv_heads": ("LlamaConfig", 14, 2, {}, {0: [0, 1, 2, 7, 8, 13], 1: [4, 5, 6, 10, 11, 12]}),
    "qwen2_14q2kv_groups": ("Qwen2Config", 14, 2, {}, {0: list(range(7)), 1: list(range(7, 14))}),
    "qwen3_4q2kv_heads": ("Qwen3Config", 4, 2, {}, {0: [1, 2], 1: [0, 3]}),
    "llama_8q2kv_tied": ("LlamaConfig", 8, 2, {"tie_word_embeddings": True}, {0: [4, 5, 6, 7], 1: [0, 1, 2, 3]}),
}

# Runs in a fresh interpreter: stock transformers and lm-eval only. Prints one JSON line.
STOCK_LOAD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
request = json.loads(sys.argv[1])
out = {}
for name, job in request.items():
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["dir"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(job["ids"]), use_cache=False).logits
    out[name] = {"n_params": sum(p.numel() for p in model.parameters()), "logits": logits.tolist(),
                 "config": {k: getattr(model.config, k) for k in ("num_attention_heads", "num_key_value_heads",
                                                                     "head_dim", "hidden_size")},
                 "tokens": tokenizer("the cat sees")["input_ids"]}
    if job.get("lm_eval"):
        import lm_eval.evaluator
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        lm = HFLM(pretrained=job["dir"], device="cpu", batch_size=1, dtype="float32")
        lm_eval.evaluator.add_env_info = lambda results: None  # pip list and the like: seconds, nothing needed
        task, metric = job["lm_eval"]
        result = simple_evaluate(model=lm, tasks=[task], bootstrap_iters=0,
                                 task_manager=TaskManager(include_path=job["include_path"], include_defaults=False))
        out[name]["lm_eval_score"] = result["results"][task][metric + ",none"]
out["headsweep_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "headsweep")
print(json.dumps(out))
"""


def stock_load(request: dict) -> dict:
    """Load each folder of ``request`` with stock transformers in a process that never imports headsweep."""
    proc = subprocess.run([sys.executable, "-c", STOCK_LOAD, json.dumps(request)], capture_output=True, text=True,
                          timeout=600, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin", "HOME": "/tmp",
                                            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("headsweep_imported") == []
    return out


def save_case(folder: Path, name: str) -> Path:
    import transformers

    cls, heads, kv, extra, _ = CASES[name]
    torch.manual_seed(0)
    width = heads * HEAD_DIM
    cfg = getattr(transformers, cls)(hidden_size=width, num_hidden_layers=LAYERS, num_attention_heads=heads,
                                     num_key_value_heads=kv, head_dim=HEAD_DIM, intermediate_size=2 * width,
                                     max_position_embeddings=64, vocab_size=VOCAB, initializer_range=0.2,
                                     bos_token_id=2, eos_token_id=3, pad_token_id=0, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: make them matter
        for module in model.modules():
            for proj in ("q_proj", "k_proj", "v_proj"):
                bias = getattr(getattr(module, proj, None), "bias", None)
                if bias is not None:
                    bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    build_lm_tokenizer().save_pretrained(folder)
    return folder


def mask_of(name: str) -> list[Head]:
    return [Head("self", layer, h) for layer, hs in CASES[name][4].items() for h in hs]


def removed_parameters(name: str) -> int:
    """By hand: per removed query head its q_proj rows (d_model x d, + d biases in Qwen2) and its o_proj columns
    (d x d_model); per removed key/value head its k_proj and v_proj rows (2 x (d_model x d [+ d]))."""
    cls, heads, kv, _, removed = CASES[name]
    d, d_model, bias = HEAD_DIM, heads * HEAD_DIM, HEAD_DIM if cls == "Qwen2Config" else 0
    size = heads // kv
    total = 0
    for gone in removed.values():
        total += len(gone) * (d_model * d + bias + d * d_model)
        total += sum(2 * (d_model * d + bias) for g in range(kv) if set(range(g * size, (g + 1) * size)) <= set(gone))
    return total


def lm_eval_task(folder: Path) -> Path:
    """A loglikelihood lm-eval task over a local CSV file (lm-eval's own YAML format), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [("the cat sees", "dog"), ("a big red", "house"), ("the small bird", "sleeps"), ("here the dog", "runs"),
            ("quickly and then", "today"), ("the river", "tree")]
    (folder / "ll.csv").write_text("context,word\n" + "".join(f"{c},{w}\n" for c, w in rows))
    (folder / "stock_ll.yaml").write_text(yaml.safe_dump({
        "task": "stock_ll", "dataset_path": "csv", "dataset_kwargs": {"data_files": {"test": str(folder / "ll.csv")}},
        "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
        "doc_to_target": " {{word}}", "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]}))
    return folder


def config_file(folder: Path, model_dir: Path, corpus: Path, **extra) -> Path:
    cfg = {"model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa"},
           "data": {"path": str(corpus), "window": 16}, **extra}
    path = folder / f"{model_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Every case exported in-process (the CLI's own function), its gated logits, and the stock process's view."""
    tmp = tmp_path_factory.mktemp("stock")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(200, seed=3))
    ids = lm_batch(VOCAB).tolist()
    done, request = {}, {}
    for name in CASES:
        model_dir = save_case(tmp / name, name)
        out = export_pruned(load_config(str(config_file(tmp, model_dir, corpus))), tmp / f"{name}-stock",
                            mask=[str(h) for h in mask_of(name)], stock=True)
        done[name] = (model_dir, out)
        request[name] = {"dir": str(out), "ids": ids}
    return tmp, corpus, ids, done, stock_load(request)


@pytest.mark.parametrize("name", list(CASES))
def test_stock_transformers_loads_the_export_and_computes_the_gated_model(cases, name):
    import transformers

    _, _, ids, done, loaded = cases
    model_dir, out = done[name]
    _, heads, kv, _, removed = CASES[name]
    seen = loaded[name]
    full = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_full = sum(p.numel() for p in full.parameters())
    assert n_full - seen["n_params"] == removed_parameters(name)
    kept_q = heads - len(removed[0])
    size = heads // kv
    kept_kv = kv - sum(1 for g in range(kv) if set(range(g * size, (g + 1) * size)) <= set(removed[0]))
    assert seen["config"] == {"num_attention_heads": kept_q, "num_key_value_heads": kept_kv, "head_dim": HEAD_DIM,
                              "hidden_size": heads * HEAD_DIM}
    config = json.loads((out / "config.json").read_text())
    assert "pruned_heads" not in config and config["architectures"] == [type(full).__name__]
    manifest = json.loads((out / "headsweep-export.json").read_text())
    assert manifest["format"] == "stock" and manifest["n_params_pruned"] == seen["n_params"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert seen["tokens"] == tokenizer("the cat sees")["input_ids"]  # the tokenizer travels with the model
    gates = HeadGates(find_sites(full))
    with gates.masked(mask_of(name)):
        gated = lm_logits(full, torch.tensor(ids))
    stock = torch.tensor(seen["logits"])
    # summation order: the stock model's narrower projections; LAYERS layers and the LM head, the longest product
    # the feed-forward's (2 x width)
    _, bound = assert_routes_agree(stock, gated, depth=LAYERS + 1, width=2 * heads * HEAD_DIM, what=name)
    # other: the route must be able to fail: the mask moves the logits by far more than the bound
    assert (stock - lm_logits(full, torch.tensor(ids))).abs().max().item() > 100 * bound


def test_refusals_write_nothing(cases, tmp_path):
    """Each refusal names the problem (non-uniform: the layers and the uniform setting that would fit; an emptied
    layer: the layer) and leaves no folder."""
    tmp, corpus, _, done, _ = cases
    cfg = load_config(str(config_file(tmp, done["llama_8q2kv_heads"][0], corpus)))
    refusals = {
        # layer 0 loses a whole group, layer 1 one query head per group
        "layer 0 keeps 4 query / 1 key-value heads; layer 1 keeps 6 query / 2 key-value heads; the masks of a "
        "prune_level run with prune: {uniform: heads} fit": ["self:0:0", "self:0:1", "self:0:2", "self:0:3",
                                                              "self:1:0", "self:1:4"],
        "layer 1 keeps unequal numbers of query heads per key/value head": ["self:0:0", "self:0:4", "self:1:0",
                                                                          "self:1:1"],
        "prune: {uniform: kv_groups} fit": ["self:0:0", "self:0:1", "self:0:2", "self:0:3"],
        "removes every head of layer 1: a stock config cannot state a layer without attention":
            [f"self:1:{h}" for h in range(8)],
        # one query head per group: 6 heads, which LlamaConfig refuses for hidden_size 32
        "LlamaConfig refuses the pruned sizes {'num_attention_heads': 6, 'num_key_value_heads': 2, 'head_dim': 4} "
        "(The hidden size (32) is not a multiple of the number of attention heads (6).)":
            ["self:0:0", "self:0:4", "self:1:1", "self:1:5"],
    }
    for message, mask in refusals.items():
        with pytest.raises(HeadsweepError, match=None) as info:
            export_pruned(cfg, tmp_path / "out", mask=mask, stock=True)
        assert message in str(info.value), str(info.value)
        assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    # Without --stock the same mask is written in the pruned_heads format (headsweep.load_pruned loads it); a
    # folder that is not empty is refused, and replaced with force.
    out = export_pruned(cfg, tmp_path / "auto", mask=refusals["prune: {uniform: kv_groups} fit"])
    assert json.loads((out / "headsweep-export.json").read_text())["format"] == "pruned_heads"
    assert json.loads((out / "config.json").read_text())["pruned_heads"] == {"0": [0, 1, 2, 3]}
    uniform = ["self:0:0", "self:0:1", "self:0:2", "self:0:3", "self:1:4", "self:1:5", "self:1:6", "self:1:7"]
    with pytest.raises(HeadsweepError, match="exists and is not empty: choose a new folder, or add --force"):
        export_pruned(cfg, out, mask=uniform)
    export_pruned(cfg, out, mask=uniform, force=True)
    assert json.loads((out / "headsweep-export.json").read_text())["format"] == "stock"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto"]  # no staging folder left beside it


def test_gpt2_and_bert_are_refused_with_the_reason(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    from tiny_models import save_tiny_causal_lm

    gpt2 = save_tiny_causal_lm(tmp_path / "gpt2", "gpt2")
    corpus = tmp_path / "c.txt"
    corpus.write_text(lm_text(50))
    with pytest.raises(HeadsweepError, match=r"GPT2LMHeadModel's config derives the head size from the hidden size "
                                             r"\(n_embd / n_head\)"):
        export_pruned(load_config(str(config_file(tmp_path, gpt2, corpus))), tmp_path / "out",
                      mask=["self:0:0", "self:1:0"], stock=True)
    bert = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)}}
    (tmp_path / "bert.yaml").write_text(yaml.safe_dump(bert))
    with pytest.raises(HeadsweepError, match=r"config derives the head size from the hidden size "
                                             r"\(hidden_size / num_attention_heads\)"):
        export_pruned(load_config(str(tmp_path / "bert.yaml")), tmp_path / "out", mask=["self:0:0"], stock=True)
    assert not (tmp_path / "out").exists()


def test_a_uniform_run_exports_a_stock_model_that_scores_what_the_run_stored(cases, tmp_path, ray_address):
    """prune_level with prune.uniform: kv_groups through the CLI; ``headsweep export --from-run --level`` writes the
    stock architecture by default; the folder scores what the run stored at that level, and lm-eval's
    ``simple_evaluate(HFLM(pretrained=DIR))`` scores a task on it as a ``data.task: lm_eval`` sweep scores the
    level's mask. A second export into the full folder is refused (exit 2, one
    line)."""

    from headsweep.results.store import ResultStore
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter
    from headsweep.workers.families.registry import model_family

    tmp, corpus, _, done, _ = cases
    model_dir = done["llama_8q2kv_heads"][0]
    train = tmp_path / "train.txt"
    train.write_text(lm_text(200, seed=5))
    config = config_file(tmp_path, model_dir, corpus,
                         sweep={"experiments": ["baseline", "importance", "prune_level", "efficiency"],
                                "batch_size": 8},
                         importance={"data": {"path": str(train), "window": 16}},
                         prune={"uniform": "kv_groups", "levels": [0.0, 0.5]},
                         efficiency={"level": 0.5, "batch_sizes": [2], "warmup": 0, "repeats": 1,
                                     "prefill_batch_sizes": [1, 2], "decode_batch_sizes": [2], "prompt_tokens": 6,
                                     "new_tokens": 3})
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    level = next(e for e in ResultStore(str(store)).read("evaluations", run_id).to_pylist()
                 if e["experiment"] == "prune_level" and e["level"] == 0.5)
    assert level["eval_id"] == "prune_level/global-uniform_kv_groups/0.5000"
    masked = [Head.parse(h) for h in level["heads_masked"]]
    for layer in range(LAYERS):  # one whole key/value group (of 4 query heads) per layer
        assert sorted(h.head for h in masked if h.layer == layer) in ([0, 1, 2, 3], [4, 5, 6, 7])

    # The efficiency experiment timed the level's stock export as served: half the KV-cache bytes per token.
    served = ResultStore(str(store)).read("serving", run_id).to_pylist()
    assert sorted((r["variant"], r["phase"], r["batch_size"]) for r in served) == sorted(
        (v, p, b) for v in ("full", "stock") for p, b in (("prefill", 1), ("prefill", 2), ("decode", 2)))
    by = {(r["variant"], r["phase"], r["batch_size"]): r for r in served}
    assert by[("stock", "decode", 2)]["kv_bytes_per_token"] * 2 == by[("full", "decode", 2)]["kv_bytes_per_token"]
    assert by[("full", "prefill", 1)]["speedup"] == 1.0 and by[("stock", "prefill", 1)]["predicted_speedup"] > 1
    assert by[("stock", "prefill", 1)]["heads_masked"] == level["heads_masked"]

    out = tmp_path / "stock"
    args = ("export", str(config), "--from-run", run_id, "--level", "0.5", "--store", str(store), "--out", str(out))
    proc = run_cli(*args)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), proc.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    again = run_cli(*args[:-2], "--out", str(out), "--stock")
    assert again.returncode == 2 and "exists and is not empty" in error_line(again.stderr)
    assert "Traceback" not in again.stderr and again.stdout == ""

    family = model_family("hf_causal_lm")
    data = family.data_config(path=str(corpus), window=16)
    stock_adapter = CausalLMAdapter(family.model_config(path=str(out), attn_implementation="sdpa"), data,
                                    RuntimeOptions(batch_size=8))
    # summation order: perplexity = exp(mean NLL); the NLL's error is at most the logits' bound (logits ~ 10)
    assert stock_adapter.evaluate([[]])[0].score == pytest.approx(level["score"], rel=1e-4)

    # lm-eval on the folder scores a task as the sweep scores it at that level (data.task: lm_eval: the adapter
    # a run with that data evaluates its masks with, on the full model under the level's mask).
    tasks = lm_eval_task(tmp_path / "tasks")
    sweep_score, unmasked = (o.score for o in LmEvalAdapter(
        CausalLMModel(path=str(model_dir), attn_implementation="eager"),
        CausalLMData(task="lm_eval", tasks=["stock_ll"], include_path=str(tasks), metric="perplexity"),
        RuntimeOptions(batch_size=1)).evaluate([masked, []]))
    seen = stock_load({"level": {"dir": str(out), "ids": [[4, 5, 6]], "lm_eval": ["stock_ll", "perplexity"],
                                 "include_path": str(tasks)}})["level"]
    # summation order: perplexity = exp(-mean log-likelihood); each log-likelihood within a few times the logits'
    # bound (logits ~ 10, bound ~ 1e-4 relative), so 1e-4 relative
    assert seen["lm_eval_score"] == pytest.approx(sweep_score, rel=1e-4)
    assert sweep_score != pytest.approx(unmasked, rel=1e-3)  # other: the mask matters to the score
