"""A model folder that its family would evaluate wrongly is refused; data its tokenizer cannot read are warned about.

Through the real CLI: a causal LM given as a classifier, a classifier without its trained head, BERT given as a
causal LM, a folder without its tokenizer: exit 2, the one line the user reads, no traceback, and no store
folder. Data that are mostly unknown words, and kv_group on a model without grouped heads: the run completes,
with one ``headsweep: warning:`` line each and the counts in ``runs.facts`` equal to an independent count.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import error_line, run_cli
from tiny_models import lm_text, save_tiny_causal_lm

from headsweep.results.store import ResultStore

WINDOW = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def write_config(path, kind, model_dir, data_file, experiments=("baseline",), model=None, data=None):
    cfg = {
        "model": {"kind": kind, "path": str(model_dir), **(model or {})},
        "data": {"path": str(data_file), **({"window": WINDOW} if kind == "hf_causal_lm" else {}), **(data or {})},
        "sweep": {"experiments": list(experiments), "batch_size": 8},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def refused(tmp_path, ray_address, config) -> str:
    """Run ``config``; assert exit 2, one error line, no traceback, nothing on stdout, no store folder; return the
    error line."""
    store = tmp_path / f"store-{config.stem}"
    proc = run_cli("run", str(config), "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == "", proc.stderr
    assert not store.exists(), sorted(p.name for p in store.rglob("*"))
    return error_line(proc.stderr)


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    """A tiny Llama causal LM without grouped heads (4 query, 4 key/value heads), and a corpus it reads."""
    tmp = tmp_path_factory.mktemp("family_checks")
    model_dir = save_tiny_causal_lm(tmp / "tiny-llama", "llama_4q4kv")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(300, seed=11))
    return tmp, model_dir, corpus


def test_causal_lm_as_classifier(tmp_path, lm_files, tiny_dev_tsv, ray_address):
    _, llama, _ = lm_files
    line = refused(tmp_path, ray_address, write_config(tmp_path / "a.yaml", "hf_classifier", llama, tiny_dev_tsv))
    assert line == (f"headsweep: error: {llama} holds a causal language model (LlamaForCausalLM), not a sequence "
                    "classifier: as model.kind hf_classifier it would get a classification head of random weights; "
                    "set model.kind: hf_causal_lm to evaluate it by perplexity or multiple choice")


def test_classifier_without_trained_head(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    from safetensors.torch import load_file, save_file

    headless = shutil.copytree(tiny_bert_dir, tmp_path / "headless")
    weights = load_file(headless / "model.safetensors")
    assert {"classifier.weight", "classifier.bias"} <= set(weights)
    save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")}, headless / "model.safetensors",
              metadata={"format": "pt"})
    line = refused(tmp_path, ray_address, write_config(tmp_path / "b.yaml", "hf_classifier", headless, tiny_dev_tsv))
    assert line == (f"headsweep: error: {headless} has no trained classification head: its weights lack "
                    "classifier.bias, classifier.weight of BertForSequenceClassification, which transformers would "
                    "start from random numbers; model.kind hf_classifier takes sequence classifiers "
                    "(...ForSequenceClassification) with their trained classification head")


# Slow variant: a worker's architecture refusal through the CLI is test_causal_lm_as_classifier's, and this branch of
# the check (a bidirectional encoder as a causal LM) is test_architecture_check_reads_the_config's RobertaForMaskedLM.
@pytest.mark.slow
def test_bert_as_causal_lm(tmp_path, lm_files, tiny_bert_dir, ray_address):
    _, _, corpus = lm_files
    line = refused(tmp_path, ray_address, write_config(tmp_path / "c.yaml", "hf_causal_lm", tiny_bert_dir, corpus))
    assert line == (f"headsweep: error: {tiny_bert_dir} holds a bidirectional encoder (BertForSequenceClassification, "
                    "model_type 'bert'), not a decoder-only causal LM: its tokens see the tokens after them, so a "
                    "perplexity would mean nothing; set model.kind: hf_classifier to sweep it as a classifier")


@pytest.mark.parametrize(("family", "config", "expected"), [
    ("hf_classifier", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "holds a causal language model (GPT2LMHeadModel), not a sequence classifier"),
    ("hf_classifier", {"architectures": ["BertForMaskedLM"], "model_type": "bert"},
     "holds a BertForMaskedLM, not a sequence classifier"),
    ("hf_classifier", {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}, None),
    ("hf_classifier", {"model_type": "llama"}, None),  # no architectures: the weights check decides
    ("hf_causal_lm", {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"},
     "holds a sequence classifier (LlamaForSequenceClassification), not a causal LM"),
    ("hf_causal_lm", {"architectures": ["RobertaForMaskedLM"], "model_type": "roberta"},
     "holds a bidirectional encoder (RobertaForMaskedLM, model_type 'roberta')"),
    ("hf_causal_lm", {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True},
     "holds an encoder-decoder model (T5ForConditionalGeneration)"),
    ("hf_causal_lm", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, None),
    ("hf_causal_lm", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, None),
])
def test_architecture_check_reads_the_config(tmp_path, family, config, expected):
    """The config check on its own, over architectures no tiny folder above has."""
    from headsweep.errors import HeadsweepError
    from headsweep.workers.families.hf_shared.architecture import check_architecture

    if expected is None:
        check_architecture(tmp_path, config, family)
        return
    with pytest.raises(HeadsweepError) as caught:
        check_architecture(tmp_path, config, family)
    assert str(caught.value).startswith(f"{tmp_path} {expected}"), caught.value


def test_model_folder_without_tokenizer(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """Without its tokenizer files, transformers would build BERT's empty 5-token tokenizer (every word [UNK])."""
    bare = shutil.copytree(tiny_bert_dir, tmp_path / "no-tokenizer")
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    line = refused(tmp_path, ray_address, write_config(tmp_path / "d.yaml", "hf_classifier", bare, tiny_dev_tsv))
    assert line == (f"headsweep: error: no tokenizer in {bare} (none of tokenizer.json, tokenizer_config.json, "
                    "vocab.json, vocab.txt, merges.txt); save the model's tokenizer into that folder "
                    "(tokenizer.save_pretrained)")


def test_tokenizer_without_vocabulary(tmp_path):
    """``model.tokenizer`` naming a folder whose vocabulary is gone: GPT-2's tokenizer class builds a tokenizer of
    one token from tokenizer_config.json alone, which reads every text as no tokens at all. (In-process: the CLI
    shows this line as it shows the one of a folder without tokenizer files.)"""
    from transformers import GPT2Tokenizer

    from headsweep.errors import HeadsweepError
    from headsweep.workers.families.hf_causal_lm.model.loading import load_tokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": GPT2Tokenizer.__name__}))
    with pytest.raises(HeadsweepError) as caught:  # named from the files alone (the driver's check, before Ray)
        load_tokenizer(str(folder), given=True)
    assert str(caught.value) == (f"no tokenizer vocabulary in {folder}: tokenizer.json is missing (of a tokenizer's "
                                 "files the folder has only tokenizer_config.json) (model.tokenizer)")
    (folder / "vocab.json").write_text("{}")  # vocabulary files that hold nothing: found once loaded
    (folder / "merges.txt").write_text("")
    with pytest.raises(HeadsweepError) as caught:
        load_tokenizer(str(folder), given=True)
    assert str(caught.value) == (f"the tokenizer in {folder} has no vocabulary (1 tokens, all special: <|endoftext|>): "
                                 "its vocabulary files are missing (model.tokenizer)")


def test_word_level_tokenizer_beside_a_qwen2_model(tmp_path):
    """transformers 5 loads a tokenizer.json saved beside a Qwen2 config as Qwen2Tokenizer, whose byte-level rules
    read a word-level vocabulary's sentences as a token or two; the family loads the class the folder declares,
    so every line encodes as the saved tokenizer.json itself encodes it (the tokenizers library, no transformers)."""
    from tokenizers import Tokenizer

    from headsweep.workers.families.hf_causal_lm.model.loading import load_tokenizer

    folder = save_tiny_causal_lm(tmp_path / "qwen2", shape="qwen2_14q2kv")
    saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer = load_tokenizer(str(folder), given=False)
    lines = lm_text(60, seed=3).splitlines()
    assert [tokenizer(line, add_special_tokens=False)["input_ids"] for line in lines] == [
        saved.encode(line, add_special_tokens=False).ids for line in lines]
    assert all(len(tokenizer(line, add_special_tokens=False)["input_ids"]) == len(line.split()) for line in lines)


def with_unknown_words(lines: list[str], every: int = 2) -> list[str]:
    """Every ``every``-th word replaced by one no tokenizer here knows."""
    return [" ".join("zzzq" if i % every == 0 else w for i, w in enumerate(line.split())) for line in lines]


def stored_run(store) -> dict:
    [run] = ResultStore(str(store)).read("runs").to_pylist()
    return run


def test_unknown_words_in_classification_data(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    from transformers import AutoTokenizer

    header, *rows = tiny_dev_tsv.read_text().splitlines()
    texts = with_unknown_words([r.split("\t")[0] for r in rows])
    data = tmp_path / "unknown.tsv"
    data.write_text("\n".join([header, *(f"{t}\t{r.split(chr(9))[1]}" for t, r in zip(texts, rows, strict=True))]))
    store = tmp_path / "store"
    proc = run_cli("run", str(write_config(tmp_path / "f.yaml", "hf_classifier", tiny_bert_dir, data)),
                   "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    # Other route: the words of each text, as the tokenizer reads them without its special tokens.
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    unknown = ids.count(tokenizer.unk_token_id)
    assert unknown == sum(w == "zzzq" for text in texts for w in text.split())  # every such word, and only those
    share = unknown / len(ids)
    assert 0.4 < share < 0.6
    facts = json.loads(stored_run(store)["facts"])
    assert (facts["unknown_tokens"], facts["unknown_token_share"]) == (unknown, pytest.approx(share, abs=1e-12))
    warning = (f"headsweep: warning: data file {data}: {share:.1%} of its tokens ({unknown} of {len(ids)}) are unknown "
               "to the model's tokenizer (read as [UNK]): the model does not see those words, and its scores say "
               "little about the data (another language or script, or another model's tokenizer?)")
    assert [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")] == [warning], proc.stderr


def test_unknown_words_in_a_corpus_and_kv_group_without_groups(tmp_path, lm_files, ray_address):
    """One perplexity run, two warnings: its corpus is a fifth unknown words, and its model has no grouped
    key/value heads (kv_group's 8 masks are single_head's)."""
    from transformers import AutoTokenizer

    _, llama, _ = lm_files
    corpus = tmp_path / "unknown.txt"
    corpus.write_text("\n".join(with_unknown_words(lm_text(300, seed=11).splitlines(), every=5)) + "\n")
    store = tmp_path / "store"
    proc = run_cli("run", str(write_config(tmp_path / "g.yaml", "hf_causal_lm", llama, corpus, ("kv_group",))),
                   "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    tokenizer = AutoTokenizer.from_pretrained(llama)
    ids = tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"]
    unknown = ids.count(tokenizer.unk_token_id)
    words = corpus.read_text().split()
    assert unknown == words.count("zzzq") and len(ids) == len(words)  # word-level: one token a word
    share = unknown / len(ids)
    assert share > 0.10
    run = stored_run(store)
    facts = json.loads(run["facts"])
    assert (facts["unknown_tokens"], facts["unknown_token_share"]) == (unknown, pytest.approx(share, abs=1e-12))
    assert run["status"] == "complete" and run["n_done"] == 2 * 4 + 1  # 2 layers x 4 one-head groups, baseline
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("headsweep: warning:")]
    assert warnings == [
        f"headsweep: warning: data file {corpus}: {share:.1%} of its tokens ({unknown} of {len(ids)}) are unknown to "
        "the model's tokenizer (read as <unk>): the model does not see those words, and its scores say little about "
        "the data (another language or script, or another model's tokenizer?)",
        "headsweep: warning: kv_group: the model has no grouped key/value heads (each layer has as many key/value "
        "heads as query heads): its 8 kv_group masks are one query head each, the same masks as single_head",
    ], proc.stderr


def test_unknown_words_in_multiple_choice_questions(tmp_path, lm_files):
    """The multiple-choice task counts the tokens of each question's context and choices (through the adapter:
    the CLI path is the perplexity run's)."""
    from transformers import AutoTokenizer

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    _, llama, _ = lm_files
    questions = [("the zzzq cat sees", ["a dog", "a zzzq"]), ("a zzzq runs", ["here", "there and zzzq"])]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"context": c, "choices": ch, "gold": 0}) + "\n" for c, ch in questions))
    adapter = load_causal_lm_adapter(CausalLMModel(path=str(llama)),
                                     CausalLMData(path=str(path), task="multiple_choice"), RuntimeOptions())
    tokenizer = AutoTokenizer.from_pretrained(llama)
    # Each question's context once, then each choice after the delimiter (word-level: one token a word).
    words = [w for c, ch in questions for w in [*c.split(), *(w for x in ch for w in x.split())]]
    assert [len(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in words] == [1] * len(words)
    facts = adapter.describe().facts
    assert (facts["unknown_tokens"], facts["unknown_token_share"]) == (4, pytest.approx(4 / len(words)))
    [warning] = facts["warnings"]
    assert warning.startswith(f"data file {path}: {4 / len(words):.1%} of its tokens (4 of {len(words)}) are unknown")
