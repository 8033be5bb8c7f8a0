"""Balanced dispatch: short phases and the tail of every sweep are spread over all workers."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import duckdb
import yaml
from conftest import run_cli

from headsweep.sweep.cluster.dispatch import batch_size


def first_round(n: int, per_call: int, live: int, in_flight: int) -> list[int]:
    """Batch sizes cut for the first ``live x in_flight`` call slots, before any call returns."""
    sizes = []
    for _ in range(live * in_flight):
        if n == 0:
            break
        sizes.append(batch_size(n, per_call, live, in_flight))
        n -= sizes[-1]
    return sizes


def test_batch_size_full_calls_while_the_queue_is_long_then_a_fair_share():
    assert batch_size(100, 8, 4, 2) == 8  # 100 units fill 8 slots with full calls: masks keep sharing a pass
    assert batch_size(64, 8, 4, 2) == 8
    assert batch_size(63, 8, 4, 2) == 8  # ceil(63 / 8)
    assert batch_size(20, 8, 4, 2) == 3
    assert batch_size(1, 8, 4, 2) == 1
    assert batch_size(5, 1, 2, 2) == 1  # never more than per_call
    assert batch_size(12, 8, 1, 2) == 8  # one worker has no one to share with
    assert batch_size(3, 8, 1, 2) == 3  # never more than what is left
    assert batch_size(3, 8, 2, 1) == 2
    # The case: 12 masks, 8 per call, 2 workers, 2 calls each in flight. Before: [8, 4], both on worker 0.
    assert first_round(12, 8, 2, 2) == [3, 3, 2, 1]
    assert first_round(12, 8, 4, 2) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert first_round(100, 8, 2, 2) == [8, 8, 8, 8]


def test_twelve_mask_sweep_on_two_workers_uses_both(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    heads = [f"self:{layer}:{head}" for layer in range(2) for head in range(4)]
    masks = [list(pair) for pair in itertools.combinations(heads, 2)][:12]
    cfg = {
        "model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)},
        "data": {"path": str(tiny_dev_tsv)},
        # masks_per_batch 0: the default 8 masks per call, as in the report
        "sweep": {"experiments": ["custom"], "masks": masks, "workers": 2, "batch_size": 16},
        "significance": {"enabled": False},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(store), "--address", ray_address,
                   env={"HEADSWEEP_PLAIN_PROGRESS": "1"})
    assert proc.returncode == 0, proc.stderr
    # A call's results land together: the first progress line counts the whole first call that landed (2 to 4
    # units, the baseline with masks; each worker runs its calls in the order sent), not its first unit alone.
    counts = [int(c) for c in re.findall(r"^evaluations: (\d+)/13 ", proc.stderr, flags=re.M)]
    assert counts and counts[0] > 1 and counts[-1] == 13, proc.stderr
    rows = duckdb.connect().sql(
        f"SELECT experiment, worker FROM read_parquet('{store}/evaluations/*/*.parquet', hive_partitioning=true, "
        "hive_types={'run_id': VARCHAR}, union_by_name=true)"
    ).fetchall()
    assert Counter(e for e, _ in rows) == {"custom": 12, "baseline": 1}
    by_worker = Counter(w.split("@")[0] for e, w in rows if e == "custom")
    assert set(by_worker) == {"worker-0", "worker-1"}, by_worker
    # The first four calls go out before any returns, round-robin, 3+2 and 3+1 masks: each worker gets at least 4.
    assert min(by_worker.values()) >= 4, by_worker
