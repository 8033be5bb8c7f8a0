"""Benchmark: real model sizes through the real driver: BERT-base, GPT-2 small, Qwen2.5-0.5B and Llama-3.2-1B.

Each shape is built with exactly the published configuration (vocabulary included; the parameter count is checked
against the published one) and seeded random weights, and cached with its tokenizer and data under the headsweep
cache (``$HEADSWEEP_CACHE``, default ``~/.cache/headsweep``, in ``real_size/``). The causal LMs come from
``bench/gpu_check.py``'s shapes and builder (a word-level tokenizer of 8,192 words in a folder of its own,
``model.tokenizer``, and a text of random words: every word is one token); BERT-base gets a word-level tokenizer
over the words of its sentences (BERT's special tokens, ids below 30,522) and a 2-label classification head. Data of
a realistic shape: LMs 8 windows of 256 tokens (``data.window`` 256, ``sweep.batch_size`` 8), BERT-base 128 SST-2
validation sentences (``../shared/data/sst2/dev.tsv``; generated sentences of 4 to 60 words where that is absent)
of up to 128 tokens, in the classifier's length-sorted batches of 32; gradient importance on as much other data
(the next 8 windows of the text; 128 SST-2 training sentences).

Per shape, two sweeps through the public API (``headsweep.run`` and ``headsweep.open_store``), each on two workers
(``sweep.workers: 2``: one thread each on this machine), on an embedded Ray instance:

* **reuse** (``sweep.reuse: true``, the default), a user's whole run: ``custom`` masks (the grid below),
  ``importance`` (gradient), ``prune_level`` at 25% and 50% of the heads, and ``efficiency`` (the heads of the 50%
  level physically removed from a copy of the model, timed against the full model);
* **plain** (``sweep.reuse: false``), the reference path: the same grid and the two pruning masks of the reuse run
  (read from its ``evaluations``), as ``custom`` masks.

The grid: single-head ablations in the first, the middle and the last layer (every head of those layers for
BERT-base and GPT-2; four heads, 0, H/3, 2H/3 and H-1, for the 0.5B and 1B shapes) and the all-but-one masks of the
middle layer (every head kept in turn; the same four for the large shapes).

Figures per shape (printed as measured):

* **matrix-product rate** R: FLOP/s of ``torch.mm`` of two 2048 x 2048 float32 matrices on one thread (the threads
  of one worker: the driver gives each of the two workers cpu_count / 2 = 1 thread here), from the fastest single
  product of those run in 2 s, measured in this process at the start, before each shape and after its sweeps; R is
  the best so far (on a shared machine other processes only slow a product down, so the best is the closest to what
  a core does). The CPU seconds the workers got during the grid (``/proc/<pid>/stat``) are printed beside it: on a
  shared machine the wall-time MFU is also what the other processes left.
* **grid wall time** of a run: from the driver's ``2 workers ready`` line (the workers have loaded the model and the
  data and evaluated the baseline; every mask is still to come) to the last mask evaluation of the grid landing on
  the driver (``evaluations.finished_at``); for the reuse run the ``prune_level`` phase adds its own span (from the
  end of gradient importance to its last evaluation). ``s/mask`` = grid wall / masks.
* **MFU** = FLOPs the grid's masks actually compute / grid wall / (R x 2 cores). FLOPs are counted from the
  configuration, a multiply-add being 2 FLOPs. Per decoder layer, for a window of T tokens (h hidden size, I the
  feed-forward size, d head size, n query and n_kv key/value heads, q = n d, kv = n_kv d, m = 3 feed-forward matrices
  for Llama/Qwen2 (gate, up, down) and 2 for GPT-2 and BERT)::

      proj = 2 T (h (q + 2 kv) + q h)        q/k/v and output projections
      ffn  = 2 T m h I                       feed-forward
      attn = 2 n d T (T + 1)                 causal scores and values (query t reads t keys: 4 d t)
      head = 2 K h V                         the LM head over K positions (K = T: every position after the first
                                             is scored, and the logits of all T are computed)

  A plain mask computes ``L (proj + ffn + attn) + head``; a reuse mask whose first gated layer is l computes
  ``2 T q h + ffn`` at layer l (its attention is the output projection of the cached per-head contexts) and
  ``(L - 1 - l) (proj + ffn + attn) + head`` above it. BERT (bidirectional) per batch of B sentences padded to P
  tokens: ``proj`` and ``ffn`` with B P tokens, ``attn = 4 B n d P^2``, and instead of the LM head the pooler and
  classifier, ``2 B (h^2 + 2 h)``. Embedding look-ups, norms, activations, softmax and the loss are left out (about
  1%). The baseline is not counted: the workers evaluate it while loading, before the grid starts.
* **reuse bound**: the reuse grid can at best take the plain grid's wall time scaled by the share of the plain work
  its masks still need: ``bound = plain wall x sum_m C(first layer of m) / sum_m C_full``, where ``C_full`` = the
  embeddings + every layer + the head, and ``C(l)`` = layer l without its attention core (query/key/value and
  scores; the output projection stays, as the gated projection of the cached contexts) + the layers above l + the
  head, from **measured** per-layer seconds: one forward pass of the shape's batch in this process on one thread,
  timed per module with hooks (best of the timed passes). ``reuse_over_bound`` = bound / reuse grid wall (1: reuse
  reaches its bound; the goal is >= 0.9).
* **peak RSS per worker**: ``VmHWM`` of each Ray worker process of the run (``/proc/<pid>/status``, sampled every
  0.25 s while the run lasts; the workers are this process's descendants, named by their pid in
  ``evaluations.worker``), against the model's own size (parameters x 4 bytes) and the configured budgets
  (activations 1 GiB, reuse states at most 4 GiB, docs/how-it-works.md, "Batch sizes").
* **equal**: for every mask both runs evaluated (the baseline, the grid, the two pruning masks), the stored
  per-example statistics (``examples.stats``: ``[nll_sum, n_tokens]`` per window, ``[correct]`` per sentence) and
  losses of the two runs are compared. Identical is equal. Otherwise they must lie within tau = 2E, where E is the
  largest rounding error of one float32 evaluation, measured on the baseline against a float64 evaluation of the same
  weights (float64's unit roundoff is 2^29 times smaller); two float32 routes that round the same quantities in a
  different order differ by at most 2E (triangle inequality through the exact value). A per-sentence ``correct``
  may differ only where the float64 logit margin is below tau.

Prints per shape ``RESULT real_size shape=<name> plain_mfu=<x> reuse_mfu=<x> reuse_over_bound=<x>
peak_rss_mib=<n> equal=<true|false>`` as soon as that shape is measured (peak_rss_mib: the larger worker's), after
its phase breakdown (worker start and load, grid, importance, pruning, efficiency, the rest: significance and
writes) and its per-module forward profile.

Usage: python -m bench.real_size [--shape NAME] [--store DIR] [--smoke]
``--smoke``: bert-base and llama-3.2-1b (or ``--shape``) shrunk (4 layers, heads of 8, vocabulary 2,048 or 4,096),
4 windows of 32 tokens or 24 sentences, two heads per grid layer, R from 256 x 256 products; seconds per shape,
figures meaningless (tests/project/test_bench_smoke_real_size.py).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from bench import common
from bench.classifier import bert_tokenizer, frequent_words
from bench.common import log
from bench.flops import Arch, cpu_matmul_rate, first_layer
from bench.gpu_check import LLAMA32_1B, QWEN25_05B, Shape, build_folder
from bench.gpu_check import tiny as tiny_lm
from bench.sweeps import Run, WorkerWatch, examples_by_mask, run_sweep

GPT2_SMALL = Shape("gpt2", "GPT2Config", dict(
    vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, activation_function="gelu_new",
    layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=50256, eos_token_id=50256,
    tie_word_embeddings=True), 124_439_808)
BERT_BASE = Shape("bert-base", "BertConfig", dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, initializer_range=0.02,
    pad_token_id=0, num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1}),
    109_483_778)  # bert-base-uncased's 109,482,240 and a 2-label head


@dataclass(frozen=True)
class Spec:
    """A benchmark shape: the model's configuration, its family, and how many heads of a grid layer it sweeps."""

    shape: Shape
    family: str  # "hf_causal_lm" or "hf_classifier"
    grid_heads: int | None  # heads per grid layer (None: all)

    @property
    def name(self) -> str:
        return self.shape.name


SPECS = {s.name: s for s in (Spec(BERT_BASE, "hf_classifier", None), Spec(GPT2_SMALL, "hf_causal_lm", None),
                              Spec(QWEN25_05B, "hf_causal_lm", 4), Spec(LLAMA32_1B, "hf_causal_lm", 4))}
# The shapes a smoke run measures without --shape: one per family (the LM with grouped-query attention), since
# every shape of a family takes the same code path here and each costs a smoke run 15 s.
SMOKE_SHAPES = ("bert-base", "llama-3.2-1b")


@dataclass(frozen=True)
class Sizes:
    """Data and run sizes (full or smoke)."""

    windows: int = 8
    window: int = 256
    lm_batch: int = 8
    sentences: int = 128
    max_length: int = 128
    efficiency_batches: tuple[int, ...] = (1,)
    efficiency_batches_classifier: tuple[int, ...] = (1, 32)
    warmup: int = 1
    repeats: int = 3
    profile_windows: int = 2  # windows per timed forward of the per-layer profile
    smoke_heads: int | None = None  # heads per grid layer in smoke mode
    mm_n: int = 2048  # the matrix-product rate R's matrices
    mm_seconds: float = 2.0  # and how long it is measured


SIZES = Sizes()


@common.on_smoke
def use_smoke() -> None:
    """Tiny shapes and data (seconds per shape)."""
    global SIZES, SPECS
    SIZES = Sizes(windows=4, window=32, lm_batch=4, sentences=24, max_length=32, efficiency_batches=(1,),
                  efficiency_batches_classifier=(1,), warmup=0, repeats=1, profile_windows=2, smoke_heads=2,
                  mm_n=256, mm_seconds=0.0)  # R measured 10 times a run: 2 s or more each at full size
    SPECS = {name: replace(s, shape=tiny_shape(s.shape), grid_heads=2) for name, s in SPECS.items()}


def mm_rate() -> float:
    """R's measurement now (module docstring), at this run's sizes."""
    return cpu_matmul_rate(n=SIZES.mm_n, seconds=SIZES.mm_seconds)


def tiny_shape(shape: Shape) -> Shape:
    """The architecture shrunk: 4 layers, heads of 8 (heads per layer kept), a small vocabulary."""
    if shape.config_class == "GPT2Config":
        v = shape.values
        return Shape(shape.name, shape.config_class, {**v, "n_layer": 4, "n_embd": v["n_head"] * 8,
                                                      "vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 1})
    if shape.config_class == "BertConfig":
        heads = shape.values["num_attention_heads"]
        return Shape(shape.name, shape.config_class, {**shape.values, "num_hidden_layers": 4, "hidden_size": heads * 8,
                                                      "intermediate_size": heads * 32, "vocab_size": 4096})
    return replace(tiny_lm(shape), name=shape.name)


def cache_root() -> Path:
    """Where the built shapes live: the headsweep cache (the smoke cache in smoke mode)."""
    if common.SMOKE:
        return common.smoke_cache() / "real_size"
    return Path(os.environ.get("HEADSWEEP_CACHE", Path.home() / ".cache" / "headsweep")) / "real_size"


# -- building the shapes ---------------------------------------------------------------------------------------

def shape_key(spec: Spec) -> str:
    import hashlib

    text = json.dumps([spec.shape.config_class, spec.shape.values, SIZES.windows, SIZES.window, SIZES.sentences],
                      sort_keys=True)
    return f"{spec.name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def build(spec: Spec) -> Path:
    """The shape's folder (model, tokenizer, evaluation and importance data), built once and cached."""
    folder = cache_root() / shape_key(spec)
    if (folder / "built.json").exists():
        log(f"{spec.name}: using cached {folder}")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
    start = time.perf_counter()
    try:
        if spec.family == "hf_causal_lm":
            build_lm(spec, tmp)
        else:
            build_classifier(spec, tmp)
        (tmp / "built.json").write_text(json.dumps({"seconds": round(time.perf_counter() - start, 1)}) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{spec.name}: built in {time.perf_counter() - start:.1f} s: {folder}")
    return folder


def build_lm(spec: Spec, folder: Path) -> None:
    """gpu_check's builder (published configuration, seeded weights, word tokenizer in ``tokenizer/``, random-word
    text); the text is split into the evaluation windows and the importance windows after them."""
    import torch

    per = SIZES.windows * SIZES.window
    text, _config = build_folder(spec.shape, folder, "cpu", torch.float32, 2 * per + 64, seed=0)
    lines = text.read_text(encoding="utf-8").splitlines()
    words_per_line = len(lines[0].split())
    cut = math.ceil(per / words_per_line) + 1  # one line more than the windows need
    (folder / "eval.txt").write_text("\n".join(lines[:cut]) + "\n", encoding="utf-8")
    (folder / "importance.txt").write_text("\n".join(lines[cut:]) + "\n", encoding="utf-8")
    text.unlink()


def sst2_rows(split: str, n: int, skip: int = 0) -> list[dict]:
    """``n`` SST-2 rows of ``split`` (sentence, label), or generated ones where the data folder is absent."""
    path = common.smoke_data() / "sst2" / f"{split}.tsv" if common.SMOKE else common.DATA / "sst2" / f"{split}.tsv"
    if path.exists():
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        return [{"sentence": r["sentence"], "label": r["label"]} for r in rows[skip : skip + n]]
    import random

    rng = random.Random(hash(split) % 1000 + skip)
    words = [f"w{i}" for i in range(5000)]
    return [{"sentence": " ".join(rng.choice(words) for _ in range(rng.randint(4, 60))), "label": str(i % 2)}
            for i in range(n)]


def build_classifier(spec: Spec, folder: Path) -> None:
    """BERT with the published configuration, seeded weights, a 2-label head, a word tokenizer over its data."""
    import torch
    import transformers

    config = spec.shape.config()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    count = sum(p.numel() for p in model.parameters())
    if spec.shape.parameters is not None and count != spec.shape.parameters:
        raise SystemExit(f"real_size: error: {spec.name} built with {count:,} parameters, the published model has "
                         f"{spec.shape.parameters:,}")
    model.save_pretrained(folder)
    evaluation = sst2_rows("dev", SIZES.sentences)
    importance = sst2_rows("train", SIZES.sentences)
    words = frequent_words([r["sentence"] for r in evaluation + importance], config.vocab_size - 5)
    bert_tokenizer(words).save_pretrained(folder)
    for name, rows in (("eval.tsv", evaluation), ("importance.tsv", importance)):
        with open(folder / name, "w", encoding="utf-8", newline="") as f:
            f.write("sentence\tlabel\n" + "".join(f"{r['sentence']}\t{r['label']}\n" for r in rows))


# -- the grid and the configs -------------------------------------------------------------------------------------

def grid(spec: Spec, layers: int, heads: int) -> list[list[str]]:
    """Single heads of the first, middle and last layer, and the middle layer's all-but-one masks."""
    picks = list(range(heads)) if spec.grid_heads is None else sorted(
        {0, heads // 3, 2 * heads // 3, heads - 1} if spec.grid_heads == 4 else {0, heads - 1})
    middle = layers // 2
    single = [[f"self:{layer}:{h}"] for layer in sorted({0, middle, layers - 1}) for h in picks]
    all_but_one = [[f"self:{middle}:{o}" for o in range(heads) if o != h] for h in picks]
    return single + all_but_one


def lm_batch(spec: Spec) -> int:
    """Windows per batch (``sweep.batch_size``): all 8, or 4 for the 0.5B and 1B shapes (products of 1,024 rows
    still; half the activations, and gradient importance's backward pass fits beside two model copies)."""
    return SIZES.lm_batch if spec.grid_heads is None or common.SMOKE else max(1, SIZES.lm_batch // 2)


def write_config(spec: Spec, folder: Path, masks: list[list[str]], reuse: bool, out: Path) -> Path:
    """The run's YAML (written as JSON, which YAML reads)."""
    if spec.family == "hf_causal_lm":
        model = {"kind": "hf_causal_lm", "path": str(folder), "tokenizer": str(folder / "tokenizer"),
                 "attn_implementation": "sdpa", "dtype": "float32"}
        data = {"path": str(folder / "eval.txt"), "window": SIZES.window, "max_windows": SIZES.windows}
        importance = {**data, "path": str(folder / "importance.txt")}
        batching = {"batch_size": lm_batch(spec)}
        batches = list(SIZES.efficiency_batches)
    else:
        model = {"kind": "hf_classifier", "path": str(folder), "attn_implementation": "sdpa", "dtype": "float32"}
        data = {"path": str(folder / "eval.tsv"), "max_length": SIZES.max_length}
        importance = {**data, "path": str(folder / "importance.tsv")}
        batching = {}
        batches = list(SIZES.efficiency_batches_classifier)
    experiments = ["baseline", "custom"] + (["importance", "prune_level", "efficiency"] if reuse else [])
    cfg = {"name": f"real_size-{spec.name}-{'reuse' if reuse else 'plain'}", "seed": 0, "model": model, "data": data,
           "sweep": {"experiments": experiments, "workers": 2, "reuse": reuse, "masks": masks, **batching}}
    if reuse:
        cfg.update(importance={"method": "gradient", "data": importance}, prune={"levels": [0.25, 0.5]},
                   efficiency={"level": 0.5, "batch_sizes": batches, "warmup": SIZES.warmup,
                               "repeats": SIZES.repeats})
    out.write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    return out


# -- FLOPs, rates and the per-layer profile ------------------------------------------------------------------------

@dataclass
class Workload:
    """The shape's evaluation set as the workers batch it: model inputs, and (rows, length, logits) per batch."""

    inputs: list[dict]
    batches: list[tuple[int, int, int]]
    texts: int  # characters tokenised
    tokenise_s: float


def workload(spec: Spec, folder: Path) -> Workload:
    """Tokenise the evaluation data as the worker does (one corpus cut into windows; or sentences sorted by length
    into batches of 32, each padded to its longest)."""
    import torch
    from transformers import AutoTokenizer

    if spec.family == "hf_causal_lm":
        tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
        text = (folder / "eval.txt").read_text(encoding="utf-8")
        start = time.perf_counter()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seconds = time.perf_counter() - start
        t = SIZES.window
        rows = torch.tensor(ids[: SIZES.windows * t]).view(SIZES.windows, t)
        step = lm_batch(spec)
        inputs = [{"input_ids": rows[i : i + step]} for i in range(0, SIZES.windows, step)]
        return Workload(inputs, [(x["input_ids"].shape[0], t, t) for x in inputs], len(text), seconds)
    tok = AutoTokenizer.from_pretrained(folder)
    with open(folder / "eval.tsv", encoding="utf-8", newline="") as f:
        texts = [r["sentence"] for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    start = time.perf_counter()
    enc = tok(texts, truncation=True, max_length=SIZES.max_length)
    seconds = time.perf_counter() - start
    order = sorted(range(len(texts)), key=lambda i: len(enc["input_ids"][i]))
    inputs = []
    for i in range(0, len(order), 32):
        feats = [{k: enc[k][j] for k in enc} for j in order[i : i + 32]]
        inputs.append(dict(tok.pad(feats, return_tensors="pt")))
    return Workload(inputs, [(x["input_ids"].shape[0], x["input_ids"].shape[1], 0) for x in inputs],
                    sum(map(len, texts)), seconds)


@dataclass
class LayerCosts:
    """Measured seconds of one pass over the profiled batches, per module."""

    embed: float
    layers: list[float]
    cores: list[float]  # attention cores (query/key/value and scores; Llama/GPT-2: with the output projection)
    out_proj: list[float]
    out_proj_inside: bool  # the output projection runs inside the core module
    head: float  # after the last layer: final norm, LM head (or pooler and classifier) and the loss
    projection: float  # of it: the LM head's matrix product (or the pooler and classifier)
    total: float
    load_s: float

    def full(self) -> float:
        return self.embed + sum(self.layers) + self.head

    def from_layer(self, first: int) -> float:
        """A reuse mask first gated at ``first``: that layer without its attention core (its output projection,
        the gated projection of the cached contexts, stays), the layers above and the head."""
        partial = self.layers[first] - self.cores[first] + (self.out_proj[first] if self.out_proj_inside else 0.0)
        return partial + sum(self.layers[first + 1 :]) + self.head


def modules(model, family: str):
    """(embedding modules, layers, attention cores, output projections, projection inside the core)."""
    kind = model.config.model_type
    if kind == "bert":
        layers = list(model.bert.encoder.layer)
        return ([model.bert.embeddings], layers, [x.attention.self for x in layers],
                [x.attention.output.dense for x in layers], False)
    if kind == "gpt2":
        layers = list(model.transformer.h)
        return [model.transformer.wte, model.transformer.wpe], layers, [x.attn for x in layers], \
            [x.attn.c_proj for x in layers], True
    layers = list(model.model.layers)
    return [model.model.embed_tokens], layers, [x.self_attn for x in layers], [x.self_attn.o_proj for x in layers], True


def profile_layers(spec: Spec, folder: Path, work: Workload, repeats: int) -> LayerCosts:
    """Per-module seconds of one forward pass over the evaluation set's batches, on one thread, in this process
    (the workers' setting), best of ``repeats`` timed passes after a warm-up. LMs run ``SIZES.profile_windows``
    windows per pass and the figures are scaled to the whole set (layer costs are linear in rows)."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(1)
    start = time.perf_counter()
    cls = transformers.AutoModelForCausalLM if spec.family == "hf_causal_lm" else \
        transformers.AutoModelForSequenceClassification
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    load_s = time.perf_counter() - start
    embeds, layers, cores, outs, inside = modules(model, spec.family)
    spans: dict[tuple[str, int], float] = {}
    opened: dict[tuple[str, int], float] = {}
    marks: dict[str, float] = {}

    def watch(module, key):
        def pre(*_):
            opened[key] = time.perf_counter()
            if key[0] == "layer" and key[1] == 0:
                marks["first"] = opened[key]

        def post(*_):
            now = time.perf_counter()
            spans[key] = spans.get(key, 0.0) + now - opened[key]
            if key[0] == "layer" and key[1] == len(layers) - 1:
                marks["last"] = now
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    handles = []
    for i, (layer, core, out) in enumerate(zip(layers, cores, outs, strict=True)):
        handles += watch(layer, ("layer", i)) + watch(core, ("core", i)) + watch(out, ("out", i))
    for j, e in enumerate(embeds):
        handles += watch(e, ("embed", j))
    top = [model.lm_head] if spec.family == "hf_causal_lm" else [model.bert.pooler, model.classifier]
    for j, m in enumerate(top):
        handles += watch(m, ("top", j))

    if spec.family == "hf_causal_lm":
        rows = torch.cat([x["input_ids"] for x in work.inputs])
        passes = [{"input_ids": rows[: SIZES.profile_windows]}]
        scale = len(rows) / SIZES.profile_windows
    else:
        passes, scale = work.inputs, 1.0

    def forward(batch) -> tuple[float, float, float]:
        """One pass: (seconds before the first layer, seconds after the last, total)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            if spec.family == "hf_causal_lm":
                ids = batch["input_ids"]
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1]).logits
                F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
            else:
                model(**batch).logits.argmax(-1)
        t1 = time.perf_counter()
        return marks["first"] - t0, t1 - marks["last"], t1 - t0

    try:
        with torch.inference_mode():
            forward({k: v[:1] for k, v in passes[0].items()})  # warm-up
        best = None
        for _ in range(repeats):
            spans.clear()
            before = after = total = 0.0
            for batch in passes:
                b, a, t = forward(batch)
                before, after, total = before + b, after + a, total + t
            if best is None or total < best[0]:
                best = (total, before, after, dict(spans))
    finally:
        for h in handles:
            h.remove()
    total, before, after, got = best
    n = len(layers)
    costs = LayerCosts(embed=before * scale, layers=[got[("layer", i)] * scale for i in range(n)],
                       cores=[got[("core", i)] * scale for i in range(n)],
                       out_proj=[got[("out", i)] * scale for i in range(n)], out_proj_inside=inside,
                       head=after * scale, projection=sum(got[("top", j)] for j in range(len(top))) * scale,
                       total=total * scale, load_s=load_s)
    return costs


def float64_error(spec: Spec, folder: Path, work: Workload, plain: dict) -> tuple[float, float, float]:
    """E: the largest |float32 statistic - float64 statistic| of the baseline (LMs: per-window NLL sums; BERT: the
    per-sentence loss), the float32 values being the plain run's stored ones; with the smallest float64 logit margin
    of a BERT sentence (0 for LMs) and the float64 values' largest magnitude."""
    import torch
    import torch.nn.functional as F
    import transformers

    cls = transformers.AutoModelForCausalLM if spec.family == "hf_causal_lm" else \
        transformers.AutoModelForSequenceClassification
    model = cls.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    baseline = plain[()]
    worst, margin, biggest = 0.0, math.inf, 0.0
    with torch.inference_mode():
        if spec.family == "hf_causal_lm":
            rows = torch.cat([x["input_ids"] for x in work.inputs])
            for w in range(len(rows)):
                ids = rows[w : w + 1]
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
                nll = float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                worst = max(worst, abs(baseline[f"w{w}"][0][0] - nll))
                biggest = max(biggest, abs(nll))
            margin = 0.0
        else:
            losses = [loss for _, (_stats, loss) in sorted(baseline.items(), key=lambda kv: int(kv[0]))]
            with open(folder / "eval.tsv", encoding="utf-8", newline="") as f:
                labels = [int(r["label"]) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
            tok = transformers.AutoTokenizer.from_pretrained(folder)
            with open(folder / "eval.tsv", encoding="utf-8", newline="") as f:
                texts = [r["sentence"] for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
            for i, text in enumerate(texts):
                enc = tok(text, truncation=True, max_length=SIZES.max_length, return_tensors="pt")
                logits = model(**enc).logits[0]
                loss = float(F.cross_entropy(logits.unsqueeze(0), torch.tensor([labels[i]])))
                worst = max(worst, abs(losses[i] - loss)) if losses[i] is not None else worst
                margin = min(margin, float((logits[0] - logits[1]).abs()))
                biggest = max(biggest, abs(loss))
    del model
    return worst, margin, biggest


# -- one shape ------------------------------------------------------------------------------------------------------

def compare(spec: Spec, folder: Path, work: Workload, reuse: dict, plain: dict) -> tuple[bool, str]:
    """reuse == plain for every mask both evaluated: identical, or within tau = 2E (module docstring)."""
    common_masks = sorted(set(reuse) & set(plain))
    missing = sorted(set(plain) ^ set(reuse))
    diffs, loss_diffs, flips, n = 0.0, 0.0, 0, 0
    identical = True
    for mask in common_masks:
        for example, (stats, loss) in plain[mask].items():
            other_stats, other_loss = reuse[mask][example]
            n += 1
            if stats != other_stats or loss != other_loss:
                identical = False
            d = max(abs(a - b) for a, b in zip(stats, other_stats, strict=True))
            if spec.family == "hf_classifier":
                flips += d > 0
            else:
                diffs = max(diffs, d)
            if loss is not None and other_loss is not None:
                loss_diffs = max(loss_diffs, abs(loss - other_loss))
    where = f"{len(common_masks)} masks x {n // max(1, len(common_masks))} examples"
    if missing:
        return False, f"masks evaluated by one run only: {missing[:3]}"
    if identical:
        return True, f"identical ({where}: every statistic and loss bit for bit)"
    error, margin, biggest = float64_error(spec, folder, work, plain)
    tau = 2 * error
    # LMs: the statistic is the window's NLL sum (its loss is that sum over a fixed count); BERT: the loss, and a
    # correct/incorrect flip only where the float64 logit margin is within tau.
    ok = diffs <= tau if spec.family == "hf_causal_lm" else loss_diffs <= tau and (flips == 0 or margin < tau)
    return ok, (f"not identical ({where}): largest statistic difference {diffs:.3g}, loss difference "
                f"{loss_diffs:.3g}, {flips} correct/incorrect flips; float32 error of the baseline E = {error:.3g} "
                f"(values up to {biggest:.3g}), tau = 2E = {tau:.3g}: {'within' if ok else 'ABOVE'}")


def profile(spec: Spec, folder: Path, arch: Arch, work: Workload, rate: float) -> LayerCosts:
    """The shape's per-module profile, printed with the FLOP rates of its parts against the mm rate ``rate``."""
    costs = profile_layers(spec, folder, work, repeats=1 if arch.hidden >= 896 and not common.SMOKE else 2)
    flops_full = arch.mask(work.batches, None)
    log(f"  profile (one thread, this process; seconds per pass over the evaluation set): total {costs.total:.2f} "
        f"= embeddings {costs.embed:.3f} + layers {sum(costs.layers):.2f} (attention cores {sum(costs.cores):.2f}, "
        f"output projections {sum(costs.out_proj):.2f}) + after the layers {costs.head:.3f} (LM head or classifier "
        f"{costs.projection:.3f}, the rest: final norm, loss {costs.head - costs.projection:.3f}); "
        f"{flops_full / costs.total / 1e9:.1f} GFLOP/s = {flops_full / costs.total / rate:.2f} of the mm rate")
    layer_flops = sum(arch.layer(r, n)[i] for r, n, _ in work.batches for i in range(3))
    head_flops = sum(arch.head(r, k) for r, _, k in work.batches)
    attn_flops = sum(arch.layer(r, n)[2] for r, n, _ in work.batches)
    log(f"  per component: a layer {layer_flops / 1e9:.2f} GFLOP in {sum(costs.layers) / arch.layers:.3f} s "
        f"({layer_flops * arch.layers / sum(costs.layers) / rate:.2f} of the mm rate; attention scores "
        f"{attn_flops / 1e9:.2f} GFLOP of it), head {head_flops / 1e9:.2f} GFLOP in {costs.projection:.3f} s "
        f"({head_flops / max(costs.projection, 1e-9) / rate:.2f} of the mm rate); model load {costs.load_s:.1f} s, "
        f"tokenising {work.texts:,} characters {work.tokenise_s:.3f} s")
    return costs


def run_both(spec: Spec, folder: Path, masks: list[list[str]], store_root: Path, watch: WorkerWatch
             ) -> dict[str, Run]:
    """The reuse run (the grid, importance, pruning, efficiency), then the plain run (the grid and the reuse run's
    pruning masks), into the store ``store_root/<shape>``."""
    store = str(store_root / spec.name)
    runs = {}
    for path, reuse in (("reuse", True), ("plain", False)):
        grid_masks = masks if reuse else masks + [m for m in pruning_masks(runs["reuse"]) if m not in masks]
        cfg = write_config(spec, folder, grid_masks, reuse, store_root / f"{spec.name}-{path}.yaml")
        log(f"{spec.name} {path}: headsweep.run with {len(grid_masks)} custom masks"
            + (", importance, prune_level [0.25, 0.5], efficiency (level 0.5)" if reuse else ""))
        watch.sample()
        runs[path] = run_sweep(cfg, store)
        watch.sample()
        log(f"{spec.name} {path}: run {runs[path].run_id} in {runs[path].wall:.1f} s")
    return runs


def check_shape(spec: Spec, rates: list[float], store_root: Path, watch: WorkerWatch) -> None:
    """Build, profile, run both sweeps, compare, and print the shape's figures and RESULT line."""
    folder = build(spec)
    arch = Arch.of(spec.shape.config())
    masks = grid(spec, arch.layers, arch.heads)
    work = workload(spec, folder)
    log(f"{spec.name}: {arch.layers} layers x {arch.heads} heads ({arch.kv_heads} key/value) of {arch.head_dim}, "
        f"hidden {arch.hidden}, feed-forward {arch.inner}, vocabulary {arch.vocab:,}; batches (rows, length) "
        f"{[(r, n) for r, n, _ in work.batches]}; grid of {len(masks)} masks")
    costs = profile(spec, folder, arch, work, max(rates))
    flops_full = arch.mask(work.batches, None)
    runs = run_both(spec, folder, masks, store_root, watch)
    store = str(store_root / spec.name)

    reuse_run, plain_run = runs["reuse"], runs["plain"]
    rates.append(mm_rate())
    rate = max(rates)
    log(f"{spec.name}: mm rate {rates[-1] / 1e9:.1f} GFLOP/s after the sweeps; R = the best so far, {rate / 1e9:.1f}")
    evaluated = [m for m in plain_run.evaluations if m["experiment"] == "custom"]
    n_masks, cores = len(evaluated), 2
    plain_grid = duration(window(plain_run, "custom"))
    reuse_custom, reuse_prune = duration(window(reuse_run, "custom")), duration(window(reuse_run, "prune_level"))
    reuse_grid = reuse_custom + reuse_prune
    all_masks = [sorted(m["heads_masked"]) for m in evaluated]
    plain_flops = flops_full * n_masks
    reuse_flops = sum(arch.mask(work.batches, first_layer(m)) for m in all_masks)
    bound_share = sum(costs.from_layer(first_layer(m)) for m in all_masks) / (costs.full() * n_masks)
    bound = plain_grid * bound_share
    plain_mfu = plain_flops / plain_grid / (rate * cores)
    reuse_mfu = reuse_flops / reuse_grid / (rate * cores)
    busy = {p: sum(e["seconds"] for e in r.evaluations if e["experiment"] in ("custom", "prune_level"))
            for p, r in (("plain", plain_run), ("reuse", reuse_run))}
    cpu = {"plain": worker_cpu(watch, plain_run, ("custom",)),
           "reuse": worker_cpu(watch, reuse_run, ("custom", "prune_level"))}
    log(f"{spec.name}: {n_masks} masks; plain grid {plain_grid:.1f} s ({plain_grid / n_masks:.2f} s/mask, "
        f"{plain_flops / 1e12:.2f} TFLOP, {plain_flops / plain_grid / 1e9:.1f} GFLOP/s); reuse grid {reuse_grid:.1f} s "
        f"(custom {reuse_custom:.1f} + prune_level {reuse_prune:.1f}; {reuse_grid / n_masks:.2f} s/mask, "
        f"{reuse_flops / 1e12:.2f} TFLOP, {reuse_flops / reuse_grid / 1e9:.1f} GFLOP/s)")
    for path, wall, flops in (("plain", plain_grid, plain_flops), ("reuse", reuse_grid, reuse_flops)):
        log(f"  {path}: the workers computed {busy[path]:.1f} s (sum of evaluations.seconds) and got {cpu[path]:.1f} "
            f"CPU seconds of the grid's 2 x {wall:.1f} s ({cpu[path] / (cores * wall):.0%}; the rest went to other "
            f"processes or waiting); FLOPs per CPU second they got: {flops / max(cpu[path], 1e-9) / rate:.2f} of the "
            f"mm rate")
    log(f"{spec.name}: reuse bound = plain grid x {bound_share:.3f} (measured share of the plain work reuse needs) "
        f"= {bound:.1f} s; reuse/plain {plain_grid / reuse_grid:.2f}x, the bound allows {1 / bound_share:.2f}x; in "
        f"the CPU seconds the workers got: bound {cpu['plain'] * bound_share:.1f} s, reuse {cpu['reuse']:.1f} s "
        f"({cpu['plain'] * bound_share / max(cpu['reuse'], 1e-9):.3f} of the bound)")
    phases(spec.name, "reuse", reuse_run)
    phases(spec.name, "plain", plain_run)

    peaks = worker_peaks(watch, (reuse_run, plain_run))
    model_bytes = model_size(folder)
    log(f"{spec.name}: peak RSS per worker (VmHWM) {', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in peaks.items())}; "
        f"the model's weights {model_bytes / 2**20:.0f} MiB, budgets: activations 1024 MiB, reuse states <= 4096 MiB")

    equal, note = compare(spec, folder, work, examples_by_mask(store, reuse_run.run_id),
                          examples_by_mask(store, plain_run.run_id))
    log(f"{spec.name}: reuse == plain: {note}")
    common.result("real_size", shape=spec.name, plain_mfu=f"{plain_mfu:.3f}", reuse_mfu=f"{reuse_mfu:.3f}",
                  reuse_over_bound=f"{bound / reuse_grid:.3f}",
                  peak_rss_mib=f"{max(peaks.values(), default=0) / 2**20:.0f}", equal=str(equal).lower())


def duration(span: tuple[float, float]) -> float:
    return span[1] - span[0]


def window(run: Run, experiment: str) -> tuple[float, float]:
    """When ``experiment``'s evaluations ran: from the first call's start (:meth:`Run.span`), but not before the
    driver could send them (its workers ready; for ``prune_level``, importance done), to the last landing."""
    start, end = run.span(experiment)
    earliest = ready(run) if experiment == "custom" else run.stamp(r"^gradient importance: done")
    return max(start, earliest or start), end


def worker_cpu(watch: WorkerWatch, run: Run, experiments: tuple[str, ...]) -> float:
    """CPU seconds the run's workers used while ``experiments``' evaluations ran."""
    pids = {int(e["worker"].rsplit(":", 1)[1]) for e in run.evaluations}
    return sum(watch.cpu_seconds(pid, *window(run, x)) for x in experiments for pid in pids)


def ready(run: Run) -> float:
    """When the driver said its workers were ready (model and data loaded, baseline evaluated)."""
    stamp = run.stamp(r"\d+ workers ready")
    if stamp is None:
        raise SystemExit("real_size: error: the run printed no 'workers ready' line; the phase timings need it")
    return stamp


def pruning_masks(run: Run) -> list[list[str]]:
    """The masks of the reuse run's pruning levels."""
    return [sorted(e["heads_masked"]) for e in run.evaluations if e["experiment"] == "prune_level"]


def phases(name: str, path: str, run: Run) -> None:
    """Where a run's wall time went, from its stamped stderr lines and its evaluations' times."""
    custom, prune = run.span("custom"), run.span("prune_level")
    custom = (max(custom[0], ready(run)), custom[1])
    if prune is not None:
        prune = (max(prune[0], run.stamp(r"^gradient importance: done") or prune[0]), prune[1])
    marks = [("Ray, workers started, model and data loaded, baseline", run.start),
             ("checks against the model, run row, planning", ready(run)),
             ("grid (custom masks)", custom[0]), ("flush, significance, planning", custom[1]),
             ("gradient importance", run.stamp(r"^gradient importance \.\.\.")),
             ("planning", run.stamp(r"^gradient importance: done")),
             ("prune_level masks", prune and prune[0]), ("flush, significance, planning", prune and prune[1]),
             ("efficiency timing", run.stamp(r"^efficiency timing \.\.\.")),
             ("finishing: significance, writes, workers stopped",
              run.stamp(r"^efficiency timing: done") or (prune or custom)[1])]
    marks = [(label, t) for label, t in marks if t is not None]
    marks.sort(key=lambda m: m[1])
    end = run.start + run.wall
    parts = [f"{label} {(marks[i + 1][1] if i + 1 < len(marks) else end) - t:.1f}"
             for i, (label, t) in enumerate(marks)]
    load = run.facts.get("load_seconds")
    log(f"{name} {path}: phases (s) of {run.wall:.1f}: " + "; ".join(parts)
        + (f" (a worker's load, baseline included: {load:.1f} s)" if load is not None else ""))


def worker_peaks(watch: WorkerWatch, runs: tuple[Run, ...]) -> dict[str, int]:
    """Each worker's peak RSS, by the pids the runs' evaluations name (``worker-N@host:pid``)."""
    out = {}
    for run in runs:
        for worker in sorted({e["worker"] for e in run.evaluations}):
            pid = int(worker.rsplit(":", 1)[1])
            out[worker.split("@")[0] + f"({'reuse' if run is runs[0] else 'plain'})"] = watch.peak.get(pid, 0)
    return out


def model_size(folder: Path) -> int:
    """Bytes of the saved weights (float32: parameters x 4)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    """Measure every shape (or ``--shape``), each printing its RESULT line as soon as it is measured."""
    parser = common.command_line(__doc__)
    parser.add_argument("--shape", choices=sorted(SPECS), help="one shape (default: all four)")
    parser.add_argument("--store", help="keep the results store here (default: a temporary folder)")
    args = parser.parse_args()
    common.enable_smoke(args)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the configs' token ids beyond a tiny vocabulary, and the like
    hf_logging.disable_progress_bar()  # save_pretrained's and from_pretrained's bars
    torch.set_num_threads(1)
    load = os.getloadavg()
    rates = [mm_rate()]
    log(f"real_size: torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; float32 torch.mm {SIZES.mm_n} x {SIZES.mm_n} on 1 thread (fastest product of "
        f"{SIZES.mm_seconds:g} s): {rates[0] / 1e9:.1f} "
        f"GFLOP/s (x 2 workers = {2 * rates[0] / 1e9:.1f})")
    names = [args.shape] if args.shape else list(SMOKE_SHAPES if common.SMOKE else SPECS)
    watch = WorkerWatch()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real_size-") as tmp:
        root = Path(args.store) if args.store else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in names:
            shape_start = time.perf_counter()
            rates.append(mm_rate())
            log(f"{name}: mm rate {rates[-1] / 1e9:.1f} GFLOP/s now; the best so far, {max(rates) / 1e9:.1f}, is R; "
                f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            check_shape(SPECS[name], rates, root, watch)
            log(f"{name}: {time.perf_counter() - shape_start:.0f} s in all")
    watch.stop()
    load = os.getloadavg()
    log(f"real_size: {time.perf_counter() - start:.0f} s; mm rate now {mm_rate() / 1e9:.1f} GFLOP/s; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {datetime.now().isoformat(timespec='seconds')}")


if __name__ == "__main__":
    main()
