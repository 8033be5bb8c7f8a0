"""Benchmark: headsweep against the tools a researcher would pick instead, TransformerLens 4.3 and nnsight 0.8, run
with their own code in one process per model shape.

Peers are not dependencies of headsweep or its tests: ``make bench-peers`` puts them in ``.venv-peers`` (a venv that
sees this project's packages, pinned by ``constraints.txt``; bench/README.md), and this script re-runs itself with
that venv's python when it exists and the current one lacks them. A peer that does not import, or fails (an API
change), is reported in one line (``peers: <route> not run: <why>``) and headsweep's figures still print.

The shape (``--shape``): the published configuration with seeded weights (no download), a word-level tokenizer and
a random-word text (``bench/gpu_check.py``'s builder): ``smollm2-135m`` (Llama, 30 layers x 9 query / 3 key-value
heads, vocabulary 49,152), ``gpt2`` (GPT-2 small), ``qwen2.5-0.5b``, ``llama-3.2-1b``. Windows of 128 tokens (BOS
first, as headsweep cuts them); every route reads the same windows (the worker adapter's ``inputs`` and ``scored``),
``--batch-size`` windows per forward pass, ``--threads`` torch threads (default 1).

Two grids, each single heads plus the baseline (``--grids``):

* ``one_minute``: 4 windows, every head of the first and the last layer;
* ``five_minute``: 16 windows, every head of the first, the middle and the last layer.

The routes, per grid, over the same model, windows and masks:

* **transformerlens**: ``TransformerBridge.boot_transformers(folder, hf_model=model)``, one ``run_with_hooks`` per
  mask whose hook zeroes ``blocks.L.attn.hook_z[:, :, h]`` (the loop TransformerLens's documentation shows; the
  bridge forces eager attention);
* **nnsight_loop**: ``LanguageModel(model)``, one ``trace`` per mask zeroing head h's slice of the output
  projection's input (``o_proj``; GPT-2's ``c_proj``);
* **nnsight_batched**: the same edit, ``--invokes`` masks per trace, one ``invoke`` each (nnsight's own batching);
* **plain**: headsweep's worker path in this process with ``sweep.reuse: false, masks_per_batch: 1``;
* **default**: the same with headsweep's defaults (``reuse: true``: each mask from its first gated layer on cached
  baseline states; ``masks_per_batch: 0``: masks packed per pass);
* **packed** (only with ``--packed N``): the default with ``masks_per_batch: N`` set by hand, to compare with what
  the default picks (on a CPU one mask a pass at these vocabularies with one thread, up to 1,024 tokens a thread
  with several: ``--packed 1`` times the one-thread choice beside it);
* **run**: ``python -m headsweep run`` as a subprocess (one worker of ``--threads`` threads, an embedded Ray),
  Ray's start-up, the worker's imports, model load, baseline, significance and Parquet writes included.

``--routes`` runs a subset of the in-process routes (``default`` always), where a shape's grid takes long:
``--routes default,nnsight_batched --skip-run`` measures the in-process goal against the fastest peer route alone.

Each in-process route is timed from the loaded model to its last perplexity (baseline included; a peer's wrapper
built inside the time). The peers' end-to-end time adds their model load from disk (a user's script after its
imports); ``run`` is timed from the subprocess's start to its exit.

Figures:

* ``bound``: what reuse and packing can save on the largest grid run: FLOPs of the plain grid / FLOPs of reuse's
  (``bench/flops.py``'s count, as bench/real_size.py counts: a mask from layer l computes that layer's output
  projection and feed-forward, the layers above and the LM head, which no mask can skip); packing saves no FLOPs.
  The goal in process is ``vs_<peer> >= 0.95 bound`` against the fastest peer route.
* ``vs_transformerlens``, ``vs_nnsight_loop``, ``vs_nnsight_batched``: that peer's seconds / ``default``'s on the
  largest grid run (> 1: headsweep is faster).
* ``end_to_end_vs_fastest``: the fastest peer's end-to-end seconds / ``run``'s on the five-minute grid;
  ``one_minute_vs_fastest`` the same on the one-minute grid (``n/a`` for a grid not run).
* ``end_to_end_vs_script``, ``one_minute_vs_script``: the same with the peer run as a user's script from its own
  interpreter's start: its imports (``import torch, transformers, <peer>`` timed in a fresh interpreter) added to its
  model load and grid, as ``run`` counts its own (``n/a`` without the peers or ``run``).
* ``packed_vs_fastest``: the fastest peer's seconds / ``packed``'s on the largest grid run (``n/a`` without
  ``--packed``).
* ``startup_s``: ``run``'s seconds before its first mask could start (the driver's ``workers ready`` line on the
  one-minute grid, else the other); the phases before it are printed (Ray, worker start and imports, model load,
  baseline) from the run's time-stamped stderr lines.
* ``equal``: every route's perplexities within the float32 summation-order bound of ``tests/tolerances.py``
  (``route_bound`` on the log perplexities, depth = layers, width = the longest inner product) of ``plain``'s
  (``default``'s where ``--routes`` leaves ``plain`` out); the largest difference of each route is printed.

``RESULT peers shape=<..> bound=<x> vs_transformerlens=<x> vs_nnsight_loop=<x> vs_nnsight_batched=<x>
end_to_end_vs_fastest=<x> one_minute_vs_fastest=<x> startup_s=<x> ... end_to_end_vs_script=<x> one_minute_vs_script=<x>
packed_vs_fastest=<x> equal=<true|false>``;
``n/a`` where a route did not run.

Usage: python -m bench.peers [--shape NAME] [--grids one_minute,five_minute] [--threads 1] [--packed N]
[--routes R,...] [--skip-run] [--skip-warm] [--smoke]
``--smoke``: the SmolLM2 shape shrunk (4 layers, heads of 8, vocabulary 2,048), 2 windows of 32 tokens, two heads of
each grid layer; seconds, figures meaningless (tests/project/test_bench_smoke.py; peers run where they import).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import common
from bench.common import log
from bench.gpu_check import LLAMA32_1B, QWEN25_05B, Shape, build_folder
from bench.gpu_check import tiny as tiny_lm

SMOLLM2_135M = Shape("smollm2-135m", "LlamaConfig", dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, initializer_range=0.041666666666666664, bos_token_id=0, eos_token_id=0),
    134_515_008)


def gpt2_small() -> Shape:
    from bench.real_size import GPT2_SMALL

    return GPT2_SMALL


SHAPES: dict[str, Callable[[], Shape]] = {"smollm2-135m": lambda: SMOLLM2_135M, "gpt2": gpt2_small,
                                          "qwen2.5-0.5b": lambda: QWEN25_05B, "llama-3.2-1b": lambda: LLAMA32_1B}
PEERS = ("transformerlens", "nnsight_loop", "nnsight_batched")
#: The package each peer route imports.
PEER_MODULE = {"transformerlens": "transformer_lens", "nnsight_loop": "nnsight", "nnsight_batched": "nnsight"}
#: The in-process routes ``--routes`` chooses from (``packed`` comes with ``--packed``, ``run`` without ``--skip-run``).
ROUTES = ("plain", "default", *PEERS)
VENV = common.ROOT / ".venv-peers"


@dataclass(frozen=True)
class Grid:
    """A grid: its windows and the layers whose every head (or ``heads`` of them) is masked alone."""

    name: str
    windows: int
    layers: str  # "ends": first and last; "thirds": first, middle, last
    heads: int | None = None  # heads per layer (None: all)


@dataclass(frozen=True)
class Sizes:
    window: int = 128
    grids: tuple[Grid, ...] = (Grid("one_minute", 4, "ends"), Grid("five_minute", 16, "thirds"))


SIZES = Sizes()


@common.on_smoke
def use_smoke() -> None:
    """2 windows of 32 tokens, two heads of each grid layer, the shape shrunk (module docstring)."""
    global SIZES
    SIZES = Sizes(window=32, grids=(Grid("one_minute", 2, "ends", 2), Grid("five_minute", 3, "thirds", 2)))


def shape_of(name: str) -> Shape:
    """The shape ``name``, shrunk in smoke mode."""
    shape = SHAPES[name]()
    if not common.SMOKE:
        return shape
    if shape.config_class == "GPT2Config":
        from bench.real_size import tiny_shape

        return tiny_shape(shape)
    return replace(tiny_lm(shape), name=shape.name)


def cache_root() -> Path:
    """Where the built shapes live (the smoke cache in smoke mode)."""
    return (common.smoke_cache() if common.SMOKE else common.CACHE) / "peers"


def build(shape: Shape) -> Path:
    """The shape's folder (weights, ``tokenizer/``, ``text.txt`` of enough windows), built once and cached."""
    import hashlib
    import shutil

    import torch

    key = hashlib.sha256(json.dumps([shape.config_class, shape.values], sort_keys=True).encode()).hexdigest()[:10]
    folder = cache_root() / f"{shape.name}-{key}"
    if (folder / "built.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.name}-", dir=folder.parent))
    start = time.perf_counter()
    try:
        windows = max(g.windows for g in SIZES.grids)
        build_folder(shape, tmp, "cpu", torch.float32, windows * SIZES.window + 64, seed=0)
        (tmp / "built.json").write_text(json.dumps({"seconds": round(time.perf_counter() - start, 1)}) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{shape.name}: built in {time.perf_counter() - start:.1f} s: {folder}")
    return folder


def grid_masks(grid: Grid, layers: int, heads: int) -> list[tuple[int, int]]:
    """The grid's single heads as (layer, head)."""
    picked = [0, layers - 1] if grid.layers == "ends" else [0, layers // 2, layers - 1]
    per = range(heads) if grid.heads is None else sorted({0, heads - 1} if grid.heads == 2 else range(grid.heads))
    return [(layer, h) for layer in sorted(set(picked)) for h in per]


# -- the workload every route shares ---------------------------------------------------------------------------

@dataclass
class Workload:
    """One grid on one shape: the windows (as headsweep cuts them), the masks, and each route's outcome."""

    grid: Grid
    folder: Path
    masks: list[tuple[int, int]]
    inputs: object  # (windows, window) token ids, BOS first
    scored: object  # (windows, window - 1) bool: position j + 1 scored
    batch_size: int
    threads: int
    seconds: dict[str, float] = field(default_factory=dict)
    load_s: dict[str, float] = field(default_factory=dict)
    ppl: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def perplexity(logits, ids, keep) -> tuple[float, float]:
    """(NLL sum, scored tokens) of ``ids`` from ``logits``, as headsweep scores windows."""
    import torch.nn.functional as F

    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none").view(ids.shape[0], -1)
    return float((nll.double() * keep).sum()), float(keep.sum())


def load_model(work: Workload, attn: str = "sdpa"):
    """The model as a user loads it with transformers, and the seconds it took."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work.folder, dtype="float32", attn_implementation=attn).eval()
    return model, time.perf_counter() - start


def tokenizer(work: Workload):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(work.folder / "tokenizer")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def batches(work: Workload):
    for start in range(0, len(work.inputs), work.batch_size):
        yield work.inputs[start : start + work.batch_size], work.scored[start : start + work.batch_size]


def transformerlens_route(work: Workload, model) -> list[float]:
    """TransformerLens 4: the bridge over the loaded model, one ``run_with_hooks`` per mask zeroing ``hook_z``."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge  # pyright: ignore[reportMissingImports]

    bridge = TransformerBridge.boot_transformers(str(work.folder), device="cpu", dtype=torch.float32, hf_model=model,
                                                 tokenizer=tokenizer(work))
    out = []
    for mask in [None, *work.masks]:
        hooks = []
        if mask is not None:
            layer, head = mask

            def zero(z, hook, h=head):  # z: (batch, position, head, d_head)
                z[:, :, h, :] = 0.0
                return z
            hooks = [(f"blocks.{layer}.attn.hook_z", zero)]
        total, tokens = 0.0, 0.0
        with torch.inference_mode():
            for ids, keep in batches(work):
                logits = bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type="logits")
                s, n = perplexity(logits, ids, keep)
                total, tokens = total + s, tokens + n
        out.append(math.exp(total / tokens))
    return out


def output_projection(lm, model_type: str, layer: int):
    """nnsight's envoy of layer ``layer``'s output projection (its input is the heads' concatenated contexts)."""
    if model_type == "gpt2":
        return lm.transformer.h[layer].attn.c_proj
    return lm.model.layers[layer].self_attn.o_proj


def nnsight_route(work: Workload, model, invokes: int) -> list[float]:
    """nnsight 0.8: ``LanguageModel`` over the loaded model; each mask zeroes head h's slice of the output
    projection's input, one trace per mask (``invokes`` 1) or ``invokes`` masks per trace, one ``invoke`` each."""
    import torch
    from nnsight import LanguageModel  # pyright: ignore[reportMissingImports]

    lm = LanguageModel(model, tokenizer=tokenizer(work))
    d = head_dim(model.config)
    masks = [None, *work.masks]
    sums = [[0.0, 0.0] for _ in masks]
    with torch.inference_mode():
        for ids, keep in batches(work):
            for start in range(0, len(masks), invokes):
                group = masks[start : start + invokes]
                saved = []
                with lm.trace() as tracer:
                    for mask in group:
                        with tracer.invoke(ids):
                            if mask is not None:
                                layer, h = mask
                                site = output_projection(lm, model.config.model_type, layer)
                                site.input[..., h * d : (h + 1) * d] = 0
                            saved.append(lm.output.logits.save())
                for i, logits in enumerate(saved):
                    s, n = perplexity(logits, ids, keep)
                    sums[start + i][0] += s
                    sums[start + i][1] += n
    return [math.exp(s / n) for s, n in sums]


def headsweep_route(work: Workload, reuse: bool, masks_per_batch: int | None = None) -> tuple[list[float], float, str]:
    """headsweep's worker path in this process: (perplexities, load seconds, the adapter's reuse note);
    ``masks_per_batch`` None: the route's own (0 with reuse, 1 without)."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    start = time.perf_counter()
    model = CausalLMModel(path=str(work.folder), tokenizer=str(work.folder / "tokenizer"),
                          attn_implementation="sdpa", dtype="float32")
    data = CausalLMData(path=str(work.folder / "text.txt"), window=SIZES.window, max_windows=work.grid.windows)
    packing = (0 if reuse else 1) if masks_per_batch is None else masks_per_batch
    runtime = RuntimeOptions(device="cpu", batch_size=work.batch_size, masks_per_batch=packing,
                             reuse=reuse, threads=work.threads)
    adapter = load_causal_lm_adapter(model, data, runtime)
    load_s = time.perf_counter() - start
    masks = [[Head("self", layer, h)] for layer, h in work.masks]
    return [adapter.baseline().score] + [o.score for o in adapter.evaluate(masks)], load_s, adapter.reuse_note


def workload(grid: Grid, folder: Path, args) -> Workload:
    """The grid's windows as headsweep's adapter cuts them (loaded once, without reuse, to read them)."""
    from transformers import AutoConfig

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    config = AutoConfig.from_pretrained(folder)
    adapter = load_causal_lm_adapter(
        CausalLMModel(path=str(folder), tokenizer=str(folder / "tokenizer"), attn_implementation="sdpa"),
        CausalLMData(path=str(folder / "text.txt"), window=SIZES.window, max_windows=grid.windows),
        RuntimeOptions(device="cpu", batch_size=args.batch_size, masks_per_batch=1, reuse=False, threads=args.threads))
    masks = grid_masks(grid, config.num_hidden_layers, config.num_attention_heads)
    work = Workload(grid, folder, masks, adapter.inputs, adapter.scored.double(), args.batch_size, args.threads)
    del adapter
    return work


def timed(work: Workload, name: str, fn: Callable[[], list[float]]) -> None:
    """Run one route; its seconds and perplexities, or one line saying why it did not run."""
    import gc

    gc.collect()
    start = time.perf_counter()
    try:
        work.ppl[name] = fn()
    except Exception as exc:  # noqa: BLE001  a peer's API change must not lose headsweep's figures
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        work.failed[name] = f"{type(exc).__name__}: {first}"
        log(f"peers: {name} not run: it failed with {work.failed[name]}")
        return
    work.seconds[name] = time.perf_counter() - start
    n = len(work.ppl[name])
    log(f"  {work.grid.name} {name:<16} {work.seconds[name]:7.1f} s ({work.seconds[name] / n:.2f} s a mask, "
        f"{n} masks with the baseline; load {work.load_s.get(name, 0.0):.1f} s)")


def peer_available(name: str) -> str | None:
    """None when the peer of route ``name`` imports, else why not (one line)."""
    module = PEER_MODULE[name]
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001  ImportError, or a peer broken against these versions
        return f"{module} does not import ({type(exc).__name__}: {exc}); make bench-peers installs it"
    return None


def run_peers(work: Workload, args) -> None:
    for name in (n for n in PEERS if n in args.routes):
        why = peer_available(name)
        if why is not None:
            work.failed[name] = why
            log(f"peers: {name} not run: {why}")
            continue
        # A fresh model for each peer: the TransformerLens bridge switches the model it wraps to eager attention.
        model, work.load_s[name] = load_model(work)
        invokes = 1 if name == "nnsight_loop" else args.invokes
        if name == "transformerlens":
            timed(work, name, lambda m=model: transformerlens_route(work, m))
        else:
            timed(work, name, lambda m=model, k=invokes: nnsight_route(work, m, k))
        del model


def run_headsweep(work: Workload, packed: int, chosen: Sequence[str] = ROUTES) -> None:
    routes = [("plain", False, None), ("default", True, None)] + ([("packed", True, packed)] if packed else [])
    for name, reuse, masks_per_batch in (r for r in routes if r[0] in chosen or r[0] == "packed"):
        start = time.perf_counter()
        try:
            ppl, load_s, note = headsweep_route(work, reuse, masks_per_batch)
        except Exception as exc:
            raise SystemExit(f"peers: error: headsweep's {name} route failed: {type(exc).__name__}: {exc}") from exc
        work.load_s[name] = load_s
        work.seconds[name] = time.perf_counter() - start - load_s
        work.ppl[name] = ppl
        log(f"  {work.grid.name} {name:<16} {work.seconds[name]:7.1f} s ({work.seconds[name] / len(ppl):.2f} s a "
            f"mask; load {load_s:.1f} s; reuse: {note.split(':')[0]})")


# -- headsweep run, end to end -----------------------------------------------------------------------------------

STARTUP_MARKS = (("Ray started", r"Ray|ray"), ("workers ready", r"\d+ workers ready"))


def run_end_to_end(work: Workload, root: Path, model: dict | None = None, data: dict | None = None,
                   route: str = "run", cluster: list[str] = ()) -> dict | None:
    """``python -m headsweep run`` on the grid (the causal LM's ``model`` and ``data`` sections unless given); its wall
    time (as ``work.seconds[route]``) and the stamps of its phases, or None (a line says why) when it fails.
    ``cluster``: ``--address ADDR --keep-workers S`` for a run on a running cluster (``run_warm``)."""
    model = model or {"kind": "hf_causal_lm", "path": str(work.folder), "tokenizer": str(work.folder / "tokenizer"),
                      "attn_implementation": "sdpa", "dtype": "float32"}
    data = data or {"path": str(work.folder / "text.txt"), "window": SIZES.window, "max_windows": work.grid.windows}
    cfg = {"name": f"peers-{work.grid.name}", "seed": 0, "model": model, "data": data,
           "sweep": {"experiments": ["baseline", "custom"], "workers": 1, "threads_per_worker": work.threads,
                     "batch_size": work.batch_size, "masks": [[f"self:{lay}:{h}"] for lay, h in work.masks]}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{work.grid.name}.yaml"
    path.write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    env = {**os.environ, "HEADSWEEP_PLAIN_PROGRESS": "1", "PYTHONPATH": str(common.ROOT)}
    phases_file = root / f"{work.grid.name}-{route}-phases.json"
    start = time.time()
    # bench.run_phases: `python -m headsweep run` with a stopwatch on the driver's phases
    proc = subprocess.Popen([sys.executable, "-m", "bench.run_phases", str(phases_file), "run", str(path), "--store",
                             str(root / f"store-{route}"), *cluster],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append((time.time() - start, line.rstrip("\n")))
    out = proc.stdout.read() if proc.stdout else ""
    code = proc.wait()
    wall = time.time() - start
    if code != 0:
        log(f"peers: run not measured: headsweep run exited {code}: "
            + (lines[-1][1] if lines else out.strip()[-300:]))
        return None
    stamps = {"wall": wall}
    for t, line in lines:
        if "ready" not in stamps and re.match(r"\d+ workers ready:", line):
            stamps["ready"] = t
        if re.match(r"evaluations: \d+/\d+ \(100%\)", line):
            stamps["evaluated"] = t
    stamps.update(run_facts(root / f"store-{route}", out.strip().splitlines()[-1] if out.strip() else ""))
    stamps["phases"] = driver_phases(phases_file, start)
    log(f"  {work.grid.name} {route:<16} {wall:7.1f} s end to end; stderr lines with the seconds since start:")
    for t, line in lines[:40]:
        log(f"    {t:6.1f}  {line}")
    work.seconds[route] = wall
    return stamps


def run_warm(work: Workload, root: Path) -> dict | None:
    """``headsweep run`` on a running Ray cluster whose worker a first, small run left warm (``--keep-workers``):
    the start-up a researcher's second and later runs pay. The cluster is a local instance started here (one more
    CPU than the worker asks); the first run (the baseline on one window) starts the worker and is not timed."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as headsweep's embedded instance: no token file written
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cluster = ["--address", ray.get_runtime_context().gcs_address, "--keep-workers", "600"]
        small = replace(work, grid=replace(work.grid, name=f"{work.grid.name}-warmup", windows=1),
                        masks=work.masks[:1], seconds={})
        if run_end_to_end(small, root, route="warmup", cluster=cluster) is None:
            return None
        return run_end_to_end(work, root, route="run_warm", cluster=cluster)
    finally:
        ray.shutdown()


def run_facts(store: Path, run_id: str) -> dict[str, float]:
    """The worker's load seconds (model, data and the baseline, as ``EvalWorker.load`` times them) from the run's
    facts; empty when the store cannot be read."""
    try:
        import headsweep

        with headsweep.open_store(str(store)) as s:
            facts = json.loads(s.sql("SELECT facts FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0])
        return {"load": float(facts["load_seconds"])}
    except Exception as exc:  # noqa: BLE001  the phases are a report, the wall time is the figure
        log(f"peers: the run's facts not read ({type(exc).__name__}: {exc})")
        return {}


def driver_phases(path: Path, started: float) -> list[tuple[str, float, float]]:
    """The driver's phases that ``bench.run_phases`` wrote: (name, start, seconds), starts in seconds since the
    subprocess was started (``started``); the first, ``interpreter``, is the Python start before its code ran."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log(f"peers: the run's phases not read ({type(exc).__name__}: {exc})")
        return []
    return [("interpreter", 0.0, data["t0"] - started)] + [(n, s - started, d) for n, s, d in data["phases"]]


def startup_phases(stamps: dict, name: str) -> None:
    """Where ``headsweep run``'s time went, from its stamps (seconds since the subprocess started) and the driver's
    phases: one line each, then the summary."""
    if "ready" not in stamps:
        return
    phases = stamps.get("phases") or []
    for phase, begun, seconds in phases:
        log(f"  {name} run phase {phase:<30} at {begun:6.2f} s: {seconds:6.2f} s")
    if phases:
        end = max(b + d for _, b, d in phases)
        log(f"  {name} run phase {'exit':<30} at {end:6.2f} s: {stamps['wall'] - end:6.2f} s")
    ready, load = stamps["ready"], stamps.get("load", 0.0)
    evaluated = stamps.get("evaluated", ready)
    log(f"  {name} run phases (s): before the worker's load (interpreter, driver imports, config checks, Ray's "
        f"start, the worker process and its imports) {ready - load:.1f}; the worker's load (model, data, baseline) "
        f"{load:.1f}; the grid {evaluated - ready:.1f}; after it (significance, Parquet writes, Ray's shutdown) "
        f"{stamps['wall'] - evaluated:.1f}; wall {stamps['wall']:.1f}")


def fresh_interpreter_seconds(line: str) -> float | None:
    """Seconds of a fresh interpreter running ``line`` (its own start and exit included); None where it failed
    (a line says why)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", line], capture_output=True, text=True, cwd=common.ROOT,
                          env={**os.environ, "PYTHONPATH": str(common.ROOT)}, check=False)
    if proc.returncode != 0:
        log(f"peers: {line!r} not timed: " + (proc.stderr.strip().splitlines() or ["no output"])[-1])
        return None
    return time.perf_counter() - start


def peer_import_seconds(work: Workload) -> dict[str, float]:
    """Seconds of a fresh interpreter's ``import torch, transformers, <peer>`` (its own start included) for each peer
    route that ran: what a user's script of that route pays before it loads the model, as ``run`` pays its own."""
    modules = {name: PEER_MODULE[name] for name in PEERS if name in work.seconds}
    seconds = {module: fresh_interpreter_seconds(f"import torch, transformers, {module}")
               for module in dict.fromkeys(modules.values())}
    out = {name: t for name, module in modules.items() if (t := seconds[module]) is not None}
    if out:
        log("  the peers' imports in a fresh interpreter (its start included): "
            + ", ".join(f"{module} {t:.1f} s" for module, t in seconds.items() if t is not None))
    return out


def import_and_ray_seconds() -> dict[str, float]:
    """Seconds of a fresh interpreter's ``import torch, transformers`` plus headsweep's worker modules, and of a bare
    ``ray.init`` (one CPU, no dashboard) and its shutdown: the parts of start-up no model shrinks."""
    code = {"worker imports": "import torch, transformers, headsweep.workers.families.hf_causal_lm.tasks.perplexity",
            "ray.init": "import ray; ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)"}
    out = {what: t for what, line in code.items() if (t := fresh_interpreter_seconds(line)) is not None}
    log("  start-up parts measured alone (a fresh interpreter each, its own start included): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in out.items()))
    return out


# -- the comparison ----------------------------------------------------------------------------------------------

def bound(work: Workload) -> float:
    """FLOPs of the plain grid over reuse's (module docstring)."""
    from transformers import AutoConfig

    from bench.flops import Arch

    arch = Arch.of(AutoConfig.from_pretrained(work.folder))
    rows = [(len(work.inputs[i : i + work.batch_size]), SIZES.window, SIZES.window)
            for i in range(0, len(work.inputs), work.batch_size)]
    full = arch.mask(rows, None)
    plain = full * (1 + len(work.masks))
    reuse = full + sum(arch.mask(rows, layer) for layer, _ in work.masks)
    return plain / reuse


def equality(work: Workload) -> bool:
    """Every route's log perplexities within ``tests/tolerances.py``'s float32 bound of ``plain``'s (``default``'s
    where ``plain`` did not run)."""
    import numpy as np
    from transformers import AutoConfig

    from tests.tolerances import max_difference, route_bound

    config = AutoConfig.from_pretrained(work.folder)
    width = max(config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                SIZES.window)
    reference_name = "plain" if "plain" in work.ppl else "default"
    reference = np.log(work.ppl[reference_name])
    tol = route_bound(reference, depth=config.num_hidden_layers, width=width)
    ok = True
    parts = []
    for name, values in work.ppl.items():
        if name == reference_name:
            continue
        diff = max_difference(np.log(values), reference)
        ok &= diff <= tol
        parts.append(f"{name} {diff:.2g}")
    effect = float(np.abs(reference[1:] - reference[0]).max()) if len(reference) > 1 else 0.0
    log(f"  {work.grid.name} equal: largest |log perplexity - {reference_name}'s| {', '.join(parts)}; bound {tol:.2g} "
        f"(float32, depth {config.num_hidden_layers}, width {width}); the largest head's effect {effect:.3g}: "
        f"{'within' if ok else 'ABOVE'}")
    return ok


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def fastest_peer(work: Workload, with_load: bool, imports: dict[str, float] | None = None) -> tuple[str, float] | None:
    """The fastest peer route that ran and its seconds: the grid alone, with its model load (``with_load``), and
    with its imports too where ``imports`` (route: seconds) has them (a route without them is left out)."""
    times = {n: work.seconds[n] + (work.load_s.get(n, 0.0) if with_load else 0.0) + (imports or {}).get(n, 0.0)
             for n in PEERS if n in work.seconds and (imports is None or n in imports)}
    if not times:
        return None
    name = min(times, key=times.__getitem__)
    return name, times[name]


def packed_vs_fastest(work: Workload) -> str:
    """The fastest peer route's seconds over the ``packed`` route's, in process (``n/a`` where either did not run)."""
    fastest = fastest_peer(work, with_load=False)
    return ratio(fastest[1] if fastest else None, work.seconds.get("packed"))


def measure_grid(grid: Grid, folder: Path, args, root: Path) -> tuple[Workload, dict | None]:
    work = workload(grid, folder, args)
    log(f"{grid.name}: {len(work.masks)} single heads + baseline over {len(work.inputs)} windows of {SIZES.window} "
        f"tokens, batches of {args.batch_size}, {args.threads} thread(s); load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    run_headsweep(work, args.packed, args.routes)
    run_peers(work, args)
    stamps = None if args.skip_run else run_end_to_end(work, root)
    if stamps:
        startup_phases(stamps, grid.name)
    warm = None if args.skip_run or args.skip_warm else run_warm(work, root)
    if warm:
        startup_phases(warm, f"{grid.name} warm")
        stamps = {**(stamps or {}), "ready_warm": warm.get("ready")}
    fastest = fastest_peer(work, with_load=False)
    speedup = ratio(work.seconds.get("plain"), work.seconds["default"])
    log(f"  {grid.name}: bound {bound(work):.2f}; default over plain {speedup}"
        + (f"; the fastest peer ({fastest[0]}) over default {ratio(fastest[1], work.seconds['default'])}"
           if fastest else ""))
    return work, stamps


def reexec_with_peers(module: str = "bench.peers") -> None:
    """Run the benchmark ``module`` with ``.venv-peers``' python when the peers do not import here and that venv
    exists (the same arguments; this process exits with its status)."""
    python = VENV / "bin" / "python"
    if os.environ.get("HEADSWEEP_PEERS_REEXEC") or not python.exists() or Path(sys.prefix) == VENV:
        return
    if all(peer_available(n) is None for n in PEERS):
        return
    log(f"peers: the peers do not import here; running with {python}")
    env = {**os.environ, "HEADSWEEP_PEERS_REEXEC": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(common.ROOT), os.environ.get("PYTHONPATH")]))}
    sys.exit(subprocess.call([str(python), "-m", module, *sys.argv[1:]], cwd=common.ROOT, env=env))


def parse_args():
    parser = common.command_line(__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--grids", help="comma-separated: one_minute, five_minute (default both; --smoke: "
                                        "one_minute, one headsweep run being a minute here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (every route)")
    parser.add_argument("--invokes", type=int, default=4, help="masks per nnsight trace in nnsight_batched")
    parser.add_argument("--packed", type=int, default=0, metavar="N",
                        help="also time headsweep's default with masks_per_batch N in process (0: not run)")
    parser.add_argument("--skip-run", action="store_true", help="leave out headsweep run end to end")
    parser.add_argument("--skip-warm", action="store_true",
                        help="leave out headsweep run on a running cluster with its worker kept warm")
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help=f"comma-separated in-process routes of {', '.join(ROUTES)} (default all; default "
                             "always runs)")
    parser.add_argument("--no-reexec", action="store_true", help="never switch to .venv-peers' python")
    args = parser.parse_args()
    common.enable_smoke(args)
    args.grids = args.grids or ("one_minute" if common.SMOKE else "one_minute,five_minute")
    names = [g.strip() for g in args.grids.split(",") if g.strip()]
    known = {g.name: g for g in SIZES.grids}
    if not names or any(n not in known for n in names):
        parser.error(f"--grids takes {', '.join(known)} (comma-separated), not {args.grids!r}")
    if args.packed < 0:
        parser.error(f"--packed takes a number of masks a pass (0: the route is not run), not {args.packed}")
    args.grid_list = [known[n] for n in names]
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if any(r not in ROUTES for r in routes):
        parser.error(f"--routes takes {', '.join(ROUTES)} (comma-separated), not {args.routes!r}")
    args.routes = tuple(dict.fromkeys(["default", *routes]))
    return args


def main() -> None:
    args = parse_args()
    if not args.no_reexec:
        reexec_with_peers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is built locally: never wait on the network
    common.quiet_logging()
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    shape = shape_of(args.shape)
    folder = build(shape)
    versions = []
    for module in ("transformer_lens", "nnsight"):
        try:
            from importlib.metadata import version

            versions.append(f"{module} {version(module.replace('_', '-'))}")
        except Exception:  # noqa: BLE001
            versions.append(f"{module} absent")
    log(f"peers: {shape.name} ({folder.name}); python {sys.executable}; torch {torch.__version__}, "
        f"{', '.join(versions)}; {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    works, stamps = {}, {}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for grid in args.grid_list:
            works[grid.name], stamps[grid.name] = measure_grid(grid, folder, args, Path(tmp) / grid.name)
    largest = works[args.grid_list[-1].name] if len(args.grid_list) == 1 else works.get("five_minute")
    largest = largest or next(iter(works.values()))
    if not args.skip_run and not common.SMOKE:
        import_and_ray_seconds()
    imports = {} if args.skip_run else peer_import_seconds(largest)
    equal = all([equality(w) for w in works.values()])

    def end_to_end(name: str, route: str = "run", script: bool = False) -> str:
        work = works.get(name)
        if work is None or route not in work.seconds or (script and not imports):
            return "n/a"
        fastest = fastest_peer(work, with_load=True, imports=imports if script else None)
        return ratio(fastest[1], work.seconds[route]) if fastest else "n/a"

    def first_stamp(key: str) -> float | None:
        return next((s[key] for s in (stamps.get("one_minute"), stamps.get("five_minute"))
                     if s and s.get(key) is not None), None)

    startup, startup_warm = first_stamp("ready"), first_stamp("ready_warm")
    default_s = largest.seconds["default"]
    common.result("peers", shape=shape.name, bound=f"{bound(largest):.2f}",
                  vs_transformerlens=ratio(largest.seconds.get("transformerlens"), default_s),
                  vs_nnsight_loop=ratio(largest.seconds.get("nnsight_loop"), default_s),
                  vs_nnsight_batched=ratio(largest.seconds.get("nnsight_batched"), default_s),
                  end_to_end_vs_fastest=end_to_end("five_minute"), one_minute_vs_fastest=end_to_end("one_minute"),
                  startup_s="n/a" if startup is None else f"{startup:.1f}",
                  warm_end_to_end_vs_fastest=end_to_end("five_minute", "run_warm"),
                  warm_one_minute_vs_fastest=end_to_end("one_minute", "run_warm"),
                  warm_startup_s="n/a" if startup_warm is None else f"{startup_warm:.1f}",
                  end_to_end_vs_script=end_to_end("five_minute", script=True),
                  one_minute_vs_script=end_to_end("one_minute", script=True),
                  packed_vs_fastest=packed_vs_fastest(largest), equal=str(equal).lower())
    log(f"peers: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
