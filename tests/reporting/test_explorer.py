"""The explorer's data without a browser: ``Store.head`` against SQL over the store, the stored inputs against the
data file, attention patterns against the model's own weights, and the report's bad input (one line, exit 2,
nothing written; a model that moved is one warning and the page is still written; a run without per-example rows
and a store from before stored inputs say so in the page)."""

from __future__ import annotations

import html
import json
import shutil

import pytest
import torch
from conftest import error_line, run_cli
from explorer_support import WORST_EXAMPLES_SQL, bench_module, mean_lm_store
from small_store import small_store

import headsweep
from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.reporting.report import write_report

synthetic = bench_module("synthetic_store")


@pytest.fixture(scope="module")
def small(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    store, run_id, checkpoints = small_store(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv)
    return str(store), run_id, checkpoints


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic") / "store"
    runs = synthetic.build_store(root, 2, 4, 40, levels=[0.0, 0.5, 1.0])
    return root, runs


def most_harmful(store: headsweep.Store, run_id: str, checkpoint: str | None) -> str:
    return store.sql("SELECT name FROM heads WHERE run_id = ? AND checkpoint IS NOT DISTINCT FROM ? "
                     "ORDER BY harm DESC, name LIMIT 1", [run_id, checkpoint]).fetchall()[0][0]


def test_head_frame_equals_sql_and_inputs_equal_the_data_file(small, tiny_dev_tsv):
    root, run_id, checkpoints = small
    with headsweep.open_store(root) as store:
        name = most_harmful(store, run_id, checkpoints[0])
        frame = store.head(name, run=run_id, checkpoint=checkpoints[0])
        worst = store.sql(WORST_EXAMPLES_SQL, [run_id, f"ckpt0/single_head/{name}", "ckpt0/baseline"]).fetchall()
        inputs = dict(store.sql("SELECT example_id, input FROM inputs WHERE run_id = ?", [run_id]).fetchall())
    assert worst, "the most harmful head changes no example: the small store no longer tests this"
    harmed = frame[frame.harm > 0]
    assert list(harmed.example_id) == [w[0] for w in worst]
    assert list(harmed.output) == [w[2] for w in worst] and list(harmed.baseline_output) == [w[3] for w in worst]
    assert (frame.harm.diff().dropna() <= 0).all()  # most harmed first
    # one row per example, the input stored once per run equal to the data file's text
    lines = [line.split("\t") for line in tiny_dev_tsv.read_text().splitlines()[1:]]
    assert len(frame) == len(inputs) == len(lines)
    assert sorted(inputs.values()) == sorted(text for text, _ in lines)
    assert all(frame.input == [inputs[e] for e in frame.example_id])


def test_head_refuses_unknown_run_head_and_missing_checkpoint(small):
    root, run_id, checkpoints = small
    with headsweep.open_store(root) as store:
        with pytest.raises(HeadsweepError, match="no run 'nope'"):
            store.head("self:0:0", run="nope", checkpoint=checkpoints[0])
        with pytest.raises(HeadsweepError, match=r"no head 'self:9:9' in run .* names are attention:layer:head"):
            store.head("self:9:9", run=run_id, checkpoint=checkpoints[0])
        with pytest.raises(HeadsweepError, match="swept 2 checkpoints: name one"):
            store.head("self:0:0", run=run_id)


def test_attention_patterns_are_the_models_own_weights(small, tiny_dev_tsv):
    """``Store.attention`` against BERT's own eager attention weights on the example's text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root, run_id, checkpoints = small
    with headsweep.open_store(root) as store:
        name = most_harmful(store, run_id, checkpoints[0])
        patterns = store.attention(name, run=run_id, examples=2, checkpoint=checkpoints[0])
        inputs = dict(store.sql("SELECT example_id, input FROM inputs WHERE run_id = ?", [run_id]).fetchall())
    assert len(patterns) == 2
    _, layer, head = name.split(":")
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints[0], attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[0])
    for p in patterns:
        encoded = tokenizer(inputs[p["example_id"]], return_tensors="pt")
        with torch.no_grad():
            expected = model(**encoded, output_attentions=True).attentions[int(layer)][0, int(head)]
        assert p["queries"] == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
        assert torch.allclose(torch.as_tensor(p["weights"]), expected, atol=1e-5)


def test_report_into_a_file_or_an_unwritable_place_is_one_line(synth, tmp_path):
    root, runs = synth
    afile = tmp_path / "report.html"
    afile.write_text("mine")
    proc = run_cli("report", runs[0], "--store", str(root), "--out", str(afile))
    assert proc.returncode == 2
    assert "is a file" in error_line(proc.stderr) and afile.read_text() == "mine"
    with pytest.raises(HeadsweepError, match="^cannot create report folder /proc/headsweep-report: "):
        write_report(ResultStore(str(root)), [runs[0]], "/proc/headsweep-report")  # not writable, even for root
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # nothing half-written beside it


def test_attention_with_a_moved_model_is_one_warning_and_the_page(synth, tmp_path):
    root, runs = synth
    out = tmp_path / "r"
    proc = run_cli("report", runs[0], "--store", str(root), "--out", str(out), "--attention")
    assert proc.returncode == 0, proc.stderr
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")]
    assert len(warnings) == 1 and "/nonexistent/synthetic" in warnings[0]
    page = (out / "index.html").read_text()
    assert "/nonexistent/synthetic" in page and "fig-" + runs[0] + "-deltas" in page
    assert (out / "plotly.min.js").is_file()


def test_run_without_example_rows_and_store_before_inputs(synth, tmp_path):
    root, runs = synth
    bare = tmp_path / "bare"
    shutil.copytree(root, bare)
    shutil.rmtree(bare / "examples")
    shutil.rmtree(bare / "inputs")
    page = write_report(ResultStore(str(bare)), [runs[0]], tmp_path / "r").read_text()
    assert "This store predates stored inputs" in page
    start = page.index('class="hs-heads"')
    heads = json.loads(page[page.index(">", start) + 1 : page.index("</script>", start)].replace("<\\/", "</"))
    assert set(heads) == {f"self:{layer}:{h}" for layer in range(2) for h in range(4)}
    assert all("stored no per-example rows" in entry["html"] for entry in heads.values())


def test_disagreement_ranks_only_heads_distinguishable_from_noise():
    """The cheap-vs-exact comparison: heads whose exact effect is within noise (not significant, interval across
    zero) are left out however their ties would rank; ties share a rank; orders that agree name nobody."""
    from headsweep.sweep.reporting.plots import disagreement

    def head(i, importance, harm, significant=False, ci=(-1.0, 1.0)):
        return {"name": f"self:0:{i}", "importance": importance, "harm": harm, "significant": significant,
                "ci_low": ci[0], "ci_high": ci[1]}

    heads = [head(0, 5.0, 0.5, True), head(1, 4.0, 0.4, ci=(0.1, 0.7)), head(2, 3.0, 0.3, True),
             head(3, 0.1, 0.9, True), head(4, 2.0, 0.0), head(5, 9.0, 0.0), head(6, 0.05, -0.2, ci=(-0.3, -0.1))]
    found = disagreement(heads, "importance", 2)
    # self:0:4 and self:0:5 (zero harm, intervals across zero) are not compared: self:0:5's #1 by importance
    # against a tie of zeros would have been the "largest disagreement"
    assert [h["name"] for h in found.compared] == ["self:0:0", "self:0:1", "self:0:2", "self:0:3", "self:0:6"]
    ranks = {h["name"]: (h["rank_cheap"], h["rank_harm"]) for h in found.compared}
    assert ranks == {"self:0:0": (1, 2), "self:0:1": (2, 3), "self:0:2": (3, 4), "self:0:3": (4, 1),
                     "self:0:6": (5, 5)}
    assert [h["name"] for h in found.named] == ["self:0:3", "self:0:0"]  # 3 apart, then 1 (ties by name)
    assert "rank_cheap" not in heads[5]
    tied = disagreement([head(0, 2.0, 0.5, True), head(1, 1.0, 0.5, True)], "importance", 5)
    assert [(h["rank_cheap"], h["rank_harm"]) for h in tied.compared] == [(1, 1), (2, 1)]
    agree = disagreement([head(0, 2.0, 0.5, True), head(1, 1.0, 0.2, True), head(2, 3.0, 0.0)], "importance", 5)
    assert len(agree.compared) == 2 and agree.named == []
    assert disagreement([head(0, 2.0, 0.0), head(1, 1.0, 0.01)], "importance", 5).compared == []


def test_label_slots_keep_labels_apart_inside_the_axis():
    from headsweep.sweep.reporting.plots import label_slots

    ys = [0.0, 0.01, 0.02, 0.0, 5.0, 10.0]
    slots = label_slots(ys, -1.0, 10.0, 1.0)
    assert all(-0.5 <= s <= 9.5 for s in slots)
    assert all(abs(a - b) >= 1.0 - 1e-12 for i, a in enumerate(slots) for b in slots[i + 1:])
    assert slots[4] == 5.0 and slots[5] == 9.5  # a label that can sit at its point does; the top one stays inside


def test_token_losses_equal_the_weight_surgery_models(tmp_path, one_thread):
    """A causal LM window's tokens whose loss a head's removal raises most (recomputed for the drill-down), against
    the independent route: the model whose output projection has the head's input columns zeroed."""
    import torch.nn.functional as F
    from tiny_models import lm_text, save_tiny_causal_lm, zeroed_output_columns
    from transformers import AutoModelForCausalLM

    from headsweep.sweep.reporting.drill_scores import TOP_TOKENS, token_losses
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama_8q2kv")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(lm_text(120, seed=4))
    adapter = CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="eager"),
                              CausalLMData(path=str(corpus), window=16, add_bos=True), RuntimeOptions(batch_size=4))
    [found] = token_losses(adapter, [("self:1:3", "w1", 1)])
    assert len(found.tokens) == TOP_TOKENS
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    surgery = zeroed_output_columns(reference, [Head.parse("self:1:3")])
    ids = adapter.inputs[1:2]
    with torch.no_grad():
        base = F.cross_entropy(reference(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
        masked = F.cross_entropy(surgery(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
    rise = torch.where(adapter.scored[1], masked - base, torch.tensor(float("-inf")))
    assert [p for p, *_ in found.tokens] == (torch.argsort(rise, descending=True)[:TOP_TOKENS] + 1).tolist()
    for position, _, nll_base, nll_masked in found.tokens:
        assert (nll_base, nll_masked) == pytest.approx((float(base[position - 1]), float(masked[position - 1])),
                                                       rel=1e-4, abs=1e-5)
    assert found.window_nll == pytest.approx((float((base * adapter.scored[1]).sum()),
                                              float((masked * adapter.scored[1]).sum())), rel=1e-5)


@pytest.fixture(scope="module")
def mean_lm_run(tmp_path_factory, ray_address):
    """A mean-ablation perplexity sweep of a tiny Llama-style model (shared with the browser tests)."""
    return mean_lm_store(tmp_path_factory, ray_address)


def test_mean_ablation_token_losses_sum_to_the_stored_window_nll(mean_lm_run, tmp_path):
    """Per-token losses under mean ablation (the run's stored means installed as the fill): the worst head's
    drill-down lists its windows' tokens, and each shown window's recomputed NLL, summed over its scored tokens,
    equals the window NLL the run stored (``examples.stats[1]``) for the baseline and for the head's mask."""
    from headsweep.results.query import connect
    from headsweep.sweep.reporting.attention_maps import run_patterns
    from headsweep.sweep.reporting.drill_scores import TokenLosses

    store, run_id = mean_lm_run
    page = write_report(ResultStore(str(store)), [run_id], tmp_path / "r", attention=True).read_text()
    start = page.index('class="hs-heads"')
    heads = json.loads(page[page.index(">", start) + 1 : page.index("</script>", start)].replace("<\\/", "</"))
    con = connect(ResultStore(str(store)))
    try:
        (worst,), = con.sql("SELECT name FROM heads WHERE run_id = ? ORDER BY harm DESC, name LIMIT 1",
                            params=[run_id]).fetchall()
        assert "the tokens whose loss rises most" in heads[worst]["html"]
        run = dict(zip(("run_id", "metric", "config", "ablation"), con.sql(
            "SELECT run_id, metric, config, ablation FROM runs WHERE run_id = ?", params=[run_id]).fetchall()[0],
            strict=True))
        assert run["ablation"] == "mean"
        losses: list = []
        run_patterns(con, run, None, [worst], losses=losses)
        stored = {(experiment, example): stats[0] for experiment, example, stats in con.sql(
            "SELECT e.experiment, x.example_id, x.stats FROM examples x JOIN evaluations e USING (run_id, eval_id) "
            "WHERE x.run_id = ? AND (e.experiment = 'baseline' OR e.attention || ':' || e.layer || ':' || e.head = ?)",
            params=[run_id, worst]).fetchall()}
    finally:
        con.close()
    windows = [t for t in losses if isinstance(t, TokenLosses)]
    assert windows, "the worst head harms no window: the run no longer tests this"
    for t in windows:
        assert t.window_nll == pytest.approx((stored[("baseline", t.example_id)],
                                              stored[("single_head", t.example_id)]), rel=1e-6)
        assert t.window_nll[1] > t.window_nll[0]  # a window the head's removal harms


def test_a_per_example_fill_is_one_line_in_the_drilldown(mean_lm_run):
    """Resample (and activation patching) fill a head from donors drawn over the whole evaluation set: nothing is
    recomputed, and each shown head's drill-down says why in one line."""
    from headsweep.results.query import connect
    from headsweep.sweep.reporting.drill_scores import NotRecomputed, run_fill
    from headsweep.sweep.reporting.explorer import attention_extras

    store, run_id = mean_lm_run
    con = connect(ResultStore(str(store)))
    try:
        config, = con.sql("SELECT config FROM runs WHERE run_id = ?", params=[run_id]).fetchall()[0]
        assert run_fill(con, {"run_id": run_id, "config": config, "ablation": "mean"}, None).note is None
        data = json.loads(config)
        data["sweep"]["ablation"] = "resample"
        fill = run_fill(con, {"run_id": run_id, "config": json.dumps(data), "ablation": "resample"}, None)
    finally:
        con.close()
    assert fill.fill is None and fill.note is not None and "\n" not in fill.note
    assert fill.note.startswith("Not recomputed under resample ablation")
    extras = attention_extras([], [NotRecomputed("self:0:1", fill.note)] * 2)
    assert extras["self:0:1"]["html"].count(html.escape(fill.note)) == 1
