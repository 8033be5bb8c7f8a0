"""Head roles (Voita et al. 2019): the statistics on hand-built attention maps with known answers, the maps
read through headsweep against the models' own attention weights (BERT, fairseq, Llama), and a ``roles`` sweep
through the real CLI read back with DuckDB."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tiny_models import lm_text, save_tiny_causal_lm
from tolerances import assert_routes_agree

from headsweep.sweep.experiments.roles.settings import RolesSection
from headsweep.workers.attention.head_roles import (
    POSITIONAL,
    RARE_WORDS,
    FrequencyTable,
    RoleTotals,
    SiteAttention,
    TokenSide,
    sentence_statistics,
)

CLS, SEP, PAD = 1, 2, 0


# -- hand-built maps ------------------------------------------------------------------------------------
def side(rows: list[list[int]], specials=(CLS, SEP), length: int | None = None, left: bool = False,
         vocab: str = "text") -> TokenSide:
    """Token rows padded with PAD to ``length`` (on the left with ``left``)."""
    length = length or max(len(r) for r in rows)
    padded = [([PAD] * (length - len(r)) + r) if left else (r + [PAD] * (length - len(r))) for r in rows]
    ids = torch.tensor(padded)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        if left:
            real[i, length - len(r):] = True
        else:
            real[i, : len(r)] = True
    special = torch.isin(ids, torch.tensor(list(specials))) & real
    return TokenSide(ids, real, special, vocab)


def uniform_rows(tokens: TokenSide, heads: int, causal: bool = False) -> torch.Tensor:
    """(B, H, T, T) float64: every query spreads its attention evenly over the real keys it may see."""
    b, t = tokens.ids.shape
    allowed = tokens.real[:, None, :].expand(b, t, t).clone()
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    w = allowed.double() / allowed.sum(-1, keepdim=True).clamp(min=1)
    return w[:, None].expand(b, heads, t, t).clone()


def point_to(tokens: TokenSide, target) -> torch.Tensor:
    """(B, T, T) float64: query q of sentence b puts all its attention on key ``target(b, q)``."""
    b, t = tokens.ids.shape
    w = torch.zeros(b, t, t, dtype=torch.float64)
    for i in range(b):
        for q in range(t):
            w[i, q, target(i, q)] = 1.0
    return w


def totals(site: SiteAttention, table: FrequencyTable | None = None) -> RoleTotals:
    return RoleTotals(site.weights.shape[1]).add(sentence_statistics(site, table))


def test_previous_token_head_is_positional_with_share_one():
    """Two BERT-style sentences ([CLS] words [SEP], the second padded). Head 0 attends to the previous
    token (the first word to [CLS]), head 1 spreads evenly; every number is counted by hand."""
    tokens = side([[CLS, 10, 11, 12, 13, 14, SEP], [CLS, 20, 21, 22, SEP]])
    real_index = {0: list(range(7)), 1: list(range(5))}
    prev = point_to(tokens, lambda b, q: max(q - 1, 0) if q in real_index[b] else 0)
    weights = torch.stack([prev, uniform_rows(tokens, 1)[:, 0]], dim=1)
    result = totals(SiteAttention(weights, tokens, tokens)).heads("self", 0, RolesSection())
    head0, head1 = result
    # 5 + 3 words are the counted tokens ([CLS], [SEP] and padding are not).
    assert head0.n_tokens == head1.n_tokens == 8
    assert (head0.top_offset, head0.top_offset_share, head0.roles) == (-1, 1.0, [POSITIONAL])
    # The first word of each sentence puts its weight on [CLS], not on a word: its maximum over words is 0.
    assert head0.confidence == 6 / 8  # exact: sums of 0s and 1s
    assert head0.entropy == 0.0
    # Uniform: each word's largest weight on a word is 1/7 (first sentence) or 1/5 (second); ties go to the
    # lowest position, [CLS], so the offsets are -1..-5 and -1..-3: -1 wins the tie with -2 and -3 (smaller |o|).
    # other: float64 sums of equal terms, a few units in the last place
    assert head1.confidence == pytest.approx((5 / 7 + 3 / 5) / 8, rel=1e-14)
    assert head1.entropy == pytest.approx((5 * math.log(7) + 3 * math.log(5)) / 8, rel=1e-14)
    assert (head1.top_offset, head1.top_offset_share, head1.roles) == (-1, 2 / 8, [])


def test_confidence_of_a_uniform_map_is_one_over_n():
    for n in (1, 2, 5, 13):
        tokens = side([list(range(10, 10 + n))], specials=())
        [head] = totals(SiteAttention(uniform_rows(tokens, 1), tokens, tokens)).heads("self", 0, RolesSection())
        # other: a float64 mean of n equal terms 1/n
        assert head.confidence == pytest.approx(1 / n, rel=1e-14) and head.n_tokens == n
        assert head.entropy == pytest.approx(math.log(n), rel=1e-14, abs=1e-15)


def test_next_token_offset_and_threshold():
    """A head that attends to the next token in 9 of 10 positions (the last word to itself) is positional at the
    default 0.9 and not at 0.95; an offset outside roles.offsets is never positional."""
    tokens = side([list(range(10, 20))], specials=())
    weights = point_to(tokens, lambda b, q: min(q + 1, 9))[:, None]
    site = SiteAttention(weights, tokens, tokens)
    [head] = totals(site).heads("self", 0, RolesSection())
    assert (head.top_offset, head.top_offset_share, head.roles) == (1, 0.9, [POSITIONAL])
    assert totals(site).heads("self", 0, RolesSection(positional_threshold=0.95))[0].roles == []
    assert totals(site).heads("self", 0, RolesSection(offsets=(-1, 2)))[0].roles == []


def test_causal_previous_token_head_after_bos():
    """Decoder-only: a window starting with BOS (special); the first word's previous token is BOS."""
    bos = 2
    tokens = side([[bos, 10, 11, 12, 13, 14]], specials=(bos,))
    weights = torch.stack([point_to(tokens, lambda b, q: max(q - 1, 0)), uniform_rows(tokens, 1, causal=True)[:, 0]],
                          dim=1)
    head0, head1 = totals(SiteAttention(weights, tokens, tokens, causal=True)).heads("self", 0, RolesSection())
    assert (head0.n_tokens, head0.top_offset, head0.top_offset_share, head0.roles) == (5, -1, 1.0, [POSITIONAL])
    # Causal uniform: word q (1..5) spreads over q+1 keys; its largest weight on a word is 1/(q+1).
    # other: float64 sums of five terms
    assert head1.confidence == pytest.approx(sum(1 / (q + 1) for q in range(1, 6)) / 5, rel=1e-14)


def frequency_table(counts: dict[int, int], top: int, size: int = 40) -> FrequencyTable:
    array = np.zeros(size)
    for token, n in counts.items():
        array[token] = n
    return FrequencyTable(array, top, "hand")


# Counts: 10..14 frequent (the top 5), 30 and 31 rare, 32 rarer, 33 never seen.
COUNTS = {10: 100, 11: 90, 12: 80, 13: 70, 14: 60, 30: 5, 31: 5, 32: 2, 20: 20, 21: 20}


def test_rare_word_head():
    """Head 0 points every query at the sentence's rarest word; head 1 at the previous token; head 2 spreads
    evenly (ties go to [CLS], which is no word). The last sentence's rarest word is among the 5 most
    frequent types: not eligible."""
    rows = [[CLS, 10, 30, 11, 12, SEP],  # rarest: 30 at position 2
            [CLS, 32, 10, 30, SEP],  # rarest: 32 at position 1
            [CLS, 11, 12, 33, 13, SEP],  # rarest: 33 (count 0) at position 3
            [CLS, 30, 31, 14, SEP],  # rarest: 30 and 31 tie (positions 1, 2)
            [CLS, 10, 11, 12, SEP]]  # not eligible: 12 is the 3rd most frequent
    rarest = {0: 2, 1: 1, 2: 3, 3: 2, 4: 1}
    tokens = side(rows)
    rare = point_to(tokens, lambda b, q: rarest[b])
    prev = point_to(tokens, lambda b, q: max(q - 1, 0))
    weights = torch.stack([rare, prev, uniform_rows(tokens, 1)[:, 0]], dim=1)
    table = frequency_table(COUNTS, top=5)
    assert table.floor == 60  # the 5th most frequent type's count
    settings = RolesSection(rare_min_sentences=4)
    head0, head1, head2 = totals(SiteAttention(weights, tokens, tokens), table).heads("self", 0, settings)
    assert head0.rare_sentences == 4
    assert (head0.rare_share, head0.roles) == (1.0, [RARE_WORDS])
    # Previous token: every key before the last word receives the same mean attention (one query each); ties
    # go to the lowest position, [CLS], which is no word: a miss. Uniform: every key ties, the same miss.
    assert (head1.rare_share, head1.roles) == (0.0, [POSITIONAL])
    assert (head2.rare_share, head2.roles) == (0.0, [])
    # Chance: rarest words / real keys per eligible sentence.
    # other: a float64 mean of four ratios
    assert head0.rare_chance == pytest.approx((1 / 6 + 1 / 5 + 1 / 6 + 2 / 5) / 4, rel=1e-14)
    # Too few eligible sentences for the role: the share stays, the role goes.
    few = RolesSection(rare_min_sentences=5)
    head0 = totals(SiteAttention(weights, tokens, tokens), table).heads("self", 0, few)[0]
    assert (head0.rare_share, head0.roles) == (1.0, [])
    # No frequencies: no rare-word statistics.
    head0 = totals(SiteAttention(weights, tokens, tokens)).heads("self", 0, settings)[0]
    assert (head0.rare_share, head0.rare_sentences, head0.rare_chance) == (None, None, None)


def test_rare_word_head_under_causal_attention():
    """Causal: the rarest word (position 3) is seen only by queries 3..5, which all attend to it; earlier
    queries attend to themselves. Its mean received attention (1.0) beats the earlier words' (1/5 and 1/4: one
    query each, over the 5 and 4 counted queries that may attend to them)."""
    bos = 2
    tokens = side([[bos, 10, 11, 30, 12, 13]], specials=(bos,))
    weights = point_to(tokens, lambda b, q: 3 if q >= 3 else q)[:, None]
    [head] = totals(SiteAttention(weights, tokens, tokens, causal=True), frequency_table(COUNTS, top=5)).heads(
        "self", 0, RolesSection(rare_min_sentences=1))
    assert (head.rare_share, head.rare_sentences, head.roles) == (1.0, 1, [RARE_WORDS])


def test_statistics_do_not_depend_on_batching_or_padding():
    """Sufficient statistics: a padded batch (right or left padding) sums to the sentences taken one by one."""
    g = torch.Generator().manual_seed(3)
    rows = [[CLS, 10, 30, 11, 12, 13, SEP], [CLS, 32, 10, SEP], [CLS, 20, 21, 31, 14, SEP]]
    table = frequency_table(COUNTS, top=5)
    maps = []
    for r in rows:
        n = len(r)
        maps.append(torch.softmax(torch.randn(3, n, n, generator=g, dtype=torch.float64) * 3, dim=-1))
    alone = RoleTotals(3)
    for r, m in zip(rows, maps, strict=True):
        t = side([r])
        alone.add(sentence_statistics(SiteAttention(m[None], t, t), table))
    settings = RolesSection(rare_min_sentences=1)
    expected = alone.heads("self", 0, settings)
    for left in (False, True):
        t = side(rows, left=left)
        length = t.ids.shape[1]
        batch = torch.zeros(len(rows), 3, length, length, dtype=torch.float64)
        for i, (r, m) in enumerate(zip(rows, maps, strict=True)):
            span = slice(length - len(r), length) if left else slice(0, len(r))
            batch[i, :, span, span] = m
        got = totals(SiteAttention(batch, t, t), table).heads("self", 0, settings)
        for a, b in zip(got, expected, strict=True):
            assert (a.n_tokens, a.top_offset, a.top_offset_share, a.rare_share, a.rare_sentences, a.roles) == (
                b.n_tokens, b.top_offset, b.top_offset_share, b.rare_share, b.rare_sentences, b.roles)
            # other: the same float64 terms summed over a padded axis (zeros in between)
            assert a.confidence == pytest.approx(b.confidence, rel=1e-14)
            assert a.entropy == pytest.approx(b.entropy, rel=1e-14)


def test_encoder_decoder_offsets_count_each_side_from_its_first_real_token():
    """enc_dec: queries (decoder input, right-padded) and keys (source, left-padded) of different lengths; a head
    that attends to the source token at the query's own position has offset 0 everywhere."""
    eos = 2
    source = side([[10, 11, 12, eos], [13, 14, eos]], specials=(eos,), left=True, length=5, vocab="source")
    target = side([[eos, 20, 21], [eos, 22]], specials=(eos,), length=3, vocab="target")
    first_key = {0: 1, 1: 2}  # left padding: the source's first real token
    weights = torch.zeros(2, 1, 3, 5, dtype=torch.float64)
    for b in range(2):
        for q in range(3):
            weights[b, 0, q, first_key[b] + q] = 1.0
    [head] = totals(SiteAttention(weights, target, source)).heads("enc_dec", 0, RolesSection())
    assert (head.n_tokens, head.top_offset, head.top_offset_share) == (3, 0, 1.0)


# -- maps read through headsweep against the models' own weights ------------------------------------------
def test_bert_maps_equal_the_models_eager_attentions(tiny_bert_dir, tiny_dev_tsv, one_thread):
    """A classifier loaded on SDPA (whose kernel returns no weights): the reader switches it to the eager path,
    and every head's map equals what a fresh eager copy returns with ``output_attentions=True``."""
    from transformers import AutoModelForSequenceClassification

    from headsweep.sweep.experiments.roles.worker import attention_maps
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    adapter = load_classifier(ClassifierModel(path=str(tiny_bert_dir), attn_implementation="sdpa"),
                              ClassifierData(path=str(tiny_dev_tsv)), RuntimeOptions(batch_size=16))
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    tok = adapter.tokenizer
    n = 0
    for (_idx, inputs), maps in zip(adapter.batches, attention_maps(adapter, "hf_classifier"), strict=True):
        with torch.no_grad():
            expected = reference(**inputs, output_attentions=True).attentions
        assert sorted(maps) == [("self", 0), ("self", 1)]
        for layer, weights in enumerate(expected):
            site = maps[("self", layer)]
            assert torch.equal(site.weights, weights)  # exact: the same eager kernels on the same inputs
            real = inputs["attention_mask"].bool()
            assert torch.equal(site.keys.real, real)
            assert torch.equal(site.keys.special, torch.isin(inputs["input_ids"],
                                                             torch.tensor([tok.cls_token_id, tok.sep_token_id])) & real)
        n += len(_idx)
    assert n == 40
    assert adapter.model.config._attn_implementation == "sdpa"  # given back after the analysis


def test_llama_maps_equal_the_models_eager_attentions(tmp_path, one_thread):
    """A grouped-query Llama (8 query heads, 2 key/value heads) on perplexity windows with BOS, loaded on SDPA."""
    from transformers import AutoModelForCausalLM

    from headsweep.sweep.experiments.roles.worker import attention_maps
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama_8q2kv")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(lm_text(120, seed=4))
    adapter = CausalLMAdapter(CausalLMModel(path=str(model_dir), attn_implementation="sdpa"),
                              CausalLMData(path=str(corpus), window=12, add_bos=True), RuntimeOptions(batch_size=4))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    batches = 0
    for idx, maps in zip(adapter.batches, attention_maps(adapter, "hf_causal_lm"), strict=True):
        ids = adapter.inputs[idx]
        with torch.no_grad():
            expected = reference(input_ids=ids, use_cache=False, output_attentions=True).attentions
        for layer, weights in enumerate(expected):
            site = maps[("self", layer)]
            assert site.causal and site.weights.shape == (len(idx), 8, 12, 12)
            assert torch.equal(site.weights, weights)  # exact: the same eager kernels on the same inputs
            assert site.keys.special[:, 0].all() and not site.keys.special[:, 1:].any()  # the BOS only
        batches += 1
    assert batches == len(adapter.batches) >= 2
    assert adapter.model.config._attn_implementation == "sdpa"


@pytest.fixture(scope="module")
def tiny_translation(trained_tiny_fairseq):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    torch.set_num_threads(1)
    tiny = trained_tiny_fairseq
    adapter = load_translation(TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin)),
                               TranslationData(data_bin=str(tiny.data.data_bin), split="test"),
                               RuntimeOptions(batch_size=16))
    return tiny, adapter


def by_hand(module, query, key, key_padding_mask, attn_mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + masks) per head from a fairseq MultiheadAttention's own projections: (B, H, Q, K)."""
    t, b, _ = query.shape
    s = key.shape[0]
    h, d = module.num_heads, module.head_dim
    q = (module.q_proj(query) * module.scaling).view(t, b, h, d).permute(1, 2, 0, 3)
    k = module.k_proj(key).view(s, b, h, d).permute(1, 2, 0, 3)
    scores = q @ k.transpose(-1, -2)
    if attn_mask is not None:
        scores = scores + attn_mask
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :].bool(), float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


def test_fairseq_maps_equal_the_models_attention(tiny_translation):
    """Every head of enc_self, dec_self and enc_dec (teacher-forced on the references) against softmax(q k^T)
    computed by hand from a freshly loaded fairseq model's own projections (fused path on, no headsweep code);
    enc_dec's head average also against fairseq's own per-head weights (``alignment_layer``)."""
    from tiny_fairseq import BOUND_SHAPE, attention_module, fairseq_load

    from headsweep.sweep.experiments.roles.worker import attention_maps
    from headsweep.workers.core.heads import Head

    tiny, adapter = tiny_translation
    fresh, _task = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    inputs: dict = {}

    def keep(key):
        def hook(module, args, kwargs):
            inputs[key] = (kwargs["query"], kwargs["key"], kwargs.get("key_padding_mask"), kwargs.get("attn_mask"))
        return hook

    keys = [(a, layer) for a in ("enc_self", "dec_self", "enc_dec") for layer in range(2)]
    handles = [attention_module(fresh, Head(a, layer, 0)).register_forward_pre_hook(keep((a, layer)),
                                                                                    with_kwargs=True)
               for a, layer in keys]
    sentences = 0
    try:
        for sample, maps in zip(adapter.batches, attention_maps(adapter, "fairseq_translation"), strict=True):
            net = sample["net_input"]
            inputs.clear()
            with torch.no_grad():
                fresh(**net)
                for key in keys:
                    expected = by_hand(attention_module(fresh, Head(*key, 0)), *inputs[key])
                    site = maps[key]
                    # summation order: fused against unfused attention, other matrix shapes (float32)
                    assert_routes_agree(site.weights, expected, what=key, **BOUND_SHAPE)
                src = net["src_tokens"]
                encoder_out = fresh.encoder(src, src_lengths=net["src_lengths"])
                for layer in range(2):
                    _x, extra = fresh.decoder(net["prev_output_tokens"], encoder_out=encoder_out,
                                              alignment_layer=layer)
                    # summation order: as above, then a mean over 4 heads
                    assert_routes_agree(maps[("enc_dec", layer)].weights.mean(1), extra["attn"][0], **BOUND_SHAPE)
            eos, pad = adapter.src_dict.eos(), adapter.src_dict.pad()
            source = maps[("enc_self", 0)].keys
            assert torch.equal(source.special, src.eq(eos)) and torch.equal(source.real, src.ne(pad))
            target = maps[("dec_self", 0)].queries
            assert target.special[:, 0].all()  # the decoder's first input is EOS
            assert maps[("dec_self", 0)].causal and not maps[("enc_dec", 0)].causal
            sentences += len(sample["id"])
    finally:
        for handle in handles:
            handle.remove()
    assert sentences == 40


def test_fairseq_capture_changes_nothing_the_model_returns(tiny_translation):
    """Under the capture every module still gives its caller what it asked for: the same logits and the same
    head-averaged alignment weights as the model on the same (unfused) attention path without it."""
    from headsweep.workers.families.fairseq_translation.attention import fairseq_attention

    _tiny, adapter = tiny_translation
    model = adapter.model
    net = adapter.batches[0]["net_input"]
    modules = [site.module for site in adapter.gates.sites]
    flags = [m.skip_embed_dim_check for m in modules]
    try:
        for m in modules:  # the unfused path, which the capture takes (fused attention averages the heads)
            m.skip_embed_dim_check = True
        with torch.no_grad():
            plain, plain_extra = model(**net)
    finally:
        for m, flag in zip(modules, flags, strict=True):
            m.skip_embed_dim_check = flag
    with torch.no_grad(), fairseq_attention(adapter.gates.sites) as captured:
        seen, seen_extra = model(**net)
    assert len(captured) == 6
    assert torch.equal(plain, seen)  # exact: the same unfused path, the weights only read
    assert torch.equal(plain_extra["attn"][0], seen_extra["attn"][0])
    assert [m.skip_embed_dim_check for m in modules] == flags  # each module's own path back


def test_fairseq_roles_with_dictionary_counts(tiny_translation):
    """roles.frequencies unset on fairseq: the dictionaries' counts; every head gets a row."""
    from headsweep.sweep.experiments.roles.worker import head_roles

    _tiny, adapter = tiny_translation
    result = head_roles(adapter, "fairseq_translation", RolesSection(rare_top=10, rare_min_sentences=1))
    assert result.frequencies.startswith("fairseq dictionaries' counts") and result.n_sentences == 40
    assert len(result.heads) == 24
    src_words = sum(int(s["net_input"]["src_tokens"].ne(adapter.src_dict.pad()).sum()) - len(s["id"])
                    for s in adapter.batches)  # real source tokens but each sentence's EOS
    for head in result.heads:
        assert 0 < head.confidence <= 1 and head.rare_sentences > 0 and 0 <= head.rare_share <= 1
        if head.attention == "enc_self":
            assert head.n_tokens == src_words


# -- a roles sweep through the real CLI ---------------------------------------------------------------------
def roles_config(path, model_dir, data_file, **roles):
    cfg = {
        "name": "roles-sweep",
        "model": {"kind": "hf_classifier", "path": str(model_dir)},
        "data": {"path": str(data_file)},
        "sweep": {"experiments": ["baseline", "single_head", "importance", "roles"], "batch_size": 16},
        # LRP: test_lrp_importance_through_the_cli reads this run's importance table (gradient importance
        # through the CLI: test_prune_cli.py)
        "importance": {"method": "lrp", "data": {"path": str(data_file)}, "allow_eval_data": True},
        "significance": {"n_resamples": 100, "seed": 3},
        "roles": roles,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def roles_run(tmp_path_factory, ray_address, tiny_bert_dir, tiny_dev_tsv):
    from headsweep.sweep.demo.sentiment import generate

    tmp = tmp_path_factory.mktemp("roles_cli")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(text for text, _ in generate(300, seed=11)) + "\n")
    config = roles_config(tmp / "sweep.yaml", tiny_bert_dir, tiny_dev_tsv, frequencies="corpus.txt", rare_top=5,
                          rare_min_sentences=1)
    store = tmp / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store, proc.stdout.strip().splitlines()[-1], corpus


def duck(store, table):
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


def test_head_roles_rows_equal_the_statistics_in_process(roles_run, tiny_bert_dir, tiny_dev_tsv):
    from headsweep.sweep.experiments.roles.worker import head_roles
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    store, run_id, corpus = roles_run
    con = duckdb.connect()
    rows = con.sql(f"SELECT attention, layer, head, checkpoint, n_tokens, confidence, entropy, top_offset, "
                   f"top_offset_share, rare_share, rare_sentences, rare_chance, roles FROM {duck(store, 'head_roles')} "
                   f"WHERE run_id = '{run_id}' ORDER BY layer, head").fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("self", lay, h, None) for lay in range(2) for h in range(4)]
    adapter = load_classifier(ClassifierModel(path=str(tiny_bert_dir)), ClassifierData(path=str(tiny_dev_tsv)),
                              RuntimeOptions(batch_size=16))
    settings = RolesSection(rare_top=5, rare_min_sentences=1, frequencies=str(corpus))
    expected = head_roles(adapter, "hf_classifier", settings).heads
    for row, head in zip(rows, expected, strict=True):
        assert (row[4], row[7], row[10], row[12]) == (head.n_tokens, head.top_offset, head.rare_sentences, head.roles)
        assert row[4] > 0 and row[10] > 0
        for got, want in ((row[5], head.confidence), (row[6], head.entropy), (row[8], head.top_offset_share),
                          (row[9], head.rare_share), (row[11], head.rare_chance)):
            # summation order: the worker's eager attention in another process (float32); shares are exact
            assert_routes_agree(np.array([got]), np.array([want]), depth=2, width=32)
    [(facts,)] = con.sql(f"SELECT facts FROM {duck(store, 'runs')} WHERE run_id = '{run_id}'").fetchall()
    fact = json.loads(facts)["roles"]
    assert fact["frequencies"] == str(corpus)  # resolved against the config's folder
    assert fact["frequency_source"].startswith(f"corpus file {corpus} (300 lines")
    assert (fact["rare_top"], fact["data"], fact["sentences"]) == (5, "the evaluation set", 40)


def test_roles_view_joins_delta_significance_and_importance(roles_run):
    from headsweep.results.query import run_query
    from headsweep.results.store import ResultStore

    store, run_id, _ = roles_run
    view = run_query(ResultStore(str(store)), "SELECT * FROM roles WHERE run_id = ? ORDER BY layer, head",
                     [run_id]).to_pylist()
    assert len(view) == 8
    con = duckdb.connect()
    deltas = dict(con.sql(f"SELECT layer * 10 + head, delta FROM {duck(store, 'evaluations')} "
                          f"WHERE run_id = '{run_id}' AND experiment = 'single_head'").fetchall())
    importance = dict(con.sql(f"SELECT layer * 10 + head, score_normalized FROM {duck(store, 'importance')} "
                              f"WHERE run_id = '{run_id}'").fetchall())
    for row in view:
        key = row["layer"] * 10 + row["head"]
        assert row["name"] == f"self:{row['layer']}:{row['head']}"
        assert row["delta"] == deltas[key] and row["importance_normalized"] == importance[key]  # exact: joined
        assert row["test"] == "paired_ttest" and row["p_value"] is not None and row["significant"] is not None
        assert row["metric"] == "accuracy" and isinstance(row["roles"], list)


def test_lrp_importance_through_the_cli(roles_run):
    """importance.method lrp through the CLI (the LRP rules themselves: test_lrp.py): one row per head, shares of
    each layer's relevance, ranked."""
    from headsweep.results.store import ResultStore

    store, run_id, _ = roles_run
    rows = ResultStore(str(store)).read("importance", run_id).to_pylist()
    assert len(rows) == 8 and {r["method"] for r in rows} == {"lrp"}
    for layer in (0, 1):
        # float64 shares of one layer total, read back from Parquet
        assert sum(r["score_normalized"] for r in rows if r["layer"] == layer) == pytest.approx(1.0)
    assert sorted(r["rank"] for r in rows) == list(range(1, 9))


@pytest.mark.parametrize(("roles", "expected"), [
    ({"frequencies": "missing.txt"}, "roles.frequencies: file not found: missing.txt"),
    ({"frequencies": "dictionary"}, "roles.frequencies: dictionary needs a fairseq model"),
    ({"offsets": [0, 1]}, "roles.offsets must be distinct non-zero relative offsets"),
    ({"rare_threshold": 1.5}, "roles.rare_threshold must be a share in (0, 1], got 1.5"),
    ({"ofsets": [1]}, "unknown config key 'roles.ofsets'"),
])
def test_bad_roles_config_is_one_line_and_writes_nothing(tmp_path, tiny_bert_dir, tiny_dev_tsv, roles, expected):
    config = roles_config(tmp_path / "c.yaml", tiny_bert_dir, tiny_dev_tsv, **roles)
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 2
    assert error_line(proc.stderr).startswith(f"headsweep: error: {expected}")
    assert not (tmp_path / "store").exists()
