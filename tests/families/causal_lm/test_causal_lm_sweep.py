"""A perplexity sweep of a tiny Llama-style GQA model (8 query / 2 key-value heads) through the real CLI, read
back with DuckDB: statistics equal the model's own loss, bootstrap p-values equal a plain numpy bootstrap on the
stored statistics, the views and the report follow perplexity's direction; and bad input is one line, exit 2."""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from tiny_models import build_lm_tokenizer, lm_text, save_tiny_causal_lm
from tolerances import assert_routes_agree

WINDOW = 16
N_RESAMPLES = 200
SEED = 5


def write_config(path, model_dir, data_file, model=None, data=None, **sweep):
    cfg = {
        "name": "lm-sweep",
        "model": {"kind": "hf_causal_lm", "path": str(model_dir), "attn_implementation": "sdpa", **(model or {})},
        "data": {"path": str(data_file), "window": WINDOW, **(data or {})},
        "sweep": {"experiments": ["baseline", "single_head", "all_but_one", "kv_group"], "batch_size": 8, **sweep},
        "significance": {"n_resamples": N_RESAMPLES, "seed": SEED},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    model_dir = save_tiny_causal_lm(tmp / "tiny-llama-gqa", "llama_8q2kv")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(300, seed=11))
    return tmp, model_dir, corpus


@pytest.fixture(scope="module")
def lm_run(lm_files, ray_address):
    tmp, model_dir, corpus = lm_files
    config = write_config(tmp / "sweep.yaml", model_dir, corpus)
    store = tmp / "store"
    proc = run_cli("run", str(config), "sweep.workers=2", "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store, proc.stdout.strip().splitlines()[-1]


def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


def stored_stats(con, store, run_id) -> dict[str, np.ndarray]:
    rows = con.sql(f"SELECT eval_id, example_id, stats FROM {duck(store, 'examples')} WHERE run_id = '{run_id}' "
                   "ORDER BY eval_id, CAST(substr(example_id, 2) AS INTEGER)").fetchall()
    by_eval: dict[str, list] = {}
    for eval_id, _, stats in rows:
        by_eval.setdefault(eval_id, []).append(stats)
    return {k: np.array(v, dtype=np.float64) for k, v in by_eval.items()}


def test_evaluations_with_duckdb(lm_run):
    store, run_id = lm_run
    con = duckdb.connect()
    rows = con.sql(f"SELECT experiment, layer, head, heads_masked, metric, score, baseline_score, delta, n_examples, "
                   f"eval_id FROM {duck(store, 'evaluations')} WHERE run_id = '{run_id}' "
                   "ORDER BY experiment, layer, head, eval_id").fetchall()
    counts: dict[str, int] = {}
    for experiment, layer, head, masked, metric, score, base, delta, n, eval_id in rows:
        counts[experiment] = counts.get(experiment, 0) + 1
        assert metric == "perplexity" and n == 18 and score > 1.0
        assert delta == pytest.approx(score - base, abs=1e-9)  # other: the same float64 subtraction, read back
        if experiment == "single_head":
            assert masked == [f"self:{layer}:{head}"]
        if experiment == "all_but_one":
            assert sorted(masked) == sorted(f"self:{layer}:{h}" for h in range(8) if h != head)
        if experiment == "kv_group":  # the query heads of one key/value head, named by the group
            group = int(eval_id.rsplit(":kv", 1)[1])
            assert eval_id == f"kv_group/self:{layer}:kv{group}" and head is None
            assert masked == [f"self:{layer}:{h}" for h in range(4 * group, 4 * group + 4)]
    assert counts == {"baseline": 1, "single_head": 16, "all_but_one": 16, "kv_group": 4}
    # Removing heads of a random model mostly raises perplexity: positive deltas mean harm here.
    assert max(r[7] for r in rows if r[0] == "all_but_one") > 0


def test_stored_statistics_equal_the_models_loss(lm_run, lm_files):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store, run_id = lm_run
    _, model_dir, corpus = lm_files
    con = duckdb.connect()
    stats = stored_stats(con, store, run_id)
    (base_id, base_score), = con.sql(f"SELECT eval_id, score FROM {duck(store, 'evaluations')} "
                                     "WHERE experiment = 'baseline'").fetchall()
    # The convention, written out independently: tokens without special tokens, windows of 16 without overlap,
    # the last partial one dropped, each scoring its tokens after the first.
    ids = AutoTokenizer.from_pretrained(model_dir)(corpus.read_text(), add_special_tokens=False)["input_ids"]
    windows = torch.tensor([ids[s : s + WINDOW] for s in range(0, len(ids) - WINDOW + 1, WINDOW)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        nll = np.array([float(model(input_ids=w[None], labels=w[None]).loss) * (WINDOW - 1) for w in windows])
    base = stats[base_id]
    assert base[:, 1].tolist() == [WINDOW - 1] * len(windows)  # exact: token counts
    # summation order: SDPA in batches of 8 against eager one window at a time (float32)
    assert_routes_agree(base[:, 0], nll, depth=2 + 1, width=WINDOW * 64)
    # other: exp of a float64 ratio of the same stored sums
    assert base_score == pytest.approx(np.exp(base[:, 0].sum() / base[:, 1].sum()), rel=1e-12)
    (facts,) = con.sql(f"SELECT facts FROM {duck(store, 'runs')}").fetchall()[0]
    facts = json.loads(facts)
    assert facts["mean_nll_nats"] == pytest.approx(np.log(base_score), rel=1e-12)  # other: log of exp
    assert facts["kv_groups"]["self:0"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (facts["window"], facts["stride"], facts["add_bos"]) == (WINDOW, WINDOW, False)
    assert facts["kv_group"] == "masks every query head of each key/value head"


def test_the_run_reuses_prefixes_and_stores_what_the_plain_path_computes(lm_run, lm_files):
    """The run's prefix reuse (the default), reported in its facts; the baseline's and every single head's stored
    per-window NLL sums equal the plain path's (``sweep.reuse: false``: the whole gated model per mask, itself
    checked against weight surgery in test_causal_lm_gates.py): test_causal_lm_reuse.py's in-process checks, end to
    end through the sweep."""
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    store, run_id = lm_run
    _, model_dir, corpus = lm_files
    con = duckdb.connect()
    (facts,) = con.sql(f"SELECT facts FROM {duck(store, 'runs')} WHERE run_id = '{run_id}'").fetchall()[0]
    assert json.loads(facts)["reuse"].startswith("prefix: masks start at their first gated layer")
    rows = con.sql(f"SELECT e.heads_masked, x.example_id, x.stats FROM {duck(store, 'evaluations')} e JOIN "
                   f"{duck(store, 'examples')} x USING (run_id, eval_id) WHERE run_id = '{run_id}' AND "
                   "e.experiment IN ('baseline', 'single_head')").fetchall()
    plain = CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="sdpa"),
                            CausalLMData(path=str(corpus), window=WINDOW),
                            RuntimeOptions(batch_size=8, reuse=False, masks_per_batch=1))
    masks = [[]] + [[h] for h in plain.gates.inventory.heads]
    stored = {(tuple(m), ex): s for m, ex, s in rows}
    assert len(stored) == len(masks) * len(plain.windows) == 17 * 18
    width = max(int(plain.model.config.intermediate_size), WINDOW)  # the longest inner product
    for mask, row in zip(masks, plain.nll(masks), strict=True):
        got = [stored[(tuple(str(h) for h in mask), f"w{i}")][0] for i in range(len(plain.windows))]
        # summation order: the sweep packs several masks per pass (automatic masks_per_batch) and starts each at
        # its first gated layer; 2 layers plus the LM head
        assert_routes_agree(np.array(got), row, depth=2 + 1, width=width, dtype=torch.float32, what=mask)


def test_bootstrap_p_values_equal_a_plain_numpy_bootstrap(lm_run):
    store, run_id = lm_run
    con = duckdb.connect()
    stats = stored_stats(con, store, run_id)
    (base_id,), = con.sql(f"SELECT eval_id FROM {duck(store, 'evaluations')} WHERE experiment = 'baseline'").fetchall()
    tests = con.sql(f"SELECT eval_id, test, p_value, statistic FROM {duck(store, 'significance')} "
                    f"WHERE run_id = '{run_id}'").fetchall()
    assert {t for _, t, _, _ in tests} == {"paired_bootstrap", "paired_ttest"}
    base = stats[base_id]
    n = len(base)
    # The same resample indices as sacrebleu (and headsweep) draw for this seed, applied plainly.
    idx = np.random.default_rng(SEED).choice(n, size=(N_RESAMPLES, n), replace=True)

    def ppl(s):
        return np.exp(s[:, 0].sum() / s[:, 1].sum())

    checked = 0
    for eval_id, test, p, statistic in tests:
        if test != "paired_bootstrap":
            continue
        system = stats[eval_id]
        observed = ppl(system) - ppl(base)
        deltas = np.array([ppl(system[i]) - ppl(base[i]) for i in idx])
        centred = np.abs(deltas) - np.abs(deltas).mean()
        expected = (np.sum(centred > abs(observed)) + 1) / (N_RESAMPLES + 1)
        # other: float64 throughout; one count of the p-value's numerator in a near-tie at most
        assert abs(p - expected) <= 1.0 / (N_RESAMPLES + 1) + 1e-12, eval_id
        assert statistic == pytest.approx(observed, rel=1e-9, abs=1e-12)
        checked += 1
    assert checked == 36


def test_views_and_report_follow_the_direction(lm_run, tmp_path):
    store, run_id = lm_run
    proc = run_cli("query", f"SELECT layer, best_head, score, worst_delta FROM layers WHERE run_id = '{run_id}' "
                   "ORDER BY layer", "--store", str(store), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    layers = [json.loads(line) for line in proc.stdout.splitlines()]
    con = duckdb.connect()
    for row in layers:
        alone = con.sql(f"SELECT head, score, delta FROM {duck(store, 'evaluations')} WHERE experiment = "
                        f"'all_but_one' AND layer = {row['layer']} ORDER BY score, head").fetchall()
        assert (row["best_head"], row["score"]) == alone[0][:2]  # the lowest perplexity is the best kept head
        assert row["worst_delta"] == max(d for _, _, d in alone)  # the worst: perplexity up most
    proc = run_cli("query", f"SELECT name, delta, harm FROM heads WHERE run_id = '{run_id}' ORDER BY harm DESC",
                   "--store", str(store), "--format", "json")
    heads = [json.loads(line) for line in proc.stdout.splitlines()]
    assert all(h["harm"] == h["delta"] for h in heads)
    assert heads[0]["delta"] == max(h["delta"] for h in heads)
    out = tmp_path / "report"
    proc = run_cli("report", run_id, "--store", str(store), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    page = (out / "index.html").read_text()
    assert "lower is better" in page and "lowest perplexity" in page
    # The table of heads whose removal hurts most starts with the largest perplexity increase.
    first = page.split("Heads whose removal hurts most")[1].split("<td")[1]
    assert heads[0]["name"] in first


# -- bad input ---------------------------------------------------------------------------------------------

def fail(tmp_path, ray_address, config, message):
    from headsweep.results.store import ResultStore

    store = tmp_path / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("headsweep: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""
    assert ResultStore(str(store)).read("runs").num_rows == 0
    assert ResultStore(str(store)).read("evaluations").num_rows == 0


@pytest.mark.slow  # five CLI runs; each message is the loader's own
def test_bad_input_is_one_line(tmp_path, lm_files, ray_address):
    from transformers import T5Config, T5ForConditionalGeneration

    _, model_dir, corpus = lm_files
    short = tmp_path / "short.txt"
    short.write_text("the cat sees a dog\n")
    fail(tmp_path, ray_address, write_config(tmp_path / "a.yaml", model_dir, short),
         "is too short: 5 tokens, fewer than one window of 16 text tokens")
    fail(tmp_path, ray_address, write_config(tmp_path / "b.yaml", model_dir, corpus, data={"window": 65}),
         "data.window 65 is above the model's maximum of 64 positions")
    fail(tmp_path, ray_address, write_config(tmp_path / "c.yaml", model_dir, corpus,
                                             model={"tokenizer": str(tmp_path / "no-tokenizer")}),
         "tokenizer directory not found")
    bare = save_tiny_causal_lm(tmp_path / "bare", "llama_8q2kv", tokenizer=False)
    fail(tmp_path, ray_address, write_config(tmp_path / "d.yaml", bare, corpus), "no tokenizer in")
    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=30, d_model=16, d_kv=4, num_heads=4, d_ff=32,
                                        num_layers=1)).save_pretrained(t5)
    build_lm_tokenizer().save_pretrained(t5)  # refused for what it is, not for a missing tokenizer
    fail(tmp_path, ray_address, write_config(tmp_path / "e.yaml", t5, corpus),
         "holds an encoder-decoder model (T5ForConditionalGeneration): model.kind hf_causal_lm takes")


def test_kv_group_on_a_model_without_grouped_heads_says_so():
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.experiments.kv_group import KV_GROUP, UNGROUPED
    from headsweep.sweep.run.context import Context
    from headsweep.workers.core.family import DatasetInfo
    from headsweep.workers.core.heads import HeadInventory, LayerShape

    cfg = build_config({"model": {"kind": "hf_classifier", "path": "m"}, "data": {"path": "d.tsv"},
                        "sweep": {"experiments": ["baseline", "kv_group"]}})
    info = DatasetInfo("m", "d", "accuracy", ["correct"], ["0"], ["x"],
                       HeadInventory([LayerShape("self", 0, 3), LayerShape("self", 1, 3)]))
    ctx = Context(cfg, info, pool=None, store=None, run_id="r")
    KV_GROUP.validate(ctx)
    assert info.facts["kv_group"] == UNGROUPED
    units = KV_GROUP.plan(ctx)
    assert [u.eval_id for u in units][:2] == ["kv_group/self:0:kv0", "kv_group/self:0:kv1"]
    assert [[str(h) for h in u.masked] for u in units] == [[f"self:{layer}:{h}"] for layer in (0, 1) for h in range(3)]
