"""The hf_seq2seq family's gates, checked against independent routes on tiny Marian, T5 and FSMT (time-first
attention) models built from their config classes: every gated head's beam search equals the search of a model whose
output projection has that head's input columns zeroed (weight surgery on a freshly loaded copy: no hooks, no gate
code), hypothesis for hypothesis; the unmasked BLEU equals a plain ``generate`` + sacrebleu loop; packed masks and
encoder reuse change nothing."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import sacrebleu
import torch
from tiny_seq2seq import KINDS, projection, save_tiny_seq2seq, write_pairs, zeroed_head
from tolerances import assert_routes_agree

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.core.heads import Head
from headsweep.workers.families.registry import family_of_model, model_family

N_SENTENCES = 6
BATCH = 4


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    """(kind, model folder, source file, target file, adapter with reuse, adapter without)."""
    folder = tmp_path_factory.mktemp(f"seq2seq_{request.param}")
    model_dir = save_tiny_seq2seq(folder / "model", request.param)
    source, target = write_pairs(folder, N_SENTENCES)
    family = model_family("hf_seq2seq")
    model_cfg = family.model_config(path=str(model_dir), max_new_tokens=8)
    data_cfg = family.data_config(source=str(source), target=str(target))
    adapters = {reuse: family.load(model_cfg, data_cfg, RuntimeOptions(batch_size=BATCH, reuse=reuse,
                                                                       masks_per_batch=1))
                for reuse in (True, False)}
    return request.param, model_dir, source, target, adapters


def plain_translations(model, tokenizer, sources: list[str], generation) -> list[str]:
    """The users' loop: one sentence at a time through ``generate``, decoded with ``batch_decode``."""
    out = []
    with torch.no_grad():
        for line in sources:
            ids = model.generate(**tokenizer([line], return_tensors="pt"), generation_config=generation)
            out.extend(tokenizer.batch_decode(ids, skip_special_tokens=True))
    return out


def batch_translations(model, tokenizer, sources: list[str], generation) -> list[str]:
    """All sentences in one padded ``generate`` (file order), decoded with ``batch_decode``."""
    with torch.no_grad():
        ids = model.generate(**tokenizer(sources, padding=True, return_tensors="pt"), generation_config=generation)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def fresh(model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()


def test_sites_name_every_head_as_fairseq_translation_does(tiny):
    _, _, _, _, adapters = tiny
    inventory = adapters[True].describe().inventory
    assert family_of_model(adapters[True].model).name == "hf_seq2seq"
    assert sorted(str(h) for h in inventory.heads) == sorted(
        f"{a}:{layer}:{h}" for a in ("enc_self", "enc_dec", "dec_self") for layer in range(2) for h in range(4))


# The unmasked search is the same adapter code whatever the attention's layout: run on Marian and T5 only (suite
# time); FSMT's time-first gates are proved by the per-head and packed-mask tests.
@pytest.mark.parametrize("tiny", ["marian", "t5"], indirect=True)
def test_unmasked_bleu_and_chrf_equal_plain_generate_and_sacrebleu(tiny):
    """BLEU (the default) and ``data.metric: chrf``: the corpus score of the stored per-sentence statistics is
    sacrebleu's corpus score of the plain loop's translations; each sentence's chrF statistics score as sacrebleu's
    ``sentence_chrf`` of that sentence."""
    from headsweep.workers.core.metrics import CHRF

    _, model_dir, source, target, adapters = tiny
    adapter = adapters[True]
    [baseline] = adapter.evaluate([[]])
    sources = source.read_text().splitlines()
    references = target.read_text().splitlines()
    plain = plain_translations(fresh(model_dir), adapter.tokenizer, sources, adapter.generation)
    assert baseline.outputs == plain
    expected = sacrebleu.corpus_bleu(plain, [references]).score
    assert adapter.describe().metric == "bleu"
    assert baseline.score == pytest.approx(expected, abs=1e-9)
    assert [len(h.split()) for h in plain] == baseline.stats[:, 0].tolist()  # hyp_len per sentence

    family = model_family("hf_seq2seq")
    chrf = family.load(family.model_config(path=str(model_dir), max_new_tokens=8),
                       family.data_config(source=str(source), target=str(target), metric="chrf"),
                       RuntimeOptions(batch_size=BATCH, masks_per_batch=1))
    info = chrf.describe()
    assert info.metric == "chrf" and len(info.stat_names) == 18 and "nc:6" in info.facts["sacrebleu_signature"]
    [scored] = chrf.evaluate([[]])
    assert scored.outputs == plain and scored.stats.shape == (N_SENTENCES, 18)
    expected = sacrebleu.corpus_chrf(plain, [references]).score
    assert 0 < expected < 100
    # other: float64 chrF from the summed statistics against sacrebleu's own summing and scoring
    assert scored.score == pytest.approx(expected, rel=1e-12)
    for stats, hypothesis, reference in zip(scored.stats, plain, references, strict=True):
        # other: float64, as above; sentence by sentence against sacrebleu's sentence score
        assert CHRF.score(stats[None]) == pytest.approx(sacrebleu.sentence_chrf(hypothesis, [reference]).score,
                                                        rel=1e-12, abs=1e-12)


def test_every_gated_head_equals_weight_surgery_with_identical_beams(tiny):
    kind, model_dir, source, _, adapters = tiny
    adapter = adapters[False]  # the plain path: every mask runs the whole model
    heads = list(adapter.describe().inventory.heads)
    adapter.runtime.masks_per_batch = len(heads)  # every mask in one generate per batch (rows gated per mask)
    try:
        results = adapter.evaluate([[]] + [[h] for h in heads])
    finally:
        adapter.runtime.masks_per_batch = 1
    baseline, results = results[0], results[1:]
    sources = source.read_text().splitlines()
    reference = fresh(model_dir)
    changed = 0
    for head, result in zip(heads, results, strict=True):
        with zeroed_head(reference, head):
            expected = batch_translations(reference, adapter.tokenizer, sources, adapter.generation)
        assert result.outputs == expected, f"{kind} {head}"
        changed += result.outputs != baseline.outputs
    # The check can fail: most single heads change some beam of these random-weight models.
    assert changed >= len(heads) // 2, f"{kind}: only {changed} of {len(heads)} heads change any hypothesis"


def test_packed_masks_and_encoder_reuse_change_nothing(tiny):
    _, _, _, _, adapters = tiny
    plain = adapters[False]
    heads = list(plain.describe().inventory.heads)
    masks = [[], heads[:2], [Head("enc_dec", 1, 0), Head("dec_self", 0, 3)], [Head("dec_self", 1, 2)],
             [Head("enc_self", 1, 1), Head("enc_dec", 0, 2)], [h for h in heads if h.attention == "enc_dec"]]
    want = [r.outputs for r in plain.evaluate(masks)]
    for adapter in adapters.values():
        adapter.runtime.masks_per_batch = 3  # three masks per generate: rows gated per mask
        try:
            got = adapter.evaluate(masks)
        finally:
            adapter.runtime.masks_per_batch = 1
        assert [r.outputs for r in got] == want
        assert np.array_equal(np.stack([r.stats for r in got]), np.stack([plain.sentence_stats(w) for w in want]))
    reused = adapters[True]
    assert "encoder" in reused.reuse_note and len(reused._encoded) == len(reused.batches)


# The file readers are model-independent: one architecture (suite time).
@pytest.mark.parametrize("tiny", ["marian"], indirect=True)
def test_tsv_and_jsonl_files_give_the_raw_files_translations_and_scores(tiny, tmp_path):
    """``data.path``: a TSV file (no header, two more pairs cut by ``max_examples``) and a JSONL file keyed by
    language codes (``data.source_field: en``, a blank line skipped) holding the raw files' pairs evaluate exactly as
    the raw files: the same inputs and references, hypotheses and per-sentence statistics, unmasked and with a
    head masked."""
    import json

    _, model_dir, source, target, adapters = tiny
    sources, targets = source.read_text().splitlines(), target.read_text().splitlines()
    tsv, jsonl = tmp_path / "pairs.tsv", tmp_path / "multi30k.jsonl"
    pairs = [*zip(sources, targets, strict=True), ("extra", "pair"), ("one more", "pair")]
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    lines = [json.dumps({"de": t, "en": s, "id": i}) for i, (s, t) in enumerate(zip(sources, targets, strict=True))]
    jsonl.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    family = model_family("hf_seq2seq")
    model_cfg = family.model_config(path=str(model_dir), max_new_tokens=8)
    runtime = RuntimeOptions(batch_size=BATCH, masks_per_batch=2)  # both masks in one generate per batch
    tsv_cfg = family.data_config(path=str(tsv), max_examples=N_SENTENCES)
    jsonl_cfg = family.data_config(path=str(jsonl), source_field="en", target_field="de")
    routes = {"raw": adapters[True]}
    for name, data_cfg in (("tsv", tsv_cfg), ("jsonl", jsonl_cfg)):
        family.check_data(data_cfg)  # what the driver checks before Ray
        routes[name] = family.load(model_cfg, data_cfg, runtime)
    masks = [[], [Head("enc_dec", 1, 0)]]
    routes["raw"].runtime.masks_per_batch = 2  # packed as the file routes are
    try:
        raw = routes["raw"].evaluate(masks)
    finally:
        routes["raw"].runtime.masks_per_batch = 1
    assert raw[0].outputs != raw[1].outputs  # the masked head changes some hypothesis: the comparison can fail
    for name in ("tsv", "jsonl"):
        adapter = routes[name]
        info, raw_info = adapter.describe(), routes["raw"].describe()
        assert (info.inputs, info.references, info.example_ids) == (raw_info.inputs, raw_info.references,
                                                                      raw_info.example_ids), name
        assert info.dataset == {"tsv": "pairs", "jsonl": "multi30k"}[name]
        for got, want in zip(adapter.evaluate(masks), raw, strict=True):
            assert got.outputs == want.outputs, name
            assert np.array_equal(got.stats, want.stats) and got.score == want.score, name


# -- mean and optimal ablation -------------------------------------------------------------------------------------
# Both fill a gated-off head with one constant per head. The means are taken on teacher-forced references, as
# fairseq_translation takes them: enc_self over the source tokens, enc_dec and dec_self over the decoder positions
# of the shifted references (EvalAdapter.loss_batches), never over generated tokens; beam search then fills every
# generated position with that constant.

# summation order bound: float32, two encoder and two decoder layers (the decoder's two attentions count twice),
# the longest inner product the feed-forward's 64
DEPTH, WIDTH = 2 + 2 * 2, 64
STEPS = 8  # optimal ablation's Adam updates per head: enough to move below the mean


def direct_means(model, tokenizer, sources: list[str], references: list[str]) -> tuple[dict, dict]:
    """The independent route to the means: a fresh model, one sentence at a time (no padding at all), teacher-forced
    by the model's own shift of the labels (``prepare_decoder_input_ids_from_labels``), a pre-hook on every
    output projection; averaged in float64 here. Per head name's site ``attention:layer``: the mean input (C,) and
    the token count."""
    sums: dict[str, list[torch.Tensor]] = {}
    handles = []
    time_first = model.config.model_type == "fsmt"  # fairseq's (time, batch, features) inside its attention
    for attention in ("enc_self", "enc_dec", "dec_self"):
        for layer in range(2):
            proj, _ = projection(model, Head(attention, layer, 0))
            rows = sums.setdefault(f"{attention}:{layer}", [])

            def record(_m, args, rows=rows):
                rows.append((args[0][:, 0] if time_first else args[0][0]).double())

            handles.append(proj.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            for source, reference in zip(sources, references, strict=True):
                labels = tokenizer(text_target=[reference], return_tensors="pt")["input_ids"]
                decoder = model.prepare_decoder_input_ids_from_labels(labels=labels.clone())
                # use_cache=False: FSMT builds the decoder's causal mask only then (as in training)
                model(**tokenizer([source], return_tensors="pt"), decoder_input_ids=decoder, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    means = {name: torch.cat(rows).mean(dim=0).numpy() for name, rows in sums.items()}
    return means, {name: sum(len(r) for r in rows) for name, rows in sums.items()}


def installed(values: dict):
    """The fill of ``values`` (site name -> (H, d) array, as the driver stores them), built as a worker builds it."""
    from headsweep.workers.ablation.spec import AblationSpec
    from headsweep.workers.ablation.worker_fill import fill_of

    return fill_of(AblationSpec("mean"), values)


def test_mean_ablation_equals_bias_fold_surgery_with_identical_beams(tiny):
    """The means (teacher-forced references, padding excluded) against a direct one-sentence route; then every head
    mean-ablated through beam search against the stock model whose output projection has the head's input columns
    zeroed and ``W_O[:, h] @ mean_h`` added to its bias (T5's ``o`` has no bias: the surgery gives it one)."""
    from ablation_routes import folded_fill

    from headsweep.workers.ablation.means import reference_means
    from headsweep.workers.ablation.spec import AblationSpec

    kind, model_dir, source, target, adapters = tiny
    adapter = adapters[False]
    sources, references = source.read_text().splitlines(), target.read_text().splitlines()
    means = reference_means(adapter, AblationSpec("mean"), "evaluation data")
    values = {f"{a}:{layer}": v.cpu().numpy() for (a, layer), v in means.fill.values.items()}
    reference = fresh(model_dir)
    direct, counts = direct_means(reference, adapter.tokenizer, sources, references)
    assert set(values) == set(direct)
    for name, value in direct.items():
        # summation order: padded batches of 4 against one sentence at a time (float32)
        assert_routes_agree(values[name].reshape(-1), value, depth=DEPTH, width=WIDTH, dtype=torch.float32,
                            what=(kind, name))
        key = tuple(name.split(":"))
        assert means.tokens[(key[0], int(key[1]))] == counts[name], name  # real tokens only, padding left out
    assert counts["enc_dec:0"] == sum(len(adapter.tokenizer(text_target=r)["input_ids"]) for r in references)

    # One head of each attention type (both layers between them): every head's gate is proved by the zero-ablation
    # test above; here the fill, which is the same per-site code for every head.
    heads = [Head("enc_self", 0, 0), Head("enc_dec", 1, 1), Head("dec_self", 0, 2)]
    adapter.runtime.masks_per_batch = len(heads)  # each route in one generate per batch
    try:
        zeroed = adapter.evaluate([[h] for h in heads])
        adapter.gates.set_fill(installed(values))
        filled = adapter.evaluate([[h] for h in heads])
    finally:
        adapter.gates.set_fill(None)
        adapter.runtime.masks_per_batch = 1
    differs = 0
    for head, got, zero in zip(heads, filled, zeroed, strict=True):
        proj, head_dim = projection(reference, head)
        mean = torch.from_numpy(values[f"{head.attention}:{head.layer}"][head.head])
        with folded_fill(proj, head_dim, {head.head: mean}):
            expected = batch_translations(reference, adapter.tokenizer, sources, adapter.generation)
        assert got.outputs == expected, f"{kind} {head}"
        differs += got.outputs != zero.outputs
    # other: the check can fail: a fill the gate ignored would give zero ablation's beams
    assert differs >= 1, f"{kind}: the mean changes the beams of none of {len(heads)} heads"


def test_optimal_constants_beat_the_mean_and_equal_surgery(tiny):
    """Optimal ablation's training on the teacher-forced references, for a decoder self-attention head (encoder heads
    train as every other family's do; the fill is per-site code that the mean test runs on every attention type;
    the contract suite's constant fills cover every head): the loss a trained constant claims is the stock model's under
    the bias-fold surgery, at most the mean's; installed as a worker installs it, beam search equals the surgery's.
    Marian only: the training is the same code for T5, whose bias-less projection the mean test covers."""
    from ablation_routes import folded_fill

    from headsweep.workers.ablation.means import reference_means
    from headsweep.workers.ablation.optimal import OptimalSettings, train_head
    from headsweep.workers.ablation.spec import AblationSpec

    kind, model_dir, source, _, adapters = tiny
    if kind != "marian":
        pytest.skip("optimal ablation's training runs on Marian (the same code for T5; the mean test covers T5)")
    adapter = adapters[False]
    spec = AblationSpec("optimal", settings=OptimalSettings(steps=STEPS, lr=0.05))
    means = reference_means(adapter, AblationSpec("mean"), "reference").fill
    sources = source.read_text().splitlines()
    reference = fresh(model_dir)
    gains = []
    for head in (Head("dec_self", 1, 3),):
        constant, record = train_head(adapter, spec, means, head)
        site = {s.key: s for s in adapter.gates.sites}[head.site]
        losses = {}
        for name, value in (("mean", means.values[head.site][head.head]), ("optimal", constant)):
            with folded_fill(site.out_proj, site.head_dim, {head.head: value}), torch.no_grad():
                batches = adapter.loss_batches(None, torch.float32).batches
                losses[name] = sum(float(b.loss()) for b in batches) / sum(b.n_examples for b in batches)
        # summation order: the gate route against the folded projection (float32 loss through the layers)
        assert_routes_agree(record["loss_mean"], losses["mean"], depth=DEPTH, width=WIDTH, what=(head, "mean"))
        assert_routes_agree(record["loss_optimal"], losses["optimal"], depth=DEPTH, width=WIDTH, what=(head, "opt"))
        assert losses["optimal"] <= losses["mean"] and 0 < record["updates"] <= STEPS, (head, losses, record)
        gains.append(losses["mean"] - losses["optimal"])

        values = {f"{a}:{layer}": v.detach().cpu().numpy().copy() for (a, layer), v in means.values.items()}
        values[f"{head.attention}:{head.layer}"][head.head] = constant.detach().numpy()
        adapter.gates.set_fill(installed(values))
        try:
            (got,) = adapter.evaluate([[head]])
        finally:
            adapter.gates.set_fill(None)
        proj, head_dim = projection(reference, head)
        with folded_fill(proj, head_dim, {head.head: constant.detach()}):
            expected = batch_translations(reference, adapter.tokenizer, sources, adapter.generation)
        assert got.outputs == expected, f"{kind} {head}"
    assert max(gains) > 1e-4, gains  # training moved at least one constant below the mean's loss


def own_loss(model, inputs, target) -> float:
    """transformers' own ``labels`` loss of one sentence pair. The decoder's input is the model's own shift of the
    labels, passed explicitly: FSMT given only ``labels`` would decode from its shifted source (and its shift writes
    into its argument); the other models shift the labels the same way themselves."""
    labels = target["input_ids"]
    decoder = model.prepare_decoder_input_ids_from_labels(labels=labels.clone())
    return float(model(**inputs, decoder_input_ids=decoder, labels=labels).loss)


def test_reference_loss_equals_transformers_own_loss_per_sentence(tiny):
    """``sweep.loss``: each reference's teacher-forced cross-entropy, unmasked and with a decoder head gated, against
    transformers' own ``labels`` loss of one sentence at a time on a fresh model (the gated head by weight surgery);
    packed masks and encoder reuse give the plain path's losses."""
    from headsweep.workers.families.hf_seq2seq.config import Seq2SeqRuntime

    kind, model_dir, source, target, _ = tiny
    family = model_family("hf_seq2seq")
    model_cfg = family.model_config(path=str(model_dir), max_new_tokens=8)
    data_cfg = family.data_config(source=str(source), target=str(target))
    plain = family.load(model_cfg, data_cfg, Seq2SeqRuntime(batch_size=BATCH, reuse=False, masks_per_batch=1,
                                                            loss=True))
    packed = family.load(model_cfg, data_cfg, Seq2SeqRuntime(batch_size=BATCH, reuse=True, masks_per_batch=3,
                                                             loss=True))
    masks = [[], [Head("dec_self", 1, 2)], [Head("enc_self", 0, 1)], [Head("enc_dec", 0, 0), Head("dec_self", 0, 3)]]
    # the loss pass alone (evaluate runs it after the beam search, which the other tests cover)
    want = plain.reference_loss(masks)
    assert "teacher-forced" in plain.describe().facts["loss"]
    reference = fresh(model_dir)
    tok = plain.tokenizer
    for mask, got in zip(masks[:2], want[:2], strict=True):
        with zeroed_head(reference, mask[0]) if mask else contextlib.nullcontext(), torch.no_grad():
            direct = [own_loss(reference, tok([s], return_tensors="pt"), tok(text_target=[r], return_tensors="pt"))
                      for s, r in zip(source.read_text().splitlines(), target.read_text().splitlines(), strict=True)]
        # summation order: padded batches of 4 against one sentence at a time (float32 logits)
        assert_routes_agree(got, np.array(direct), depth=DEPTH, width=WIDTH, dtype=torch.float32, what=(kind, mask))
    assert not np.allclose(want[1], want[0])  # other: the gate moves the loss (the check can fail)
    for mask, got, expected in zip(masks, packed.reference_loss(masks), want, strict=True):
        # summation order: several masks per pass (taller matrices), the encoder output read from the cache
        assert_routes_agree(got, expected, depth=DEPTH, width=WIDTH, dtype=torch.float32, what=(kind, mask))
    assert len(packed._encoded) == len(packed.batches)  # the decoder-only masks read the cached encoder output
    [scored] = plain.evaluate([[]])  # evaluate stores it beside the beams
    np.testing.assert_array_equal(scored.loss, want[0])  # exact: the same pass on the same batches


def test_roles_maps_equal_transformers_own_attentions(tiny):
    """roles' maps (teacher-forced on the references, hooks on the eager path) against the attentions transformers
    itself returns (``output_attentions=True``: encoder, decoder and cross attentions) on a fresh model, batch by
    batch, every site; T5's modules return their position bias where BART-style ones return the weights, and the
    bias has the weights' shape: reading it would fail here. Then every head gets its statistics."""
    from headsweep.sweep.experiments.roles.settings import RolesSection
    from headsweep.sweep.experiments.roles.worker import attention_maps, head_roles

    kind, model_dir, _, _, adapters = tiny
    adapter = adapters[False]
    reference = fresh(model_dir)
    reference.set_attn_implementation("eager")
    specials = set(adapter.tokenizer.all_special_ids) - {adapter.tokenizer.unk_token_id}
    sentences = 0
    for batch, maps in zip(adapter.batches, attention_maps(adapter, "hf_seq2seq"), strict=True):
        labels = adapter.reference_labels(batch)
        decoder_ids = reference.prepare_decoder_input_ids_from_labels(labels=labels.clone())
        with torch.no_grad():
            out = reference(**batch.inputs, decoder_input_ids=decoder_ids, output_attentions=True, use_cache=False)
        own = {"enc_self": out.encoder_attentions, "dec_self": out.decoder_attentions, "enc_dec": out.cross_attentions}
        assert set(maps) == {(a, layer) for a in own for layer in range(2)}
        for (attention, layer), site in maps.items():
            # exact: the same eager modules on the same inputs
            assert torch.equal(site.weights, own[attention][layer]), (kind, attention, layer)
        source, target = maps[("enc_dec", 0)].keys, maps[("enc_dec", 0)].queries
        assert torch.equal(source.ids, batch.inputs["input_ids"]) and torch.equal(target.ids, decoder_ids)
        assert torch.equal(target.real, labels.ne(-100)) and target.special[:, 0].all()  # the start token
        assert torch.equal(source.special, torch.isin(source.ids, torch.tensor(sorted(specials))) & source.real)
        assert maps[("dec_self", 1)].causal and not maps[("enc_self", 1)].causal
        sentences += batch.rows
    assert sentences == N_SENTENCES
    result = head_roles(adapter, "hf_seq2seq", RolesSection())
    assert len(result.heads) == 24 and result.n_sentences == N_SENTENCES
    assert all(0 < h.confidence <= 1 for h in result.heads)


def test_lrp_accepted_on_every_tiny_model(tiny):
    """The question the driver asks a worker before anything is written (a run stopped there writes nothing): LRP
    runs on Marian, T5 and FSMT (tests/experiments/test_lrp.py checks its rules there; PegasusX's refusal:
    test_seq2seq_sites.py), and the eager path it enters is left as it was found."""
    from headsweep.workers.analyses.lrp import lrp_problem_on_worker

    adapter = tiny[4][True]

    class Worker:  # the one method of EvalWorker the question calls
        def adapter(self, data_cfg):
            assert data_cfg is None
            return adapter

    config = adapter.model.config
    implementation, asked = config._attn_implementation, config.output_attentions
    assert lrp_problem_on_worker(Worker(), None) is None
    assert (config._attn_implementation, config.output_attentions) == (implementation, asked)


# -- L0 (Hard Concrete) gates -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiny", ["marian"], indirect=True)
def test_l0_gates_trained_on_teacher_forced_loss_close_heads_that_weight_surgery_removes(tiny):
    """The l0 kind's trainer (Voita et al.'s gates on the family's ``loss_batches``: teacher-forced label-smoothed
    cross-entropy) on a tiny Marian: the penalty closes some heads of every kind of attention model-wide; the gate rows
    (what the ``gates`` table stores) follow the Hard Concrete closed forms written out here; the closed heads' mask,
    evaluated as the run evaluates it, is the beam search of a fresh model whose W_O columns for those heads are
    zeroed (no gate code), and it changes the translations."""
    from headsweep.sweep.experiments.l0.settings import L0Section
    from headsweep.sweep.experiments.l0.training import L0Trainer

    _, model_dir, source, _, adapters = tiny
    adapter = adapters[False]
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    # 10 steps from log_alpha 0 (suite time): enough to close some heads and keep others open
    trainer = L0Trainer(adapter, L0Section(steps=10, lr=0.5, seed=1, init_log_alpha=0.0), 0.5)
    history = trainer.train()
    assert history[-1].expected_open < history[0].expected_open
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items())  # train: gates
    rows = trainer.gate_rows()
    assert len(rows) == 24 and {r["attention"] for r in rows} == {"enc_self", "enc_dec", "dec_self"}
    for r in rows:
        # p_open = sigmoid(log_alpha - beta log(-gamma / zeta)); closed (test_gate) when the test-time gate
        # clamp(sigmoid(log_alpha) (zeta - gamma) + gamma, 0, 1) is 0
        assert r["p_open"] == pytest.approx(1 / (1 + np.exp(-(r["log_alpha"] - 0.33 * np.log(0.1 / 1.1)))), rel=1e-12)
        assert r["closed"] == (min(max(1.2 / (1 + np.exp(-r["log_alpha"])) - 0.1, 0.0), 1.0) == 0.0)
        assert r["step"] == 10
    closed = trainer.closed_heads()
    assert sorted(Head(r["attention"], r["layer"], r["head"]) for r in rows if r["closed"]) == closed
    assert 0 < len(closed) < 24, len(closed)
    [masked, unmasked] = adapter.evaluate([closed, []])
    sources = source.read_text().splitlines()
    model = fresh(model_dir)
    with contextlib.ExitStack() as stack:
        for head in closed:
            stack.enter_context(zeroed_head(model, head))
        assert masked.outputs == plain_translations(model, adapter.tokenizer, sources, adapter.generation)
    assert masked.outputs != unmasked.outputs


# -- resample ablation on enc_self heads ---------------------------------------------------------------------------
# A gated-off enc_self head takes a donor sentence's own context (another sentence of the same source token length).
# The independent route, written with transformers alone on a fresh model, without padding: the donors of the sentences
# of one source length through the encoder (one unpadded pass) with pre-hooks on the self-attention out_proj modules
# recording their inputs, then those sentences' generate with pre-hooks writing each donor's slice of the masked heads
# over the sentence's own (TransformerLens's hook_z patching). FSMT's projection input is time-first: the slice is
# written the same way, on the last axis.
# one head, and two heads in two layers
RESAMPLE_MASKS = [[Head("enc_self", 0, 0)], [Head("enc_self", 0, 1), Head("enc_self", 1, 2)]]


def donor_data(folder, tokenizer) -> tuple:
    """5 synthetic pairs in source-length groups of 2 and 3 (every sentence has a donor; in batches of 4 the first
    batch pads two lengths and the second group's donors straddle the two batches)."""
    source, target = write_pairs(folder / "resample", 24)
    sources, targets = source.read_text().splitlines(), target.read_text().splitlines()
    lengths = [len(ids) for ids in tokenizer(sources)["input_ids"]]
    chosen: list[int] = []
    for n in sorted(set(lengths)):
        members = [i for i, m in enumerate(lengths) if m == n]
        size = 3 if chosen else 2
        if len(members) >= size and len(chosen) < 5:
            chosen += members[:size]
    source.write_text("".join(sources[i] + "\n" for i in chosen))
    target.write_text("".join(targets[i] + "\n" for i in chosen))
    return source, target


def resample_adapter(model_dir, source, target, resamples: int = 1, method: str = "resample", **runtime):
    from headsweep.workers.ablation.resample import ResampleSettings
    from headsweep.workers.ablation.spec import AblationSpec
    from headsweep.workers.families.hf_seq2seq.config import Seq2SeqRuntime

    family = model_family("hf_seq2seq")
    settings = ResampleSettings(seed=3, resamples=resamples) if method == "resample" else None
    return family.load(family.model_config(path=str(model_dir), max_new_tokens=8),
                       family.data_config(source=str(source), target=str(target)),
                       Seq2SeqRuntime(batch_size=BATCH, ablation=AblationSpec(method=method, settings=settings),
                                      **runtime))


@contextlib.contextmanager
def hooked(model, mask, write: dict | None = None, record: dict | None = None):
    """Pre-hooks on the encoder self-attention projections: ``record`` (layer -> input) keeps each one's input,
    ``write`` (layer -> an input of the same shape) writes its slices of ``mask``'s heads over the input."""
    def hook(head: Head, head_dim: int):
        def run(_m, args):
            if record is not None:
                record[head.layer] = args[0].clone()
                return None
            x = args[0].clone()
            for h in mask:
                if h.layer == head.layer:
                    cols = slice(h.head * head_dim, (h.head + 1) * head_dim)
                    x[..., cols] = write[head.layer][..., cols]
            return (x, *args[1:])
        return run

    handles = []
    for layer in sorted({h.layer for h in mask}):
        proj, head_dim = projection(model, Head("enc_self", layer, 0))
        handles.append(proj.register_forward_pre_hook(hook(Head("enc_self", layer, 0), head_dim)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def resampled_translations(model, tokenizer, sources, generation, mask, donors) -> list[str]:
    """The route: per source length, the donors' encoder pass recorded, then the sentences' generate with the donors'
    slices written in (no padding anywhere: every row of a pass has the same length)."""
    lengths = [len(ids) for ids in tokenizer(sources)["input_ids"]]
    out: list[str] = [""] * len(sources)
    for n in sorted(set(lengths)):
        rows = [i for i, m in enumerate(lengths) if m == n]
        recorded: dict = {}
        with hooked(model, mask, record=recorded), torch.no_grad():
            model.get_encoder()(**tokenizer([sources[int(donors[i])] for i in rows], return_tensors="pt"))
        with hooked(model, mask, write=recorded), torch.no_grad():
            ids = model.generate(**tokenizer([sources[i] for i in rows], return_tensors="pt"),
                                 generation_config=generation)
        for i, text in zip(rows, tokenizer.batch_decode(ids, skip_special_tokens=True), strict=True):
            out[i] = text
    return out


def test_resampled_enc_self_heads_equal_donor_slices_written_by_hooks(tiny, tmp_path):
    """Resample ablation (``sweep.ablation: resample``) through the adapter, encoder reuse off and on, batches of 4
    padded by the tokenizer, donors from any batch, against the hook route above: identical hypotheses, so identical
    sacrebleu statistics and BLEU, and teacher-forced losses within the summation-order bound; K = 2 draws average
    each sentence's statistics; a decoder head is refused in one line."""
    from headsweep.errors import HeadsweepError

    kind, model_dir, _, _, adapters = tiny
    source, target = donor_data(tmp_path, adapters[False].tokenizer)
    a = resample_adapter(model_dir, source, target, reuse=False, masks_per_batch=2)
    sources = source.read_text().splitlines()
    donors = a.donors.donors[0]
    lengths = np.array(a.source_lengths)
    assert len(sources) == 5 and (lengths[donors] == lengths).all() and not (donors == np.arange(5)).any()
    batch_of = {int(i): b for b, batch in enumerate(a.batches) for i in batch.examples}
    assert any(len(set(lengths[b.examples.numpy()])) > 1 for b in a.batches)  # padding within a batch
    assert any(batch_of[i] != batch_of[int(d)] for i, d in enumerate(donors))  # a donor from another batch
    reference = fresh(model_dir)
    want = [resampled_translations(reference, a.tokenizer, sources, a.generation, m, donors) for m in RESAMPLE_MASKS]
    zeroed = resample_adapter(model_dir, source, target, method="zero", masks_per_batch=2).evaluate(RESAMPLE_MASKS)
    # other: the route can fail: the donors' slices change some hypothesis against zero ablation, for every mask
    for mask, zero, expected in zip(RESAMPLE_MASKS, zeroed, want, strict=True):
        assert zero.outputs != expected, (kind, mask, "resample changes nothing against zero ablation")
    # Both masks in one generate per batch, encoder reuse off and on (the contract suite runs per-example fills one
    # mask per pass too); on T5 under two donor draws (each sentence's statistics the mean over the draws, the
    # hypotheses the first draw's; Marian's random weights give the same beams under both)
    twice = kind == "t5"
    packed = resample_adapter(model_dir, source, target, resamples=2 if twice else 1, reuse=True, masks_per_batch=2)
    second = [resampled_translations(reference, a.tokenizer, sources, a.generation, m, packed.donors.donors[1])
              for m in RESAMPLE_MASKS] if twice else []
    differs = 0
    for adapter in (a, packed):
        for m, (mask, got, expected) in enumerate(zip(RESAMPLE_MASKS, adapter.evaluate(RESAMPLE_MASKS), want,
                                                      strict=True)):
            what = (kind, adapter.runtime.reuse, mask)
            assert np.array_equal(adapter.donors.donors[0], donors), what
            assert got.outputs == expected, what
            stats = adapter.sentence_stats(expected)
            if adapter is packed and twice:
                # exact: counts, their mean over two draws is exact in float64
                assert np.array_equal(got.stats, (stats + adapter.sentence_stats(second[m])) / 2), what
                differs += not np.array_equal(got.stats, stats)
                continue
            assert np.array_equal(got.stats, stats), what
            assert got.score == pytest.approx(sacrebleu.corpus_bleu(expected, [adapter.pairs.references]).score,
                                              abs=1e-9)
    # other: the second draw changes some mask's statistics, or their mean could not be told from draw 0's
    assert differs or not twice, kind
    # sweep.loss under the same fill: each reference's teacher-forced loss against transformers' own labels loss of
    # one sentence at a time, the donor's slices written by the hooks
    mask = RESAMPLE_MASKS[1]
    [losses] = a.reference_loss([mask])
    references = target.read_text().splitlines()
    direct = []
    for i, (line, ref) in enumerate(zip(sources, references, strict=True)):
        recorded: dict = {}
        with hooked(reference, mask, record=recorded), torch.no_grad():
            reference.get_encoder()(**a.tokenizer([sources[int(donors[i])]], return_tensors="pt"))
        with hooked(reference, mask, write=recorded), torch.no_grad():
            direct.append(own_loss(reference, a.tokenizer([line], return_tensors="pt"),
                                   a.tokenizer(text_target=[ref], return_tensors="pt")))
    # summation order: padded batches of 4 against one sentence at a time (float32 logits)
    assert_routes_agree(losses, np.array(direct), depth=DEPTH, width=WIDTH, dtype=torch.float32, what=(kind, mask))
    with pytest.raises(HeadsweepError, match="a mask of this run gates dec_self:1:0"):
        a.evaluate([[Head("enc_self", 0, 0)], [Head("dec_self", 1, 0)]])
