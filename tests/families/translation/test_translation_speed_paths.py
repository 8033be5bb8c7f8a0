"""Translation speed paths against fairseq alone: token batching, fairseq's fused and
beamable attention, and the loss pass as an option.

The independent route is tests/tiny_fairseq.py's: a model freshly loaded by fairseq's own loader,
the masked heads' output-projection columns set to zero, decoded by fairseq's ``SequenceGenerator``
(stock: fused attention in the encoder, encoder-decoder keys per beam), no headsweep code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import error_line, run_cli
from tiny_fairseq import BOUND_SHAPE, fairseq_load, plain_beam_search, zero_heads
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.results.store import ResultStore
from headsweep.sweep.configuration.config import load_config
from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.adapter import batch_tokens, load_translation, token_batches
from headsweep.workers.families.fairseq_translation.config import DEFAULT_MAX_TOKENS, TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.config import TranslationRuntime as RuntimeOptions

BEAM, MAX_LEN_B = 3, 24
# A budget that cuts the 40 test sentences (8 to 15 tokens with EOS) into batches of 1 to 5 sentences.
SMALL_BUDGET = 40

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny fairseq model (conftest.trained_tiny_fairseq: read, never changed)."""
    return trained_tiny_fairseq


def make_task(tiny, **runtime):
    model_cfg = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=BEAM,
                                 max_len_b=MAX_LEN_B)
    data_cfg = TranslationData(data_bin=str(tiny.data.data_bin), split="test")
    return load_translation(model_cfg, data_cfg, RuntimeOptions(**runtime))


@pytest.fixture(scope="module")
def fresh(tiny):
    """A clean model (no hooks, fused path on) from fairseq's loader, never used for generation."""
    return fairseq_load(tiny.checkpoint, tiny.data.data_bin)


@pytest.fixture(scope="module")
def masks(tiny):
    inventory = make_task(tiny).describe().inventory
    several = [[Head("enc_self", 0, 1), Head("enc_self", 1, 3)], [Head("enc_self", 1, 0), Head("dec_self", 0, 2)],
               [Head("enc_dec", 0, 1), Head("dec_self", 1, 3)]]
    return [[]] + [[h] for h in inventory.heads] + several


@pytest.fixture(scope="module")
def reference(tiny, fresh, masks):
    """fairseq's beam search of a zeroed-column copy per mask: [mask][sentence] (tokens, score)."""
    model, ftask = fresh
    sources = make_task(tiny).examples.source
    return [plain_beam_search(zero_heads(copy.deepcopy(model), mask), ftask, sources, BEAM, MAX_LEN_B)
            for mask in masks]


def assert_decodes_equal_reference(task, masks, reference, what):
    changed = 0
    for mask, hyps, expected in zip(masks, task.translate(masks), reference, strict=True):
        for i, (hyp, (tokens, score)) in enumerate(zip(hyps, expected, strict=True)):
            assert hyp.tokens.tolist() == tokens, f"{what} {mask}: sentence {i} differs"
            # summation order: other batch shapes, packed masks, the cached encoder, unfused gated modules
            assert_routes_agree(hyp.score, score, **BOUND_SHAPE, what=f"{what} {mask}: sentence {i}")
        changed += any(h != r for h, r in zip(expected, reference[0], strict=True))
    # The route can fail: most ablations change some translation.
    assert changed >= len(masks) // 2


# -- token batching ---------------------------------------------------------------------------
def test_token_batches_follow_fairseqs_rule():
    lengths = [3, 3, 4, 5, 9, 30]
    # 3x4 <= 18 (4x5 is not), 2x9 <= 18, and a sentence over the budget alone
    assert token_batches(range(6), lengths, 32, 18) == [[0, 1, 2], [3, 4], [5]]
    assert token_batches(range(6), lengths, 4, 0) == [[0, 1, 2, 3], [4, 5]]  # max_tokens 0: by sentences


def test_token_budget_batches_cover_every_sentence_once(tiny):
    task = make_task(tiny, max_tokens=SMALL_BUDGET)
    sizes = [len(b["id"]) for b in task.batches]
    assert len(set(sizes)) > 2, "the budget should give batches of several sizes"
    assert all(batch_tokens(b) <= SMALL_BUDGET or len(b["id"]) == 1 for b in task.batches)
    ids = [i for b in task.batches for i in b["id"].tolist()]
    assert sorted(ids) == list(range(len(task.examples.ids)))
    longest = [int(b["net_input"]["src_lengths"].max()) for b in task.batches]
    assert longest == sorted(longest), "sentences go into batches sorted by length"
    assert task.describe().facts["batching"].startswith(f"at most {SMALL_BUDGET} source tokens")


def test_masks_fill_the_budget_a_short_batch_leaves(tiny):
    task = make_task(tiny, max_tokens=SMALL_BUDGET)
    for sample in task.batches:
        # The memory budget holds thousands of tiny sentences: the token budget decides.
        assert task.masks_per_forward(sample) == max(1, SMALL_BUDGET // batch_tokens(sample))
    assert max(task.masks_per_forward(b) for b in task.batches) > 1
    assert make_task(tiny, max_tokens=SMALL_BUDGET, masks_per_batch=3).masks_per_forward(task.batches[0]) == 3


def spanning(masks: list[list[Head]]) -> list[int]:
    """Indices of the masks a variant of the small-budget path decodes: none, one head of each attention type in
    each layer (the head index cycling, so every index is among them) and the several-head masks."""
    singles = [i for i, m in enumerate(masks) if len(m) == 1]
    sites = sorted({(m[0].attention, m[0].layer) for m in (masks[i] for i in singles)})
    picked = [next(i for i in singles if (masks[i][0].attention, masks[i][0].layer, masks[i][0].head) == (*site, n % 4))
              for n, site in enumerate(sites)]
    return [i for i, m in enumerate(masks) if not m] + picked + [i for i, m in enumerate(masks) if len(m) > 1]


# Every head alone on the small budget's own path, on the default budget and on batches of sentences; the small
# budget's variants (no reuse, one mask per search, unfused) decode the spanning masks: a small budget costs a beam
# search per batch of 1 to 5 sentences, and each variant changes how a search runs, not which head a gate takes.
@pytest.mark.parametrize(("runtime", "every_head"), [
    ({"max_tokens": SMALL_BUDGET}, True),
    ({"max_tokens": SMALL_BUDGET, "reuse": False}, False),
    ({"max_tokens": SMALL_BUDGET, "reuse": False, "masks_per_batch": 1}, False),
    ({"max_tokens": SMALL_BUDGET, "fused_attention": False}, False),
    ({"max_tokens": 0, "batch_size": 7, "masks_per_batch": 5}, True),
    ({}, True),
], ids=["tokens", "tokens-plain-packed", "tokens-plain", "tokens-unfused", "sentences-packed", "defaults"])
def test_every_path_decodes_as_zeroed_columns(tiny, masks, reference, runtime, every_head):
    picked = range(len(masks)) if every_head else spanning(masks)
    assert len(picked) >= 10
    assert_decodes_equal_reference(make_task(tiny, **runtime), [masks[i] for i in picked],
                                   [reference[i] for i in picked], str(runtime))


# -- fairseq's fast attention paths -----------------------------------------------------------
def _fused_calls(monkeypatch) -> list:
    """Each call of the fused kernel, as the output-projection weight it was given (positional arg 11)."""
    calls = []
    original = F.multi_head_attention_forward

    def recording(*args, **kwargs):
        calls.append(args[11])
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "multi_head_attention_forward", recording)
    return calls


def test_modules_no_mask_gates_keep_the_fused_kernel(tiny, monkeypatch):
    task = make_task(tiny, reuse=False, masks_per_batch=2)
    encoder = task.model.encoder.layers
    calls = _fused_calls(monkeypatch)
    task.translate([[Head("dec_self", 1, 2)]])
    assert {id(w) for w in calls} == {id(layer.self_attn.out_proj.weight) for layer in encoder}
    calls.clear()
    task.translate([[Head("enc_self", 0, 1)]])
    assert calls and all(w is encoder[1].self_attn.out_proj.weight for w in calls), "the gated layer leaves it"
    calls.clear()
    task.translate([[Head("enc_self", 0, 1)], [Head("enc_self", 1, 2)]])  # packed: both layers gated
    assert calls == []
    assert not any(s.module.skip_embed_dim_check for s in task.gates.sites), "gates cleared: stock flags back"

    unfused = make_task(tiny, reuse=False, masks_per_batch=1, fused_attention=False)
    calls.clear()
    unfused.translate([[Head("dec_self", 1, 2)], []])
    assert calls == [], "fused_attention: false keeps every gated module off the fused kernel"


def test_ungated_encoder_is_fairseqs_own_bit_for_bit(tiny, fresh):
    task = make_task(tiny, reuse=False)
    sample = task.batches[0]["net_input"]
    with torch.no_grad():
        ours = task.model.encoder(sample["src_tokens"], src_lengths=sample["src_lengths"])["encoder_out"][0]
        theirs = fresh[0].encoder(sample["src_tokens"], src_lengths=sample["src_lengths"])["encoder_out"][0]
    # exact: no gate set, so the same fused kernels run on the same tensors
    assert torch.equal(ours, theirs)


def test_beamable_attention_projects_each_sentence_once(tiny):
    task = make_task(tiny, reuse=False, masks_per_batch=1)
    sample = task.batches[0]
    rows, src_len = sample["net_input"]["src_tokens"].shape
    shapes = []
    handle = task.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
        lambda _m, args, _out: shapes.append(tuple(args[0].shape[:2])))
    try:
        task._search(0, sample, [[Head("enc_dec", 0, 1)]])
        plain = make_task(tiny, reuse=False, masks_per_batch=1, fused_attention=False)
        plain.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
            lambda _m, args, _out: shapes.append(tuple(args[0].shape[:2])))
        plain._search(0, sample, [[Head("enc_dec", 0, 1)]])
    finally:
        handle.remove()
    assert shapes == [(src_len, rows), (src_len, rows * BEAM)], "keys once per sentence, or once per beam"
    modules = [m for m in task.model.decoder.modules() if hasattr(m, "beam_size")]
    assert modules and all(m.beam_size == 1 for m in modules), "teacher forcing after a search sees no beams"


# -- the loss pass ----------------------------------------------------------------------------
def test_loss_pass_only_when_asked(tiny):
    off, on = make_task(tiny, max_tokens=SMALL_BUDGET), make_task(tiny, max_tokens=SMALL_BUDGET, loss=True)
    masks = [[], [Head("enc_dec", 1, 0)], [Head("enc_self", 0, 2)]]
    got_off, got_on = off.evaluate(masks), on.evaluate(masks)
    assert all(o.loss is None for o in got_off)
    expected = on.reference_loss(masks)
    for a, b, loss in zip(got_off, got_on, expected, strict=True):
        assert a.outputs == b.outputs and a.score == b.score
        assert (a.stats == b.stats).all()
        # exact: the same teacher-forced pass on the same batches
        assert (b.loss == loss).all()
    assert off.describe().facts["loss"].startswith("not computed")


def sweep_config(tiny, **sweep) -> dict:
    return {
        "name": "speed-paths",
        "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint),
                  "data_bin": str(tiny.data.data_bin), "beam": BEAM, "max_len_b": MAX_LEN_B},
        "data": {"data_bin": str(tiny.data.data_bin), "split": "test"},
        # One thread: two per worker thrash when other processes share the two cores.
        "sweep": {"experiments": ["baseline", "single_head"], "attention": ["enc_dec"], "workers": 1,
                  "threads_per_worker": 1, **sweep},
        "significance": {"enabled": False},
    }


@pytest.mark.slow  # the loss pass in-process: test_loss_pass_only_when_asked
def test_sweep_without_the_loss_pass_stores_null_losses_and_the_same_rest(tiny, tmp_path, ray_address):
    stores = {}
    for loss in (False, True):
        cfg = tmp_path / f"loss_{loss}.yaml"
        cfg.write_text(yaml.safe_dump(sweep_config(tiny, loss=loss, max_tokens=SMALL_BUDGET)))
        proc = run_cli("run", str(cfg), "--store", str(tmp_path / f"store_{loss}"), "--address", ray_address,
                       "--quiet")
        assert proc.returncode == 0, proc.stderr
        stores[loss] = ResultStore(str(tmp_path / f"store_{loss}"))

    def rows(store, table, key):
        return {tuple(r[k] for k in key): r for r in store.read(table).to_pylist()}

    off, on = (rows(stores[x], "examples", ("eval_id", "example_id")) for x in (False, True))
    assert off.keys() == on.keys() and len(off) == 9 * 40
    assert all(r["loss"] is None for r in off.values())
    assert all(r["loss"] is not None and r["loss"] > 0 for r in on.values())
    for key, row in off.items():
        other = on[key]
        assert (row["stats"], row["output"], row["reference"]) == (other["stats"], other["output"],
                                                                   other["reference"]), key
    evals_off, evals_on = (rows(stores[x], "evaluations", ("eval_id",)) for x in (False, True))
    fields = ("score", "baseline_score", "delta", "heads_masked", "n_examples")
    assert {k: [r[f] for f in fields] for k, r in evals_off.items()} == {
        k: [r[f] for f in fields] for k, r in evals_on.items()}
    assert len({r["score"] for r in evals_off.values()}) > 3  # the route can fail: ablations change BLEU


# -- config -----------------------------------------------------------------------------------
def _load(tmp_path, sweep: dict, kind: str = "fairseq_translation"):
    model = {"kind": kind, "checkpoint": "x.pt", "data_bin": "d"} if kind == "fairseq_translation" else {
        "kind": kind, "path": "m"}
    cfg = {"model": model, "data": {}, "sweep": sweep}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return load_config(tmp_path / "c.yaml")


def test_batching_keys_reach_the_runtime_options(tmp_path):
    assert _load(tmp_path, {}).sweep.batching() == {}
    assert RuntimeOptions(**_load(tmp_path, {}).sweep.batching()).max_tokens == DEFAULT_MAX_TOKENS
    assert _load(tmp_path, {"batch_size": 16}).sweep.batching() == {"batch_size": 16, "max_tokens": 0}
    assert _load(tmp_path, {"max_tokens": 2000}).sweep.batching() == {"max_tokens": 2000}
    assert _load(tmp_path, {"loss": True}).sweep.loss is True
    assert RuntimeOptions().loss is False and RuntimeOptions().fused_attention is True


@pytest.mark.parametrize(("sweep", "kind", "message"), [
    ({"batch_size": 16, "max_tokens": 2000}, "fairseq_translation", "sweep.batch_size and sweep.max_tokens are both"),
    ({"max_tokens": 0}, "fairseq_translation", "sweep.max_tokens must be at least 1"),
    ({"max_tokens": 2000}, "hf_classifier", "sweep.max_tokens applies to model families that batch by tokens"),
])
def test_bad_batching_keys(tmp_path, sweep, kind, message):
    with pytest.raises(HeadsweepError, match=message):
        _load(tmp_path, sweep, kind)


def test_bad_batching_keys_on_the_command_line(tiny, tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(sweep_config(tiny, batch_size=8, max_tokens=100)))
    proc = run_cli("run", str(tmp_path / "c.yaml"), "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 2
    assert "sweep.batch_size and sweep.max_tokens are both set" in error_line(proc.stderr)
    assert not (tmp_path / "store").exists()
