"""Pairwise head interactions (``pairs``): the statistics against hand-computed and plain-numpy routes,
pair masks through prefix reuse against the plain path, and real runs through the CLI read back with DuckDB."""

from __future__ import annotations

import itertools

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from PIL import Image
from tiny_models import random_batch, tiny_classifier
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import build_config
from headsweep.sweep.experiments import schedule
from headsweep.sweep.experiments.pairs.interactions import interaction_bootstrap
from headsweep.sweep.experiments.pairs.kind import pairs_of
from headsweep.sweep.reporting.report import write_report
from headsweep.sweep.statistics.significance import adjust_pvalues, paired_bootstrap, resample_counts
from headsweep.workers.core.gates import HeadGates
from headsweep.workers.core.heads import Head
from headsweep.workers.core.metrics import accuracy_from_stats, bleu_from_stats, perplexity_from_stats
from headsweep.workers.families.hf_classifier.reuse import PrefixReuse, classifier_layout
from headsweep.workers.families.hf_shared.sites import find_sites
from headsweep.workers.memory.replay import first_gated_layer

N, R, SEED = 40, 400, 11


def flips(base: np.ndarray, wrong: list[int]) -> np.ndarray:
    """Accuracy statistics (N, 1): ``base`` with the examples in ``wrong`` made incorrect."""
    out = base.copy()
    out[wrong, 0] = 0.0
    return out


# -- the statistics -----------------------------------------------------------------------------------
def test_additive_effects_interact_exactly_zero():
    base = np.ones((N, 1))
    base[[0, 1]] = 0.0
    a, b = [3, 4, 5], [10, 11]  # head i breaks examples a, head j breaks b, the pair breaks both: additive
    singles = np.stack([flips(base, a), flips(base, b)])
    res = interaction_bootstrap(base, singles, flips(base, a + b)[None], [0], [1], accuracy_from_stats,
                                n_resamples=R, seed=SEED)
    # by hand: 38/40 baseline; deltas -3/40, -2/40, -5/40; every resample adds up the same way
    assert (res.delta_i[0], res.delta_j[0], res.delta_ij[0]) == pytest.approx((-3 / N, -2 / N, -5 / N), abs=1e-15)
    assert res.interaction[0] == 0.0 and res.ci_low[0] == 0.0 and res.ci_high[0] == 0.0
    assert res.p_value[0] == 1.0, "an interaction that is zero in every resample is no evidence of one"


def test_super_additive_case_by_hand():
    """Redundant heads: each alone breaks little, together they also break the examples in ``both``."""
    base = np.ones((N, 1))
    a, b, both = [3, 4, 5], [10, 11], list(range(20, 32))
    singles = np.stack([flips(base, a), flips(base, b)])
    pair = flips(base, a + b + both)
    counts = resample_counts(N, R, SEED)
    res = interaction_bootstrap(base, singles, pair[None], [0], [1], accuracy_from_stats, counts=counts, seed=SEED)
    # by hand: the interaction is minus the share of `both` among the examples: in the data, and per resample
    assert res.interaction[0] == pytest.approx(-len(both) / N, abs=1e-15)
    boot = -counts[:, both].sum(axis=1) / N
    lo, hi = np.sort(boot)[[R // 40, R - R // 40 - 1]]  # sacrebleu's 95% order statistics
    assert (res.ci_low[0], res.ci_high[0]) == pytest.approx((lo, hi), abs=1e-15)
    centred = np.abs(boot) - np.abs(boot).mean()
    assert res.p_value[0] == (np.sum(centred > len(both) / N + 1e-12) + 1) / (R + 1)
    assert res.p_value[0] < 0.01
    # and resamples are paired_bootstrap's: the pair's delta and its CI are that test's
    pb = paired_bootstrap(base, pair, accuracy_from_stats, counts=counts, seed=SEED)
    assert res.delta_ij[0] == pb.statistic[0]


def plain_numpy_bootstrap(base, singles, pairs, index, score, seed):
    """Sum the drawn examples' statistics with the very same draws, one resample at a time."""
    idx = np.random.default_rng(seed).choice(N, size=(R, N), replace=True)
    every = np.concatenate([base[None], singles, pairs])
    scores = np.array([[score(e[idx[r]].sum(axis=0), N) for e in every] for r in range(R)])
    full = np.array([score(e.sum(axis=0), N) for e in every])
    def inter(s):
        return np.array([(s[..., 1 + len(singles) + p] - s[..., 0]) - (s[..., 1 + i] - s[..., 0])
                         - (s[..., 1 + j] - s[..., 0]) for p, (i, j) in enumerate(index)]).T
    boot, observed = inter(scores), inter(full)
    centred = np.abs(boot) - np.abs(boot).mean(axis=0)
    p = ((centred > np.abs(observed)).sum(axis=0) + 1) / (R + 1)
    ordered = np.sort(boot, axis=0)
    return observed, ordered[R // 40], ordered[R - R // 40 - 1], p


def bleu_stats(rng, n_systems):
    """Integer sentence statistics in sacrebleu's order: sums are exact in float64 on any route."""
    ref = rng.integers(5, 20, size=(N, 1))
    hyp = np.maximum(1, ref + rng.integers(-3, 4, size=(N, 1)))
    totals = np.maximum(0, hyp - np.arange(4))
    correct = np.minimum(totals, rng.binomial(totals, 0.6 - 0.05 * np.arange(4)))
    out = np.concatenate([hyp, ref, correct, totals], axis=1).astype(np.float64)
    systems = []
    for _ in range(n_systems):
        s = out.copy()
        s[:, 2:6] = np.minimum(s[:, 6:10], rng.binomial(s[:, 2:6].astype(int), 0.85))
        systems.append(s)
    return out, np.stack(systems)


def test_bleu_bootstrap_equals_plain_numpy_with_the_same_draws():
    rng = np.random.default_rng(3)
    base, systems = bleu_stats(rng, 5)
    singles, pairs = systems[:3], systems[3:]
    index = [(0, 1), (1, 2)]
    res = interaction_bootstrap(base, singles, pairs, [i for i, _ in index], [j for _, j in index], bleu_from_stats,
                                n_resamples=R, seed=SEED)
    observed, lo, hi, p = plain_numpy_bootstrap(base, singles, pairs, index, bleu_from_stats, SEED)
    # exact: integer statistics sum to the same floats whatever the order, so both routes score the same corpora
    np.testing.assert_array_equal(res.interaction, observed)
    np.testing.assert_array_equal(res.ci_low, lo)
    np.testing.assert_array_equal(res.ci_high, hi)
    np.testing.assert_array_equal(res.p_value, p)
    assert np.all(res.interaction != 0)


def test_perplexity_bootstrap_equals_plain_numpy():
    rng = np.random.default_rng(4)
    tokens = rng.integers(5, 50, size=(N, 1)).astype(np.float64)
    def system(scale):
        return np.concatenate([tokens * rng.uniform(2.0, 3.0, size=(N, 1)) * scale, tokens], axis=1)
    base, singles, pairs = system(1.0), np.stack([system(1.05), system(1.1)]), system(1.3)[None]
    res = interaction_bootstrap(base, singles, pairs, [0], [1], perplexity_from_stats, n_resamples=R, seed=SEED)
    observed, lo, hi, p = plain_numpy_bootstrap(base, singles, pairs, [(0, 1)], perplexity_from_stats, SEED)
    # summation order: matmul of counts against float nll sums vs summing indexed rows (perplexities ~20)
    np.testing.assert_allclose([res.interaction[0], res.ci_low[0], res.ci_high[0]], [observed[0], lo[0], hi[0]],
                               rtol=1e-12)
    assert res.p_value[0] == p[0]


# -- planning -------------------------------------------------------------------------------------------
def test_pairs_all_and_within_layers():
    heads = [Head("self", layer, h) for layer in range(3) for h in range(4)]
    assert len(pairs_of(heads, "all")) == 66
    within = pairs_of(heads[::-1], "layer")
    assert len(within) == 3 * 6 and all(i.site == j.site and i < j for i, j in within)


def kinds_config(tiny_bert_dir, tiny_dev_tsv, pairs: dict) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
            "sweep": {"experiments": ["baseline", "pairs"]}, "pairs": pairs}


def test_ranked_selection_brings_its_source_into_the_run(tiny_bert_dir, tiny_dev_tsv):
    cfg = build_config(kinds_config(tiny_bert_dir, tiny_dev_tsv, {"select": "single_head", "top_k": 3}))
    names = [[k.name for k in phase.kinds] for phase in schedule(cfg)]
    assert names == [["baseline"], ["single_head"], ["pairs"]]
    other = build_config(kinds_config(tiny_bert_dir, tiny_dev_tsv, {"select": "single_head", "from_run": "r1"}))
    assert [[k.name for k in phase.kinds] for phase in schedule(other)] == [["baseline"], ["pairs"]]
    for bad, says in (({"select": "list"}, "pairs.heads"), ({"select": "all", "heads": ["self:0:0", "self:0:1"]},
                      "pairs.select list"), ({"scope": "heads"}, "pairs.scope"), ({"top_k": 1}, "pairs.top_k")):
        with pytest.raises(HeadsweepError, match=says):
            build_config(kinds_config(tiny_bert_dir, tiny_dev_tsv, {"select": "single_head", **bad}))


# -- pair masks through prefix reuse --------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.inference_mode()
def test_pair_masks_through_reuse_equal_the_plain_path(attn):
    model = tiny_classifier("bert", attn, layers=3, heads=4)
    torch.manual_seed(5)
    with torch.no_grad():  # weights larger than the default, so every pair moves the logits visibly
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 0.3)
                module.bias.normal_(0, 0.3)
    gates = HeadGates(find_sites(model))
    reuse = PrefixReuse(model, gates, classifier_layout(model, gates.sites), budget_bytes=1 << 30)
    ids, attention_mask = random_batch()
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    states = reuse.record(inputs)
    heads = gates.inventory.heads
    masks = [list(p) for p in pairs_of(heads, "layer")] + [[heads[1], heads[6]], [heads[0], heads[11]]]
    by_layer: dict[int, list[list[Head]]] = {}
    for mask in masks:
        with gates.masked(mask):
            expected = model(**inputs).logits
        # exact: one mask per pass is the plain path's arithmetic from the first gated layer on
        assert torch.equal(reuse.run(inputs, states, first_gated_layer(mask), [mask]), expected), mask
        by_layer.setdefault(first_gated_layer(mask), []).append((mask, expected))
    for layer, group in by_layer.items():
        packed = reuse.run(inputs, states, layer, [m for m, _ in group]).view(len(group), ids.shape[0], -1)
        for (mask, expected), got in zip(group, packed, strict=True):
            # summation order: several masks in one pass multiply taller matrices than one mask alone
            assert_routes_agree(got, expected, depth=3 + 1, width=64, what=(attn, mask))


# -- real runs through the CLI --------------------------------------------------------------------------
def write_config(path, model_dir, data_file, pairs: dict, experiments=("baseline", "pairs")):
    cfg = {"name": "pairs-test", "model": {"kind": "hf_classifier", "path": str(model_dir)},
           "data": {"path": str(data_file)},
           "sweep": {"experiments": list(experiments), "batch_size": 16, "flush_every": 4},
           "significance": {"n_resamples": 300, "seed": 5}, "pairs": pairs}
    path.write_text(yaml.safe_dump(cfg))
    return path


def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


def example_stats(store: ResultStore, run_id: str, eval_id: str) -> np.ndarray:
    # Example ids of a data file without an id column are its row numbers: the run's example order.
    rows = sorted((int(r["example_id"]), r["stats"]) for r in store.read("examples", run_id).to_pylist()
                  if r["eval_id"] == eval_id)
    assert [i for i, _ in rows] == list(range(40))
    return np.array([s for _, s in rows])


def check_interactions(store_dir, run_id, heads: list[str]):
    """The `interactions` rows of a run against the evaluations and examples read back independently."""
    store = ResultStore(str(store_dir))
    rows = run_query(store, f"SELECT * FROM interactions WHERE run_id = '{run_id}' ORDER BY head_i, head_j")
    rows = rows.to_pylist()
    expected_pairs = sorted((str(i), str(j)) for i, j in itertools.combinations(sorted(map(Head.parse, heads)), 2))
    assert sorted((r["head_i"], r["head_j"]) for r in rows) == expected_pairs
    con = duckdb.connect()
    evals = {e: d for e, d in con.sql(f"SELECT eval_id, delta FROM {duck(store_dir, 'evaluations')} "
                                      f"WHERE run_id = '{run_id}'").fetchall()}
    assert len(evals) == len(set(evals)), "no evaluation twice"
    for h in heads:
        assert f"single_head/{h}" in evals
    base = example_stats(store, run_id, "baseline")
    singles = np.stack([example_stats(store, run_id, f"single_head/{h}") for h in heads])
    pairs = np.stack([example_stats(store, run_id, r["eval_id"]) for r in rows])
    position = {h: n for n, h in enumerate(heads)}
    again = interaction_bootstrap(base, singles, pairs, [position[r["head_i"]] for r in rows],
                                  [position[r["head_j"]] for r in rows], accuracy_from_stats, n_resamples=300, seed=5)
    adjusted = adjust_pvalues(again.p_value, "bh")
    for n, r in enumerate(rows):
        d_i, d_j, d_ij = evals[f"single_head/{r['head_i']}"], evals[f"single_head/{r['head_j']}"], evals[r["eval_id"]]
        # other: scores summed by the worker and from stored statistics; accuracies k/40, abs 1e-12
        assert (r["delta_i"], r["delta_j"], r["delta_ij"]) == pytest.approx((d_i, d_j, d_ij), abs=1e-12)
        assert r["interaction"] == pytest.approx(d_ij - d_i - d_j, abs=1e-12)
        assert r["excess_harm"] == -r["interaction"]  # accuracy: higher is better
        assert (r["p_value"], r["ci_low"], r["ci_high"]) == (again.p_value[n], again.ci_low[n], again.ci_high[n])
        assert r["p_adjusted"] == adjusted[n] and r["significant"] == (adjusted[n] < 0.01)
        assert r["n_resamples"] == 300 and r["seed"] == 5 and r["test"] == "paired_bootstrap"
        assert r["same_layer"] == (r["layer_i"] == r["layer_j"] and r["attention_i"] == r["attention_j"])
    assert any(r["delta_ij"] != 0 for r in rows), "the pairs should move the accuracy"  # other: the run can fail
    sig = con.sql(f"SELECT eval_id FROM {duck(store_dir, 'significance')} WHERE run_id = '{run_id}' "
                  "AND eval_id LIKE 'pairs/%'").fetchall()
    assert len({e for (e,) in sig}) == len(rows)
    return rows, evals


def cli_run(tmp_path, ray_address, config, workers: int):
    store = tmp_path / "store"
    proc = run_cli("run", str(config), f"sweep.workers={workers}", "--store", str(store), "--address", ray_address,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store, proc.stdout.strip().splitlines()[-1], proc.stderr


def test_listed_heads_plan_their_single_head_evaluations(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    heads = ["self:0:1", "self:0:3", "self:1:2"]
    config = write_config(tmp_path / "pairs.yaml", tiny_bert_dir, tiny_dev_tsv, {"select": "list", "heads": heads})
    # one worker (one actor start fewer): pairs spread over two workers are test_top_heads_by_single_head_delta's
    store, run_id, stderr = cli_run(tmp_path, ray_address, config, workers=1)
    assert "pairs: 3 pairs among 3 heads" in stderr
    rows, evals = check_interactions(store, run_id, heads)
    assert sorted(e for e in evals if e.startswith("single_head/")) == sorted(f"single_head/{h}" for h in heads)
    # the report draws the heads x heads matrix: 3 heads, one pair per off-diagonal cell
    page = write_report(ResultStore(str(store)), [run_id], tmp_path / "report")
    with Image.open(page.parent / f"{run_id}-interactions-self.png") as png:
        png.load()  # decodes every pixel
        assert png.format == "PNG" and png.size[0] > 300
    assert "Pairwise interactions" in page.read_text()


def test_top_heads_by_single_head_delta(tmp_path, ray_address, tiny_bert_dir, tiny_dev_tsv):
    config = write_config(tmp_path / "pairs.yaml", tiny_bert_dir, tiny_dev_tsv,
                          {"select": "single_head", "top_k": 3, "scope": "all"})
    store, run_id, stderr = cli_run(tmp_path, ray_address, config, workers=2)
    assert "pairs: 3 pairs at most" in stderr
    con = duckdb.connect()
    singles = con.sql(f"SELECT attention, layer, head, delta FROM {duck(store, 'evaluations')} "
                      "WHERE experiment = 'single_head'").fetchall()
    assert len(singles) == 8  # the whole grid, once: single_head joined the run and pairs reused its evaluations
    ranked = sorted(singles, key=lambda r: (-abs(r[3]), r[1], r[2]))[:3]
    check_interactions(store, run_id, [f"{a}:{layer}:{h}" for a, layer, h, _ in ranked])


def test_more_pairs_than_max_pairs_is_refused_before_anything_is_written(tmp_path, ray_address, tiny_bert_dir,
                                                                         tiny_dev_tsv):
    config = write_config(tmp_path / "pairs.yaml", tiny_bert_dir, tiny_dev_tsv, {"select": "all", "max_pairs": 5})
    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: error:")]
    assert errors == ["headsweep: error: pairs: 28 pairs is more than pairs.max_pairs=5 (one evaluation each); "
                      "raise pairs.max_pairs, or select fewer heads (pairs.top_k, pairs.heads, pairs.scope layer)"]
    assert not store.exists() or not list(store.rglob("*.parquet")), "nothing is written"
