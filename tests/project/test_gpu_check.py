"""``bench/gpu_check.py``, the GPU check, on the CPU (``--device cpu --tiny``): it cannot rot between GPU runs, and
it runs from a bare copy of the repository, importing ``headsweep`` from there and nothing it must not need."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# The script by its path (its FLOP count, checked below): the repository root need not be on sys.path here. Its
# dataclasses look their module up in sys.modules while they are made.
_spec = importlib.util.spec_from_file_location("bench_gpu_check", REPO / "bench" / "gpu_check.py")
gpu_check = sys.modules["bench_gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_gpu_check_tiny_on_cpu_from_a_bare_checkout(tmp_path):
    """The script copied with only the package folders beside it, run isolated (``python -I``: no PYTHONPATH, no
    user site, the script's folder not on the path): exit 0, every shape's checks equal, ``headsweep`` imported
    from the copy (not from the installed checkout), and no Ray, DuckDB, pyarrow or fairseq imported."""
    copy = tmp_path / "checkout"
    for folder in ("headsweep", "sweep", "workers", "results"):
        shutil.copytree(REPO / folder, copy / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bench").mkdir()
    shutil.copy2(REPO / "bench" / "gpu_check.py", copy / "bench" / "gpu_check.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["HF_HUB_OFFLINE"] = "1"  # the check builds its models: it must never need the network
    # windows of 32 tokens, not --tiny's 64: the same routes and checks in half the matrix products, which a CPU
    # without bfloat16 instructions (AVX2 only) runs slowly (57 s -> 35 s there; the resolution stays above 13)
    proc = subprocess.run([sys.executable, "-I", "bench/gpu_check.py", "--device", "cpu", "--tiny", "--window", "32"],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    results = re.findall(r"^RESULT gpu_check shape=(\S+) vs_hook_loop=(\S+) reuse_over_plain=(\S+) mfu=(\S+) "
                         r"equal=(\S+)$", out, flags=re.M)
    assert [r[0] for r in results] == ["qwen2.5-0.5b-tiny", "llama-3.2-1b-tiny"], out
    for shape, vs_loop, reuse_over_plain, mfu, equal in results:
        assert equal == "true", out
        # On a shared CPU the figures mean nothing (the matrix-product rate is measured under other load); they
        # must only be measured.
        assert float(vs_loop) > 0 and float(reuse_over_plain) > 0 and float(mfu) > 0, (shape, out)
    # The tolerance can tell a head from no head on both shapes (else `equal` would be false).
    resolutions = [float(x) for x in re.findall(r"resolution ([0-9.]+)", out)]
    assert len(resolutions) == 2 and min(resolutions) > 1, out
    imports = re.search(r"^imports: headsweep from (\S+) \(\d+ modules, this checkout\); (.*)$", out, flags=re.M)
    assert imports, out
    assert Path(imports.group(1)).resolve() == (copy / "headsweep").resolve(), imports.group(0)
    assert imports.group(2) == "ray=absent duckdb=absent pyarrow=absent fairseq=absent", imports.group(0)


def test_flop_count_matches_torch_flop_counter():
    """The script's FLOP formula against torch's own count of the matrix products of a forward pass (the tiny Llama
    and Qwen2 shapes). Eager attention multiplies the full T x T scores, which torch counts; the formula counts
    the causal part a causal kernel computes (query t reads t keys), so the two differ by exactly the part above
    the diagonal: layers x 2 n_heads d T(T - 1)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    tokens = 16
    for shape in (gpu_check.tiny(gpu_check.QWEN25_05B), gpu_check.tiny(gpu_check.LLAMA32_1B)):
        config = shape.config()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        ids = torch.randint(0, config.vocab_size, (1, tokens))
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            model(input_ids=ids, use_cache=False)
        d = model.model.layers[0].self_attn.o_proj.in_features // config.num_attention_heads
        above_diagonal = config.num_hidden_layers * 2 * config.num_attention_heads * d * tokens * (tokens - 1)
        assert gpu_check.window_flops(config, tokens, tokens) == counter.get_total_flops() - above_diagonal, shape.name
