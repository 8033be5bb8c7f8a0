"""What the explorer tests share: bench/browser.py and bench/synthetic_store.py loaded by their paths (the suite does
not put the repository root on sys.path), the SQL that names a head's most harmed example straight from the
store (the independent route for the drill-downs and ``Store.head``), and a causal LM's perplexity run made once per
test session (its drill-downs and recomputed token losses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from conftest import sweep_in_process

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` loaded by its path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# An accuracy run's examples in the order the drill-down lists those a head's removal makes worse: the baseline's
# correct minus the masked one's (positive: harmed), most first, ties by example id; ``?``: run, head's eval id,
# baseline's eval id.
WORST_EXAMPLES_SQL = """
SELECT m.example_id, b.stats[1] - m.stats[1] AS harm, m.output, b.output AS baseline_output
FROM examples m JOIN examples b ON b.run_id = m.run_id AND b.example_id = m.example_id
WHERE m.run_id = ? AND m.eval_id = ? AND b.eval_id = ? AND b.stats[1] - m.stats[1] > 0
ORDER BY harm DESC, m.example_id
"""


def mean_lm_store(tmp_path_factory, ray_address: str) -> tuple[Path, str]:
    """A mean-ablation perplexity sweep of a tiny Llama-style model (baseline, single heads), run once per test
    session (under pytest's session temporary folder) in the test process, as the tests only read it: (store
    folder, run id)."""
    tmp = tmp_path_factory.getbasetemp() / "mean-lm"
    done = tmp / "run_id.txt"
    if not done.is_file():
        from tiny_models import lm_text, save_tiny_causal_lm  # torch: only when the store is built

        tmp.mkdir(exist_ok=True)
        model_dir = save_tiny_causal_lm(tmp / "llama", "llama_8q2kv")
        corpus = tmp / "corpus.txt"
        corpus.write_text(lm_text(160, seed=4))
        config = {"model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "eager"},
                  "data": {"path": str(corpus), "window": 16},
                  "sweep": {"experiments": ["baseline", "single_head"], "ablation": "mean", "batch_size": 8}}
        done.write_text(sweep_in_process(config, tmp, "run", tmp / "store", ray_address))
    return tmp / "store", done.read_text()
