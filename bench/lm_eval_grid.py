"""Benchmark: a single-head grid on an lm-eval multiple-choice task: headsweep (plain, prefix reuse, the context cache,
and the grid through ``headsweep run``) against the loop a user writes with lm-eval itself.

The model: a Llama-style decoder with grouped-query attention and q/k/v biases (Qwen2's architecture), random
weights (speed and equality do not need trained ones), of a shape far smaller than Qwen2.5-0.5B so that the routes
finish on a CPU in about 20 minutes: 4 layers, width 256, 8 query heads of 32 dimensions on 2 key/value heads,
vocabulary 1,000 (``--layers``, ``--hidden``, ``--heads``, ``--kv-heads``; stated in the output).
The task: ``--questions`` questions (default 200) with 4 choices each, contexts of 100-300 words and choices of 1-4
words over a word-level vocabulary (one token per word), written as a local lm-eval task (JSON documents, a task
YAML: ``output_type: multiple_choice``, ``acc`` and ``acc_norm``).

The grid: the baseline and every head of two layers (the first and the last: the two ends of what reuse can skip),
one route after another on ``--threads`` threads (in this process, no Ray, start-up not counted, except the
driver's route):

* **lm-eval loop** (what a user would otherwise do): per mask a forward pre-hook on each masked head's ``o_proj``
  zeroing its slice of the input, then ``lm_eval.simple_evaluate(model=HFLM(pretrained=model, batch_size=B))``
  (``B`` = ``--batch-size``). simple_evaluate's environment report (``pip list`` and other commands, seconds per
  call, nothing the scores depend on) is switched off, to lm-eval's advantage;
* **plain**: headsweep's ``data.task: lm_eval`` adapter, ``sweep.reuse: false, masks_per_batch: 1``: the whole
  model once per mask;
* **reuse**: the same with ``sweep.reuse: true, masks_per_batch: 0`` (the defaults): each batch's baseline states
  kept, each mask starting at its first gated layer, masks of one layer sharing passes;
* **context**: the same with ``sweep.context_cache: true``: each question's context once per mask, its four choices
  continued from the context's key/value cache (B contexts a batch, masks packed);
* **driver**: ``headsweep run`` as a user runs it (a subprocess: Ray's start, one worker with ``--threads``
  threads, the model load, lm-eval's task build, the grid as ``sweep.masks``, the store written), with
  ``sweep.context_cache: true``; its whole wall time, start-up included.

Figures: ``vs_lm_eval_loop`` = lm-eval loop wall / the driver's wall (goal >= 3); ``context_in_process`` = lm-eval
loop wall / the context route's wall; ``reuse_over_plain`` = plain wall / reuse wall; ``reuse_over_bound`` = bound /
reuse wall, where ``bound = plain wall x sum_m C(first layer of m) / (n_masks x C_full)`` from per-module seconds
measured with hooks on one forward pass (as bench/real_size.py: a mask first gated at layer l still needs that
layer without its attention core, the layers above and the head); ``equal``: every mask's ``acc`` and ``acc_norm``
(each document's, and the aggregate) identical between lm-eval and the plain and reuse routes, the context route
and the driver's stored scores, with the largest log-likelihood differences printed (batches of B rows round in
another order than HFLM's batches, the context cache multiplies matrices of other shapes: a few float32 epsilons).

Prints ``RESULT lm_eval_grid vs_lm_eval_loop=<x> context_in_process=<x> reuse_over_plain=<x> reuse_over_bound=<x>
equal=<true|false>``.

Usage: python -m bench.lm_eval_grid [--questions N] [--layers L] [--hidden H] [--heads Q] [--kv-heads K]
[--threads T] [--smoke]
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

from bench import common

SIZES = {"questions": 200, "context": (100, 300), "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2,
         "vocab": 1000, "batch_size": 16}


@common.on_smoke
def use_smoke() -> None:
    """Six questions with contexts of 10-20 words, a 2-layer model of width 32."""
    SIZES.update(questions=6, context=(10, 20), layers=2, hidden=32, heads=4, kv_heads=2, vocab=60, batch_size=4)


def build_model(folder: Path, seed: int = 0) -> None:
    """The Qwen2-style model (random weights, q/k/v biases) and a word-level tokenizer over ``w0 .. wN``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    words = [f"w{i}" for i in range(SIZES["vocab"] - 4)]
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>")
    hidden, heads = SIZES["hidden"], SIZES["heads"]
    cfg = transformers.Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=SIZES["layers"],
                                   num_attention_heads=heads, num_key_value_heads=SIZES["kv_heads"],
                                   head_dim=hidden // heads, intermediate_size=int(hidden * 2.75),
                                   max_position_embeddings=512, initializer_range=0.2, bos_token_id=2,
                                   eos_token_id=3, pad_token_id=0, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_task(folder: Path, seed: int = 0) -> Path:
    """The questions as JSON lines and the lm-eval task YAML reading them; returns the task folder."""
    import yaml

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(SIZES["vocab"] - 4)]
    low, high = SIZES["context"]
    lines = []
    for _ in range(SIZES["questions"]):
        context = " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))
        choices = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(4)]
        lines.append(json.dumps({"q": context, "opts": choices, "label": rng.randrange(4)}))
    tasks = folder / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "questions.jsonl").write_text("\n".join(lines) + "\n")
    (tasks / "bench_mc.yaml").write_text(yaml.safe_dump({
        "task": "bench_mc", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(tasks / "questions.jsonl")}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{opts}}",
        "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    return tasks


def lm_eval_loop(model_dir: Path, tasks: Path, masks: list[list[tuple[int, int]]]) -> tuple[float, list[dict]]:
    """Per mask: hooks removing the heads at their ``o_proj`` input, then lm-eval's own evaluation. Returns the
    wall seconds and per mask (acc, acc_norm, per-document values and log-likelihoods)."""
    import torch
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    # the tokenizer.json as saved (AutoTokenizer would pick Qwen2's slow class for this config, another tokenizer)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    head_dim = model.config.head_dim
    out = []
    start = time.perf_counter()
    for mask in masks:
        handles = []
        for layer, head in mask:
            def zero(_module, args, head=head):
                x = args[0].clone()
                x[..., head * head_dim : (head + 1) * head_dim] = 0
                return (x,)
            handles.append(model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
        try:
            with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None), torch.inference_mode():
                res = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer,
                                                 batch_size=SIZES["batch_size"]),
                                      tasks=["bench_mc"], task_manager=manager, log_samples=True, bootstrap_iters=0)
        finally:
            for h in handles:
                h.remove()
        samples = sorted(res["samples"]["bench_mc"], key=lambda s: s["doc_id"])
        scores = res["results"]["bench_mc"]
        out.append({"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"],
                    "docs": [(s["acc"], s["acc_norm"]) for s in samples],
                    "lls": [float(r[0][0]) for s in samples for r in s["resps"]]})
    return time.perf_counter() - start, out


def headsweep_route(model_dir: Path, tasks: Path, masks: list[list[tuple[int, int]]], reuse: bool,
                    context_cache: bool = False) -> tuple[float, list[dict], str]:
    """The grid through the ``data.task: lm_eval`` adapter (the baseline computed while it loads, as a worker does,
    then every mask timed)."""
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel, CausalLMRuntime
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter

    adapter = LmEvalAdapter(CausalLMModel(path=str(model_dir), attn_implementation="sdpa"),
                            CausalLMData(task="lm_eval", tasks=["bench_mc"], include_path=str(tasks)),
                            CausalLMRuntime(batch_size=SIZES["batch_size"], reuse=reuse,
                                            masks_per_batch=0 if reuse else 1, context_cache=context_cache))
    heads = [[Head("self", layer, head) for layer, head in m] for m in masks]
    start = time.perf_counter()
    values = adapter.values(heads)
    outs = [adapter.output(v, 0.0) for v in values]
    seconds = time.perf_counter() - start
    order = [r[0] for reqs in adapter.encoded.requests[0] for r in reqs]
    results = [{"acc": float(o.stats[:, 0].mean()), "acc_norm": float(o.stats[:, 1].mean()),
                "docs": [(float(a), float(b)) for a, b in o.stats], "lls": [float(v[r, 0]) for r in order]}
               for o, v in zip(outs, values, strict=True)]
    return seconds, results, adapter.reuse_note


def driver_route(root: Path, model_dir: Path, tasks: Path, masks: list[list[tuple[int, int]]], threads: int
                 ) -> tuple[float, dict[str, float]]:
    """``headsweep run`` in a subprocess with the grid as custom masks and the context cache on: its wall seconds
    and each mask's stored score (``acc``), keyed by the mask's head names (the baseline's by "")."""
    import subprocess
    import sys

    import yaml

    from headsweep.results.store import ResultStore

    config = root / "driver.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {"task": "lm_eval", "tasks": ["bench_mc"], "include_path": str(tasks), "metric": "acc"},
        "sweep": {"experiments": ["baseline", "custom"], "workers": 1, "threads_per_worker": threads,
                  "batch_size": SIZES["batch_size"], "context_cache": True,
                  "masks": [[f"self:{layer}:{head}" for layer, head in m] for m in masks if m]}}))
    store = root / "store"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "headsweep", "run", str(config), "--store", str(store)],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"headsweep run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    table = ResultStore(str(store)).read("evaluations", columns=["heads_masked", "score"]).to_pylist()
    return seconds, {",".join(row["heads_masked"] or []): row["score"] for row in table}


def layer_costs(model_dir: Path, tasks: Path) -> tuple[float, list[float]]:
    """Measured seconds of one forward pass over the task's rows (batches of B, best of 3): the full pass and, per
    first gated layer l, what a reuse mask still runs (layer l without its attention core but with its output
    projection, the layers above, the final norm and LM head)."""
    import torch

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter

    adapter = LmEvalAdapter(CausalLMModel(path=str(model_dir), attn_implementation="sdpa"),
                            CausalLMData(task="lm_eval", tasks=["bench_mc"], include_path=str(tasks)),
                            RuntimeOptions(batch_size=SIZES["batch_size"], reuse=False))
    model = adapter.model
    layers = list(model.model.layers)
    spans: dict[tuple[str, int], float] = {}
    opened: dict[tuple[str, int], float] = {}

    def watch(module, key):
        def pre(*_):
            opened[key] = time.perf_counter()

        def post(*_):
            spans[key] = spans.get(key, 0.0) + time.perf_counter() - opened[key]
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    handles = []
    for i, layer in enumerate(layers):
        handles += watch(layer, ("layer", i)) + watch(layer.self_attn, ("core", i))
        handles += watch(layer.self_attn.o_proj, ("out", i))
    best = None
    try:
        for _ in range(3):
            spans.clear()
            start = time.perf_counter()
            with torch.inference_mode():
                for batch in adapter.batches:
                    adapter.packed_pass(batch.input_ids, batch.packed)
            total = time.perf_counter() - start
            if best is None or total < best[0]:
                best = (total, dict(spans))
    finally:
        for h in handles:
            h.remove()
    total, got = best
    n = len(layers)
    rest = total - sum(got[("layer", i)] for i in range(n))  # embeddings, final norm, LM head, log-softmax
    partial = [got[("layer", i)] - got[("core", i)] + got[("out", i)] + sum(got[("layer", j)] for j in range(i + 1, n))
               + rest for i in range(n)]
    return total, partial


def main() -> None:
    parser = common.command_line(__doc__)
    parser.add_argument("--questions", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int, help="query heads per layer")
    parser.add_argument("--kv-heads", type=int, help="key/value heads per layer")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    common.enable_smoke(args)
    for key in ("questions", "layers", "hidden", "heads", "kv_heads"):
        if getattr(args, key):
            SIZES[key] = getattr(args, key)
    common.quiet_logging()
    # the model's config says Qwen2, its tokenizer.json is a word-level one: headsweep's loader says so, as expected
    logging.getLogger("headsweep.workers.families.hf_shared.tokenizer").setLevel(logging.ERROR)
    import torch

    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import offline, quiet

    torch.set_num_threads(args.threads)
    offline()
    quiet()
    with tempfile.TemporaryDirectory(prefix="lm_eval_grid-") as scratch:
        root = Path(scratch)
        model_dir = root / "model"
        build_model(model_dir)
        tasks = write_task(root)
        last = SIZES["layers"] - 1
        masks = [[]] + [[(layer, h)] for layer in (0, last) for h in range(SIZES["heads"])]
        common.log(f"shape: Qwen2-style, {SIZES['layers']} layers, width {SIZES['hidden']}, {SIZES['heads']} query "
                   f"heads on {SIZES['kv_heads']} key/value heads, vocabulary {SIZES['vocab']}; task: "
                   f"{SIZES['questions']} questions x 4 choices, contexts {SIZES['context'][0]}-{SIZES['context'][1]} "
                   f"tokens; grid: baseline + {len(masks) - 1} single heads of layers 0 and {last}; batch "
                   f"{SIZES['batch_size']}; {args.threads} thread(s)")
        full, partial = layer_costs(model_dir, tasks)
        plain_s, plain, _ = headsweep_route(model_dir, tasks, masks, reuse=False)
        common.log(f"headsweep plain: {plain_s:.1f} s")
        reuse_s, reused, note = headsweep_route(model_dir, tasks, masks, reuse=True)
        common.log(f"headsweep reuse: {reuse_s:.1f} s ({note.split(':')[0]})")
        context_s, cached, note = headsweep_route(model_dir, tasks, masks, reuse=True, context_cache=True)
        common.log(f"headsweep context cache: {context_s:.1f} s ({note.split(':')[0]})")
        driver_s, stored = driver_route(root, model_dir, tasks, masks, args.threads)
        common.log(f"headsweep run (driver, Ray, one worker, start-up included): {driver_s:.1f} s")
        loop_s, theirs = lm_eval_loop(model_dir, tasks, masks)
        common.log(f"lm-eval loop: {loop_s:.1f} s")
    # the baseline costs the full pass on every route; each masked grid cell its first gated layer's share
    share = (full + sum(partial[m[0][0]] for m in masks[1:])) / (full * len(masks))
    bound = plain_s * share
    routes = list(zip(theirs, plain, reused, cached, strict=True))
    equal = all(a[k] == b[k] == c[k] == d[k] for a, b, c, d in routes for k in ("docs", "acc", "acc_norm"))
    names = [",".join(f"self:{layer}:{head}" for layer, head in m) for m in masks]
    equal = equal and all(stored.get(name) == a["acc"] for name, a in zip(names, theirs, strict=True))
    worst = max(abs(x - y) for a, _, c, _ in routes for x, y in zip(a["lls"], c["lls"], strict=True))
    worst_context = max(abs(x - y) for a, _, _, d in routes for x, y in zip(a["lls"], d["lls"], strict=True))
    same_routes = all(a["lls"] == b["lls"] for a, b in zip(plain, reused, strict=True))
    common.log(f"reuse bound: plain x {share:.3f} = {bound:.1f} s; largest |loglikelihood| difference lm-eval vs "
               f"headsweep reuse {worst:.3g}, vs the context cache {worst_context:.3g}; plain == reuse "
               f"log-likelihoods bit for bit: {same_routes}; lm-eval loop / reuse (in process): "
               f"{loop_s / reuse_s:.2f}")
    common.result("lm_eval_grid", vs_lm_eval_loop=f"{loop_s / driver_s:.2f}",
                  context_in_process=f"{loop_s / context_s:.2f}", reuse_over_plain=f"{plain_s / reuse_s:.2f}",
                  reuse_over_bound=f"{bound / reuse_s:.3f}", equal=str(equal).lower())


if __name__ == "__main__":
    main()
