"""GPU check: the causal-LM worker path at the sizes of Qwen2.5-0.5B and Llama-3.2-1B, on a bare GPU machine.

Needs only torch, transformers, safetensors (and what they bring: numpy, tokenizers) and this repository:
``python bench/gpu_check.py`` from a copy of the repository, nothing installed. ``headsweep`` and its three
sub-packages are imported from this checkout's folders (``headsweep/``, ``sweep/``, ``workers/``, ``results/``)
by a small import finder (:func:`use_checkout`); only worker-side modules are imported, none of which needs Ray,
DuckDB, pyarrow or fairseq. The last line before the results says where ``headsweep`` came from and that none of
those four was imported.

For each shape, a model with exactly the published configuration (layers, widths, heads, vocabulary, tied
embeddings, Qwen2's q/k/v biases, Llama 3's rope; the parameter count is checked against the published one) and
seeded random weights (transformers' own initialisation, ``initializer_range`` 0.02 as published; Qwen2's q/k/v
biases, which it starts at zero, drawn with standard deviation 0.5 so that they matter) is built on the device,
saved with a word-level tokenizer (ids below the vocabulary size) and a random text of ``--windows`` windows of
``--window`` tokens, and loaded back the way a worker loads it
(:class:`~headsweep.workers.families.hf_causal_lm.tasks.perplexity.CausalLMAdapter`, ``model.dtype`` ``--dtype``, sdpa
attention). The masks: four single heads in each of the first, a middle and the last layer (12 masks), and for
the gate check three single heads and one mask of three heads across layers. The routes, over the same windows:

* **reference**: the same weights (their ``--dtype`` values, exact in the wider type) in float32 (float64 for a
  float32 check), each mask applied by zeroing its heads' columns of ``o_proj`` (weight surgery); TF32 off.
* **hook loop**: what a TransformerLens or nnsight user writes: the model loaded by transformers, one forward
  pass per mask, a forward pre-hook on each masked head's ``o_proj`` zeroing that head's slice of its input.
* **weight surgery** in ``--dtype``: the unhooked model with the heads' ``o_proj`` columns zeroed.
* **gate**: headsweep's gates (:class:`~headsweep.workers.core.gates.HeadGates`), one mask at a time
  (``CausalLMAdapter.nll`` of one mask).
* **headsweep plain**: the adapter with ``sweep.reuse: false`` and ``sweep.masks_per_batch`` ``--masks-per-batch``
  (> 1: that many masks packed in one forward pass, the window batch repeated once per mask).
* **headsweep reuse**: the adapter with ``sweep.reuse: true`` and the same packing: each mask starts at its first
  gated layer from the window batch's cached baseline states.

Compared per mask and window: the summed NLL (nats) of the window's scored tokens, what a sweep stores.

The tolerance, derived for the dtype. The routes compute the same function and differ only in the order and
place of their roundings (packing changes the shapes of the matrix products, reuse starts from cached states, a
gate multiplies a head's input by 0 where surgery multiplies it by zeroed weights). Let E be the largest rounding
error of one ``--dtype`` evaluation of a window's NLL, measured over every mask and window checked as
``|hook loop - reference|``. The reference's own rounding is negligible: its unit roundoff is 2^16 times smaller
(float32's 2^-24 against bfloat16's 2^-8; float64 against float32: 2^29), so this difference is the ``--dtype``
evaluation's error to within 1 part in 65,536. Any other route rounds the same quantities to the same format,
so its error is bounded by E as well (E is the largest of masks x windows such errors), and two routes lie within
``tau = 2E`` of each other (the triangle inequality through the exact value). E comes from the hook loop and the
reference alone, so a headsweep route that computed something else is not covered by it.

For bfloat16 at these sizes E is of the order of one head's effect: the residual stream is rounded to 8 bits
after every layer, and a random head is one of a few hundred similar contributions to it (Qwen2.5-0.5B on 2
windows of 256 tokens: E = 0.21 nats on NLL sums of 3,100 nats, single heads moving them by 0.56 to 1.0). So
``resolution`` = the largest change a checked mask makes to a window's NLL (hook loop against no mask) / tau must
exceed 1: then a route that ignored masks, or applied the wrong ones, fails at least there; the line also says how
many masks change a window by more than tau. ``equal`` is true when gate == surgery, plain == hook loop and reuse
== plain all hold within tau, reuse ran (did not fall back to the plain path) and resolution > 1.

Figures (per shape; the 12 single-head masks over all windows, each route timed after a warm-up pass, best of
``--repeats``):

* ``vs_hook_loop`` = hook-loop seconds / headsweep plain seconds (how much faster headsweep's packed
  evaluation is than the loop a user writes; > 1 is faster).
* ``reuse_over_plain`` = headsweep plain seconds / headsweep reuse seconds (> 1: reuse is faster).
* ``mfu`` = FLOPs headsweep plain computes / its seconds / the rate of a ``--dtype`` matrix product of N x N
  (``torch.mm``, N = 8192 on a GPU, 1024 on a CPU) measured in the same run on the same device. FLOPs counted
  from the configuration (a multiply-add is 2 FLOPs), per window of T tokens with logits for K positions::

      layers * (T * (2h(q + 2kv) + 2qh + 6hI) + 2 n_heads d T(T + 1)) + 2 K h V

  with h the hidden size, I the feed-forward size, d the head size, q = n_heads d, kv = n_kv_heads d, V the
  vocabulary: the q/k/v, output and three feed-forward projections per token, causal attention (query t reads t
  keys: QK^T and AV, 4 n_heads d t), and the LM head; norms, activations, softmax and the loss are left out
  (under 1%). Plain computes K = T logits per window (every position after the first is scored).

**The peers** (bench/peers.py's loops, where they import; the device machine has no network, so a peer absent there
is skipped with a line saying so): TransformerLens 4's ``TransformerBridge.boot_transformers(..., hf_model=model)``
with one ``run_with_hooks`` per mask zeroing ``blocks.L.attn.hook_z[:, :, h]``, and nnsight 0.8's
``LanguageModel(model)`` zeroing head h's slice of ``o_proj``'s input, one trace per mask and ``--masks-per-batch``
``invoke``s per trace; each over the 12 grid masks, compared with the hook loop within tau (a failure otherwise),
timed as the others, and printed as ``RESULT gpu_check_peers shape=<name> vs_transformerlens=<x>
vs_nnsight_loop=<x> vs_nnsight_batched=<x>`` (the peer's seconds / headsweep reuse's; ``n/a`` for one that did
not run) when at least one ran. They need neither Ray nor the rest of this repository.

Ends with one line per shape: ``RESULT gpu_check shape=<name> vs_hook_loop=<x> reuse_over_plain=<x> mfu=<x>
equal=<true|false>``; exit status 1 if any check fails.

Usage: python bench/gpu_check.py [--shape NAME] [--device cuda] [--dtype bfloat16] [--windows 8] [--window 256]
       python bench/gpu_check.py --device cpu --tiny
``--tiny``: the same architectures shrunk to 4 layers, heads of 8 and a 2,048-token vocabulary (heads per layer
and key/value sharing kept), 4 windows of 64 tokens, one thread; under a minute on a CPU (57 s on one without
bfloat16 instructions), and in the test suite (tests/project/test_gpu_check.py, with windows of 32 tokens). On a CPU
too the dtype stays bfloat16: the check is about bfloat16's rounding and the paths a GPU run takes (its figures mean
nothing on a CPU).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and numpy are imported when needed, after the checkout's finder is in place
    import numpy as np
    import torch
    from torch import nn

ROOT = Path(__file__).resolve().parents[1]
# The one import name `headsweep` and the folders of this checkout it maps (as the installed package does).
PACKAGE_FOLDERS = {"headsweep": "headsweep", "headsweep.sweep": "sweep", "headsweep.workers": "workers",
                   "headsweep.results": "results"}
NOT_NEEDED = ("ray", "duckdb", "pyarrow", "fairseq")
PEERS_LOADED: set[str] = set()  # modules of NOT_NEEDED first imported by a peer's route (TransformerLens, nnsight)


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``headsweep`` and its sub-packages in this checkout, ahead of any installed copy.

    Only the four packages need it: their modules are then found through the package's ``__path__`` by Python's
    own path finder.
    """

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        folder = PACKAGE_FOLDERS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])


def use_checkout() -> None:
    """Import ``headsweep.*`` from this checkout (nothing installed needed)."""
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder())


@dataclass(frozen=True)
class Shape:
    """A model configuration: its transformers config class and values, and the published parameter count."""

    name: str
    config_class: str
    values: dict
    parameters: int | None = None  # checked against the built model when given

    def config(self):
        """The transformers config (a ``PretrainedConfig``) of this shape."""
        import transformers

        return getattr(transformers, self.config_class)(**self.values)


QWEN25_05B = Shape("qwen2.5-0.5b", "Qwen2Config", dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
    initializer_range=0.02, bos_token_id=151643, eos_token_id=151643), 494_032_768)
LLAMA32_1B = Shape("llama-3.2-1b", "LlamaConfig", dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=128000, eos_token_id=128001), 1_235_814_400)
SHAPES = {s.name: s for s in (QWEN25_05B, LLAMA32_1B)}


def tiny(shape: Shape) -> Shape:
    """The same architecture shrunk: 4 layers, heads of 8, a 2,048-token vocabulary, the heads per layer kept."""
    heads = shape.values["num_attention_heads"]
    values = {**shape.values, "num_hidden_layers": 4, "hidden_size": heads * 8, "intermediate_size": heads * 32,
              "vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 1}  # the published ids lie past 2,048
    values.update({"max_window_layers": 4} if "max_window_layers" in values else {})
    values.update({"head_dim": 8} if "head_dim" in values else {})
    return Shape(f"{shape.name}-tiny", shape.config_class, values)


# -- the models, their tokenizer and text ---------------------------------------------------------------------

def build_folder(shape: Shape, folder: Path, device: str, dtype: torch.dtype, tokens: int, seed: int
                 ) -> tuple[Path, object]:
    """Save a model of ``shape`` (seeded random weights, built on ``device``, stored in ``dtype``), a word-level
    tokenizer and a text of ``tokens`` words; returns the text file and the config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape.config()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        for name, bias in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                # transformers starts Qwen2's q/k/v biases at zero; drawn as the tests draw them, so they matter
                with torch.no_grad():
                    bias.normal_(0.0, 0.5)
    count = sum(p.numel() for p in model.parameters())
    if shape.parameters is not None and count != shape.parameters:
        raise SystemExit(f"gpu_check: error: {shape.name} built with {count:,} parameters, the published model has "
                         f"{shape.parameters:,}: the configuration is not the published one")
    model.to(dtype).save_pretrained(folder)
    del model
    words = [f"w{i}" for i in range(min(8192, config.vocab_size - 8))]
    # In a folder of its own (model.tokenizer): beside a config.json of model_type qwen2, transformers 5's
    # AutoTokenizer would load it as a Qwen2Tokenizer, which does not split this text into these words.
    word_tokenizer(words).save_pretrained(folder / "tokenizer")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(words), (tokens,), generator=g).tolist()
    lines = [" ".join(words[i] for i in picks[j : j + 16]) for j in range(0, tokens, 16)]
    text = folder / "text.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return text, config


def word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over ``words`` (ids 0..len(words)+1, below any vocabulary we build)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def load_user_model(folder: Path, device: str, dtype: torch.dtype) -> nn.Module:
    """The model as a user loads it with transformers (no headsweep hooks)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def adapter_for(folder: Path, text: Path, args: argparse.Namespace, reuse: bool):
    """The worker's evaluation adapter, configured as a sweep would configure it."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    model = CausalLMModel(path=str(folder), tokenizer=str(folder / "tokenizer"), attn_implementation="sdpa",
                          dtype=args.dtype)
    data = CausalLMData(path=str(text), window=args.window, max_windows=args.windows)
    runtime = RuntimeOptions(device=args.device, batch_size=args.batch_size, masks_per_batch=args.masks_per_batch,
                             reuse=reuse, threads=args.threads)
    return load_causal_lm_adapter(model, data, runtime)


# -- the routes ------------------------------------------------------------------------------------------------

def window_nll(model: nn.Module, inputs: torch.Tensor, scored: torch.Tensor, batch_size: int) -> np.ndarray:
    """Summed NLL (nats, float64) of each window's scored tokens, computed as a user would from the logits."""
    import torch
    import torch.nn.functional as F

    sums = []
    with torch.inference_mode():
        for start in range(0, inputs.shape[0], batch_size):
            ids = inputs[start : start + batch_size]
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.shape[0], -1)
            sums.append((nll.double() * scored[start : start + batch_size]).sum(dim=1))
    return torch.cat(sums).cpu().numpy()


def o_proj(model: nn.Module, layer: int) -> nn.Linear:
    """The attention output projection of decoder layer ``layer`` (Llama and Qwen2 name it alike)."""
    return model.model.layers[layer].self_attn.o_proj


def hook_loop(model: nn.Module, masks: list, inputs: torch.Tensor, scored: torch.Tensor, batch_size: int
              ) -> np.ndarray:
    """One forward pass per mask, a pre-hook on each masked head's ``o_proj`` zeroing that head's input slice."""
    import numpy as np

    d = o_proj(model, 0).in_features // model.config.num_attention_heads
    rows = []
    for mask in masks:
        handles = []
        for head in mask:
            def zero(module, args, lo=head.head * d, hi=(head.head + 1) * d):
                x = args[0].clone()
                x[..., lo:hi] = 0
                return (x, *args[1:])
            handles.append(o_proj(model, head.layer).register_forward_pre_hook(zero))
        try:
            rows.append(window_nll(model, inputs, scored, batch_size))
        finally:
            for h in handles:
                h.remove()
    return np.stack(rows)


def surgery(model: nn.Module, masks: list, inputs: torch.Tensor, scored: torch.Tensor, batch_size: int
            ) -> np.ndarray:
    """Each mask applied by zeroing its heads' ``o_proj`` columns (restored after)."""
    import numpy as np
    import torch

    d = o_proj(model, 0).in_features // model.config.num_attention_heads
    rows = []
    for mask in masks:
        saved = []
        with torch.no_grad():
            for head in mask:
                weight = o_proj(model, head.layer).weight
                cols = slice(head.head * d, (head.head + 1) * d)
                saved.append((weight, cols, weight[:, cols].clone()))
                weight[:, cols] = 0
        try:
            rows.append(window_nll(model, inputs, scored, batch_size))
        finally:
            with torch.no_grad():
                for weight, cols, old in saved:
                    weight[:, cols] = old
    return np.stack(rows)


def nll_from_logits(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Each window's summed NLL of its scored tokens from ``logits`` (float64), as :func:`window_nll` computes it."""
    import torch.nn.functional as F

    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none").view(ids.shape[0], -1)
    return (nll.double() * scored).sum(dim=1)


def transformerlens_loop(bridge: object, masks: list, inputs: torch.Tensor, scored: torch.Tensor, batch_size: int
                         ) -> np.ndarray:
    """TransformerLens 4's loop: one ``run_with_hooks`` per mask, each hook zeroing its head in ``blocks.L.attn.hook_z``
    (z: batch, position, head, d_head) of the bridge ``TransformerBridge.boot_transformers(..., hf_model=model)``."""
    import numpy as np
    import torch

    rows = []
    with torch.inference_mode():
        for mask in masks:
            hooks = []
            for head in mask:
                def zero(z, hook, h=head.head):
                    z[:, :, h, :] = 0.0
                    return z
                hooks.append((f"blocks.{head.layer}.attn.hook_z", zero))
            sums = [nll_from_logits(bridge.run_with_hooks(inputs[i : i + batch_size], fwd_hooks=hooks,
                                                          return_type="logits"),
                                    inputs[i : i + batch_size], scored[i : i + batch_size])
                    for i in range(0, inputs.shape[0], batch_size)]
            rows.append(torch.cat(sums).cpu().numpy())
    return np.stack(rows)


def nnsight_loop(lm: object, config: object, masks: list, inputs: torch.Tensor, scored: torch.Tensor,
                 batch_size: int, invokes: int) -> np.ndarray:
    """nnsight 0.8 (``LanguageModel(model)``): each mask zeroes its heads' slices of ``o_proj``'s input in a trace;
    ``invokes`` masks per trace, one ``invoke`` each (1: one trace per mask)."""
    import numpy as np
    import torch

    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = [[] for _ in masks]
    with torch.inference_mode():
        for i in range(0, inputs.shape[0], batch_size):
            ids, keep = inputs[i : i + batch_size], scored[i : i + batch_size]
            for start in range(0, len(masks), invokes):
                saved = []
                with lm.trace() as tracer:
                    for mask in masks[start : start + invokes]:
                        with tracer.invoke(ids):
                            for head in mask:
                                site = lm.model.layers[head.layer].self_attn.o_proj
                                site.input[..., head.head * d : (head.head + 1) * d] = 0
                            saved.append(lm.output.logits.save())
                for k, logits in enumerate(saved):
                    rows[start + k].append(nll_from_logits(logits, ids, keep))
    return np.stack([torch.cat(r).cpu().numpy() for r in rows])


def peer_routes(folder: Path, grid: list, inputs: torch.Tensor, scored: torch.Tensor, args: argparse.Namespace,
                tol: Tolerance, hooked: np.ndarray) -> dict[str, float]:
    """TransformerLens's and nnsight's loops over the grid where they import (a line says why where not), each
    compared with the hook loop within tau and timed (best of ``--repeats``); their seconds by route."""
    import torch

    seconds = {}
    dtype = getattr(torch, args.dtype)
    for name in ("transformerlens", "nnsight_loop", "nnsight_batched"):
        module = "transformer_lens" if name == "transformerlens" else "nnsight"
        before = set(sys.modules)
        try:
            __import__(module)
            if module == "transformer_lens":
                __import__("transformer_lens.model_bridge")
        except Exception as exc:  # noqa: BLE001  absent (the device machine has no network), or broken
            print(f"  {name}: skipped: {module} does not import here ({type(exc).__name__}); make bench-peers "
                  "installs it", flush=True)
            continue
        try:
            # A fresh model for each: the TransformerLens bridge switches the model it wraps to eager attention.
            from transformers import AutoTokenizer

            model = load_user_model(folder, args.device, dtype)
            tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
            if name == "transformerlens":
                from transformer_lens.model_bridge import TransformerBridge  # pyright: ignore[reportMissingImports]

                bridge = TransformerBridge.boot_transformers(str(folder), device=args.device, dtype=dtype,
                                                             hf_model=model, tokenizer=tokenizer)
                run = partial(transformerlens_loop, bridge, grid, inputs, scored, args.batch_size)
            else:
                from nnsight import LanguageModel  # pyright: ignore[reportMissingImports]

                lm = LanguageModel(model, tokenizer=tokenizer)
                run = partial(nnsight_loop, lm, model.config, grid, inputs, scored, args.batch_size,
                              1 if name == "nnsight_loop" else args.masks_per_batch)
            run()  # warm-up
            values, seconds[name] = best_time(run, args.device, args.repeats)
        except Exception as exc:  # noqa: BLE001  a peer's API change must not cost headsweep's figures
            print(f"  {name}: failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}", flush=True)
            continue
        finally:
            release(args.device)
            PEERS_LOADED.update(set(NOT_NEEDED) & (set(sys.modules) - before))
        tol.compare(f"{name} == hook loop ({len(grid)} masks)", values, hooked)
    return seconds


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the reference route: float64 for a float32 check, else float32 (a unit roundoff 2^16 times
    smaller than bfloat16's, 2^29 times smaller than float32's)."""
    import torch

    return torch.float64 if dtype == torch.float32 else torch.float32


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (timings must include it)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn: Callable, device: str, repeats: int) -> tuple[object, float]:
    """``fn()``'s result and its best wall time of ``repeats`` runs."""
    best, out = math.inf, None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return out, best


def matmul_rate(device: str, dtype: torch.dtype, n: int | None = None, seconds: float = 1.0,
                fastest: bool = False) -> tuple[int, float]:
    """(N, FLOP/s) of ``torch.mm`` of two N x N matrices in ``dtype`` on ``device`` (N = ``n``, by default 8192 on a
    GPU and on a CPU up to 1024, see :func:`cpu_product_size`), products run for at least ``seconds`` after a
    warm-up: the rate over all of them, or with ``fastest`` that of the fastest single product (bench/real_size.py's
    figure on a shared CPU, where other processes only ever slow a product down)."""
    import torch

    n = n or (8192 if device.startswith("cuda") else cpu_product_size(dtype))
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    for _ in range(3):
        torch.mm(a, b)
    synchronize(device)
    runs, best, start = 0, math.inf, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < seconds:
        product = time.perf_counter()
        torch.mm(a, b)
        runs += 1
        if fastest:
            synchronize(device)
            best = min(best, time.perf_counter() - product)
        elif runs % 8 == 0:
            synchronize(device)
    synchronize(device)
    return n, 2 * n**3 / (best if fastest else (time.perf_counter() - start) / runs)


def cpu_product_size(dtype: torch.dtype, largest: int = 1024, product_s: float = 0.05) -> int:
    """N for :func:`matmul_rate` on a CPU: 1024, or less where one N x N product in ``dtype`` would take longer than
    ``product_s``. A CPU without bfloat16 instructions (AVX2 only) multiplies bfloat16 about a thousand times slower
    than float32 (0.7 GFLOP/s seen): six 1024 x 1024 products took 18 s of the ``--tiny`` check's 78."""
    import torch

    n = 256
    a = torch.ones(n, n, dtype=dtype)
    torch.mm(a, a)
    start = time.perf_counter()
    torch.mm(a, a)
    seconds = time.perf_counter() - start
    # a product's time grows as N^3: the largest multiple of 128 within product_s
    fits = int(n * (product_s / max(seconds, 1e-9)) ** (1 / 3)) // 128 * 128
    return max(128, min(largest, fits))


def window_flops(config: object, tokens: int, logits: int) -> int:
    """FLOPs of one window's forward pass (the formula of the module docstring)."""
    h, n_layers, inner, vocab = (config.hidden_size, config.num_hidden_layers, config.intermediate_size,
                                 config.vocab_size)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * d, kv_heads * d
    per_token = 2 * h * (q + 2 * kv) + 2 * q * h + 6 * h * inner
    attention = 2 * heads * d * tokens * (tokens + 1)
    return n_layers * (tokens * per_token + attention) + 2 * logits * h * vocab


# -- one shape -------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one shape's check found."""

    shape: str
    vs_hook_loop: float
    reuse_over_plain: float
    mfu: float
    failures: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.failures

    def result_line(self) -> str:
        """The shape's ``RESULT gpu_check ...`` line."""
        return (f"RESULT gpu_check shape={self.shape} vs_hook_loop={self.vs_hook_loop:.2f} "
                f"reuse_over_plain={self.reuse_over_plain:.2f} mfu={self.mfu:.3f} equal={str(self.equal).lower()}")


def grid_masks(config: object) -> list:
    """Four single heads in each of the first, a middle and the last layer."""
    from headsweep.workers.core.heads import Head

    n_layers, heads = config.num_hidden_layers, config.num_attention_heads
    layers = sorted({0, n_layers // 2, n_layers - 1})
    picks = sorted({0, heads // 3, 2 * heads // 3, heads - 1})
    return [[Head("self", layer, h)] for layer in layers for h in picks]


def gate_masks(config: object) -> list:
    """A few heads for gate == weight surgery: single heads in three layers and one mask across layers."""
    from headsweep.workers.core.heads import Head

    last, heads = config.num_hidden_layers - 1, config.num_attention_heads
    mid = config.num_hidden_layers // 2
    return [[Head("self", 0, 1)], [Head("self", mid, heads // 2)], [Head("self", last, heads - 2)],
            [Head("self", 0, 2), Head("self", mid, 0), Head("self", last, heads - 1)]]


def largest(a: np.ndarray, b: np.ndarray) -> float:
    """``max|a - b|`` over all masks and windows."""
    import numpy as np

    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def release(device: str) -> None:
    """Give back the memory of models and activations dropped by the caller."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@dataclass
class Tolerance:
    """``tau = 2E`` and what it resolves (see the module docstring); ``failures`` collects the comparisons above it."""

    error: float
    effects: list[float]
    failures: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return 2 * self.error

    @property
    def resolution(self) -> float:
        return max(self.effects) / self.tau if self.tau > 0 else math.inf

    def describe(self, dtype: str, reference: str, masks: int, windows: int) -> str:
        """The tolerance line of a shape's report."""
        resolved = sum(e > self.tau for e in self.effects)
        return (f"  tolerance: one {dtype} evaluation is within E = {self.error:.3g} nats of {reference} (largest "
                f"over {masks} masks x {windows} windows); tau = 2E = {self.tau:.3g}; resolution "
                f"{self.resolution:.1f} (the largest change a mask makes to a window's NLL / tau; {resolved} of "
                f"{len(self.effects)} masks change one by more than tau, the least changes one by "
                f"{min(self.effects):.3g})")

    def compare(self, what: str, got: np.ndarray, expected: np.ndarray) -> None:
        """Print how far ``got`` is from ``expected``; a failure if above tau."""
        diff = largest(got, expected)
        ok = diff <= self.tau
        print(f"  {what}: largest difference {diff:.3g} nats = {diff / self.tau if self.tau else 0:.2f} tau "
              f"({'within' if ok else 'ABOVE'})", flush=True)
        if not ok:
            self.failures.append(f"{what}: {diff:.3g} > tau {self.tau:.3g}")


def reference_nll(folder: Path, masks: list, inputs: torch.Tensor, scored: torch.Tensor, args: argparse.Namespace
                  ) -> np.ndarray:
    """Each mask's window NLL by weight surgery on the model in the reference dtype (TF32 off: float32 products
    must be float32's, not 10-bit mantissas)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_user_model(folder, args.device, reference_dtype(getattr(torch, args.dtype)))
    out = surgery(model, masks, inputs, scored, args.batch_size)
    del model
    release(args.device)
    return out


def check_shape(shape: Shape, args: argparse.Namespace, rate: float, workdir: Path) -> Outcome:
    """Build ``shape``, run every route, compare them and time them."""
    import numpy as np
    import torch

    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    folder = workdir / shape.name
    start = time.perf_counter()
    text, config = build_folder(shape, folder, args.device, dtype, args.windows * args.window, args.seed)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    print(f"{shape.name}: {config.num_hidden_layers} layers, {config.num_attention_heads} query / "
          f"{config.num_key_value_heads} key-value heads of {d}, hidden {config.hidden_size}, intermediate "
          f"{config.intermediate_size}, vocabulary {config.vocab_size:,}"
          + (f", {shape.parameters:,} parameters as published" if shape.parameters else "")
          + f" (built and saved in {time.perf_counter() - start:.1f} s)", flush=True)
    grid, gates = grid_masks(config), gate_masks(config)
    checked = [[], *grid, *gates]  # every mask the reference and the hook loop evaluate, no mask first

    plain = adapter_for(folder, text, args, reuse=False)
    inputs, scored, batch = plain.inputs, plain.scored.double(), args.batch_size
    reference = reference_nll(folder, checked, inputs, scored, args)
    user = load_user_model(folder, args.device, dtype)
    window_nll(user, inputs, scored, batch)  # warm-up
    looped = hook_loop(user, checked, inputs, scored, batch)
    tol = Tolerance(largest(looped, reference), [float(np.abs(row - looped[0]).max()) for row in looped[1:]])
    print(tol.describe(args.dtype, str(reference_dtype(dtype)).removeprefix("torch."), len(checked), args.windows),
          flush=True)
    if not tol.resolution > 1:
        tol.failures.append(f"resolution {tol.resolution:.2f}: no mask changes a window's NLL by more than tau, so "
                            "the comparisons cannot fail")

    gated = np.stack([plain.nll([m])[0] for m in gates])
    tol.compare(f"gate == weight surgery ({len(gates)} masks)", gated, surgery(user, gates, inputs, scored, batch))
    plain.baseline()  # warm-up, as a sweep evaluates the baseline first
    plain_nll, plain_s = best_time(partial(plain.nll, grid), args.device, args.repeats)
    hooked, hook_s = best_time(partial(hook_loop, user, grid, inputs, scored, batch), args.device,
                               args.repeats)
    tol.compare(f"headsweep plain (masks_per_batch {args.masks_per_batch}) == hook loop ({len(grid)} masks)",
                plain_nll, hooked)
    del user, plain
    release(args.device)

    reuse = adapter_for(folder, text, args, reuse=True)
    reuse.baseline()  # records each window batch's baseline states and checks a replay once, as a sweep does
    reused, reuse_s = best_time(partial(reuse.nll, grid), args.device, args.repeats)
    tol.compare("headsweep reuse == plain", reused, plain_nll)
    print(f"  reuse: {reuse.reuse_note}", flush=True)
    if not reuse.reuse_note.startswith("prefix"):
        tol.failures.append(f"reuse did not run: {reuse.reuse_note}")
    del reuse
    release(args.device)
    # after every headsweep route, so that what a peer imports cannot hide what headsweep imported (import_report)
    peer_s = peer_routes(folder, grid, inputs, scored, args, tol, hooked)

    flops = len(grid) * args.windows * window_flops(config, args.window, args.window)
    peak = f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    print(f"  seconds for {len(grid)} masks x {args.windows} windows of {args.window} tokens (best of "
          f"{args.repeats}): hook loop {hook_s:.3f}, headsweep plain {plain_s:.3f}, reuse {reuse_s:.3f} (hook loop / "
          f"reuse {hook_s / reuse_s:.2f}); plain computes {flops / 1e12:.3f} TFLOP, {flops / plain_s / 1e12:.2f} "
          f"TFLOP/s{peak}", flush=True)
    if peer_s:
        print("RESULT gpu_check_peers shape=" + shape.name + "".join(
            f" vs_{name}={peer_s[name] / reuse_s:.2f}" if name in peer_s else f" vs_{name}=n/a"
            for name in ("transformerlens", "nnsight_loop", "nnsight_batched")), flush=True)
    for failure in tol.failures:
        print(f"  FAILED: {failure}", flush=True)
    return Outcome(shape.name, hook_s / plain_s, plain_s / reuse_s, flops / plain_s / rate, tol.failures)


def import_report() -> tuple[str, bool]:
    """Where ``headsweep`` was imported from, and whether any module it must not need was imported."""
    modules = {name: m for name, m in sys.modules.items() if name == "headsweep" or name.startswith("headsweep.")}
    outside = sorted(name for name, m in modules.items()
                     if getattr(m, "__file__", None) and not Path(m.__file__).resolve().is_relative_to(ROOT))
    loaded = [name for name in NOT_NEEDED if name in sys.modules and name not in PEERS_LOADED]
    found = "this checkout" if not outside else f"elsewhere for {', '.join(outside)}"
    state = {name: "loaded" if name in loaded else "absent" for name in NOT_NEEDED}
    state.update({name: "loaded-by-the-peers" for name in PEERS_LOADED})
    line = (f"imports: headsweep from {Path(sys.modules['headsweep'].__file__).parent} ({len(modules)} modules, "
            f"{found}); " + " ".join(f"{name}={state[name]}" for name in NOT_NEEDED))
    return line, not outside and not loaded


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with the defaults of ``--tiny`` or of a real run filled in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="check one shape (default: both)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="the shapes shrunk (4 layers, small widths)")
    parser.add_argument("--windows", type=int, help="windows of text (default 8, --tiny 4)")
    parser.add_argument("--window", type=int, help="tokens per window (default 256, --tiny 64)")
    parser.add_argument("--batch-size", type=int, help="windows per batch (default 8, --tiny 2)")
    parser.add_argument("--masks-per-batch", type=int, default=4, help="masks packed in one forward pass (> 1)")
    parser.add_argument("--repeats", type=int, help="timed runs of each route, the best counts (default 3, --tiny 1)")
    parser.add_argument("--threads", type=int,
                        help="CPU threads (default on a CPU: 1, the efficient count for the tiny shapes' small "
                             "products; on a GPU: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the models are saved (default: a temporary folder)")
    args = parser.parse_args(argv)
    defaults = (4, 64, 2) if args.tiny else (8, 256, 8)
    args.windows = args.windows or defaults[0]
    args.window = args.window or defaults[1]
    args.batch_size = args.batch_size or defaults[2]
    args.repeats = args.repeats or (1 if args.tiny else 3)
    if args.threads is None:
        args.threads = 0 if args.device.startswith("cuda") else 1
    if args.masks_per_batch < 2:
        parser.error("--masks-per-batch must be at least 2 (the check is of packed evaluation)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; the exit status (0: every check held and nothing unneeded was imported)."""
    args = parse_args(argv)
    use_checkout()
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: error: --device cuda but torch sees no GPU; on a CPU run --device cpu --tiny",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        print(f"gpu_check: error: --dtype {args.dtype} is not a torch floating-point dtype", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    shapes = [SHAPES[args.shape]] if args.shape else list(SHAPES.values())
    shapes = [tiny(s) for s in shapes] if args.tiny else shapes
    n, rate = matmul_rate(args.device, dtype)
    print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, {args.device} ({name}), "
          f"{args.dtype}; {args.dtype} matrix product {n} x {n}: {rate / 1e12:.2f} TFLOP/s", flush=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-", dir=args.workdir) as workdir:
        for shape in shapes:
            outcomes.append(check_shape(shape, args, rate, Path(workdir)))
    line, clean = import_report()
    print(line)
    for outcome in outcomes:
        print(outcome.result_line())
    return 0 if clean and all(o.equal for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
