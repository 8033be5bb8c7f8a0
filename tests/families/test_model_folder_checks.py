"""A model folder whose ``config.json`` does not describe its weights, labels that read two ways, and a paired answer
the tokenizer does not know are refused, not run.

Through the real CLI (exit 2, the one line the user reads, no traceback, no store folder), each built from the tests'
tiny models by editing a copy: a BERT classifier whose config says 2 layers beside weights of 3, a Llama whose
config says 4 query heads beside weights of 8, a classifier whose ``id2label`` swaps the numbers 0 and 1, and a
paired answer that encodes to ``<unk>``. In-process: the same checks' other sides (weights of fewer layers than the
config, what transformers and the check leave out of the count, numeric label names that read one way only).
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import run_refused
from tiny_models import lm_text, save_tiny_causal_lm, save_tiny_classifier

from headsweep.errors import HeadsweepError

FIX = "correct config.json, or use the config.json saved with these weights"


def edited_config(folder, **changes):
    """Set ``changes`` in ``folder``'s config.json; returns the folder."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def write_config(path, model: dict, data: dict):
    path.write_text(yaml.safe_dump({"model": model, "data": data,
                                    "sweep": {"experiments": ["baseline", "single_head"], "workers": 1}}))
    return path


def refused_line(tmp_path, ray_address, model: dict, data: dict) -> str:
    """The one error line of a run of ``model`` on ``data`` (``run_refused``'s checks: exit 2, no traceback, nothing on
    stdout, no store folder)."""
    config = write_config(tmp_path / f"{tmp_path.name}.yaml", model, data)
    return run_refused(config, tmp_path / "store", ray_address)


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    """A tiny Llama (8 query heads, 2 key/value heads of head_dim 4) and a corpus it reads."""
    tmp = tmp_path_factory.mktemp("folder_checks")
    corpus = tmp / "corpus.txt"
    corpus.write_text(lm_text(200, seed=5))
    return save_tiny_causal_lm(tmp / "llama", "llama_8q2kv"), corpus


def test_config_with_fewer_layers_than_the_weights(tmp_path, tiny_dev_tsv, ray_address):
    """transformers drops the third layer's weights and logs it; the run would score a model without it."""
    folder = edited_config(save_tiny_classifier(tmp_path / "bert3", layers=3), num_hidden_layers=2)
    line = refused_line(tmp_path, ray_address, {"kind": "hf_classifier", "path": str(folder)},
                        {"path": str(tiny_dev_tsv)})
    assert line == (f"headsweep: error: {folder}/config.json does not match the weights beside it (it says "
                    "num_hidden_layers 2, the weights hold 3 layers): 16 of their tensors have no place in the "
                    "BertForSequenceClassification it describes and would be dropped "
                    "(bert.encoder.layer.2.attention.output.LayerNorm.bias, "
                    "bert.encoder.layer.2.attention.output.LayerNorm.weight, "
                    f"bert.encoder.layer.2.attention.output.dense.bias and 13 more); {FIX}")


def test_llama_config_with_other_head_counts(tmp_path, llama_files, ray_address):
    """Llama-style configs give head_dim apart from the width, so a wrong head count is a wrong shape: named with the
    config's counts and the heads the weights hold, not as a failed load pointing at a log."""
    llama, corpus = llama_files
    folder = edited_config(shutil.copytree(llama, tmp_path / "llama-4q"), num_attention_heads=4)
    line = refused_line(tmp_path, ray_address, {"kind": "hf_causal_lm", "path": str(folder)},
                        {"path": str(corpus), "window": 16})
    assert line == (f"headsweep: error: {folder}/config.json does not match the weights beside it: its "
                    "num_attention_heads 4, num_key_value_heads 2, head_dim 4, hidden_size 32 make "
                    "model.layers.0.self_attn.o_proj.weight 32 x 16, but the weights' is 32 x 32, 8 query heads of "
                    f"head_dim 4 (and 3 more tensors of other shapes); {FIX}")


def test_swapped_numeric_label_names(tmp_path, tiny_bert_dir, tiny_dev_tsv, ray_address):
    """id2label {0: "1", 1: "0"}: the file's 0/1 read as names would be the other label each (accuracy 1 - a)."""
    folder = edited_config(shutil.copytree(tiny_bert_dir, tmp_path / "swapped"), id2label={"0": "1", "1": "0"},
                           label2id={"1": 0, "0": 1})
    labels = [row.split("\t")[1] for row in tiny_dev_tsv.read_text().splitlines()[1:]]
    zeros = [i for i, label in enumerate(labels) if label == "0"]
    assert labels[0] == "0" and len(zeros) > 5 and set(labels) == {"0", "1"}
    line = refused_line(tmp_path, ray_address, {"kind": "hf_classifier", "path": str(folder)},
                        {"path": str(tiny_dev_tsv)})
    # Rows of data from 1; the TSV's first line is its header.
    shown = ", ".join(f"{i + 1} (line {i + 2})" for i in zeros[:5])
    assert line == (f"headsweep: error: data file {tiny_dev_tsv}: label '0' in rows {shown} "
                    f"and {len(zeros) - 5} more is ambiguous: as a label id it is 0, as a label name id 1 (the "
                    "model's id2label: 0='1', 1='0'); rename the labels in the model's config.json (id2label and "
                    "label2id) to names that are not numbers, then write the file's labels as those names or as ids")


def test_paired_answer_that_is_the_unknown_token(tmp_path, llama_files, ray_address):
    llama, _ = llama_files
    rows = [{"clean": "the cat sees a dog", "corrupted": "the dog sees a dog", "answer": "here",
             "wrong_answer": "there"},
            {"clean": "a bird eats", "corrupted": "a cat eats", "answer": "quickly", "wrong_answer": "slowly"},
            {"clean": "the dog runs", "corrupted": "the cat runs", "answer": "today", "wrong_answer": "zebra"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = refused_line(tmp_path, ray_address, {"kind": "hf_causal_lm", "path": str(llama)},
                        {"path": str(data), "task": "paired"})
    assert line == (f"headsweep: error: data file {data}: line 3: wrong_answer 'zebra' is the tokenizer's unknown "
                    "token '<unk>', not a word the model can predict: use an answer the tokenizer knows (most "
                    "tokenizers want the leading space, e.g. ' Mary')")


# -- the other sides, in-process ----------------------------------------------------------------------------------
def test_config_with_more_layers_than_the_weights(tmp_path):
    from headsweep.workers.families.hf_classifier.config import ClassifierModel
    from headsweep.workers.families.hf_classifier.model import load_classifier_model

    folder = edited_config(save_tiny_classifier(tmp_path / "bert2", layers=2), num_hidden_layers=3)
    with pytest.raises(HeadsweepError) as caught:
        load_classifier_model(ClassifierModel(path=str(folder)), "cpu")
    assert str(caught.value) == (
        f"{folder}/config.json does not match the weights beside it (it says num_hidden_layers 3, the weights hold 2 "
        "layers): the BertForSequenceClassification it describes needs 16 tensors they lack, which transformers "
        "would start from random numbers (bert.encoder.layer.2.attention.output.LayerNorm.bias, "
        f"bert.encoder.layer.2.attention.output.LayerNorm.weight, bert.encoder.layer.2.attention.output.dense.bias and "
        f"13 more); {FIX}")


def test_what_transformers_leaves_out_still_loads(tmp_path):
    """A GPT-2 folder as transformers 2 to 4 saved it: tied output embeddings stored once, the causal mask
    (``attn.bias``) and the constant ``attn.masked_bias`` in every layer. It loads, with every stored weight used."""
    import torch
    from safetensors.torch import load_file, save_file

    from headsweep.workers.families.hf_causal_lm.config import CausalLMModel
    from headsweep.workers.families.hf_causal_lm.model.loading import load_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "gpt2-old", "gpt2")
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied to transformer.wte.weight
    for layer in range(2):
        weights[f"transformer.h.{layer}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        weights[f"transformer.h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(CausalLMModel(path=str(folder)), "cpu").model
    state = model.state_dict()
    assert torch.equal(model.lm_head.weight, weights["transformer.wte.weight"])
    assert all(torch.equal(state[k], v) for k, v in weights.items() if k in state and "attn.bias" not in k)
    # A stored tensor the model has no place for is still refused.
    weights["transformer.h.0.attn.extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HeadsweepError, match=r"1 of their tensors have no place in the GPT2LMHeadModel it describes "
                                             r"and would be dropped \(transformer\.h\.0\.attn\.extra\.weight\)"):
        load_causal_lm(CausalLMModel(path=str(folder)), "cpu")


def test_a_pooler_beside_a_classifier_without_one_loads(tmp_path):
    """RoBERTa's classifier pools with its own head: a pretrained model's pooler kept in its weights changes nothing
    it computes."""
    import torch
    from safetensors.torch import load_file, save_file
    from tiny_models import build_lm_tokenizer, tiny_classifier

    from headsweep.workers.families.hf_classifier.config import ClassifierModel
    from headsweep.workers.families.hf_classifier.model import load_classifier_model

    folder = tmp_path / "roberta"
    tiny_classifier("roberta").save_pretrained(folder)
    build_lm_tokenizer().save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    assert not any("pooler" in k for k in weights)
    weights |= {"roberta.pooler.dense.weight": torch.ones(32, 32), "roberta.pooler.dense.bias": torch.ones(32)}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_classifier_model(ClassifierModel(path=str(folder)), "cpu").model
    assert model.roberta.pooler is None and torch.equal(model.classifier.dense.weight,
                                                        weights["classifier.dense.weight"])


def test_numeric_label_names_that_read_one_way():
    from headsweep.workers.families.hf_classifier.data import label_ids

    assert label_ids(["0", "1", "1"], {0: "0", 1: "1"}, "f") == [0, 1, 1]  # names are their own ids
    stars = {0: "1", 1: "2", 2: "3", 3: "4", 4: "5"}
    assert label_ids(["5", "1", "3"], stars, "f") == [4, 0, 2]  # "5" is no id: the file writes names
    with pytest.raises(HeadsweepError, match=r"label '4' in row 1 is ambiguous: as a label id it is 4, as a label "
                                             r"name id 3"):
        label_ids(["4", "1", "3"], stars, "f")  # every label could be an id


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # torch's, about the file this test writes
def test_pickled_weights_the_driver_cannot_read_are_refused_by_torch(tmp_path):
    """A pickle of protocol 4 names its classes with STACK_GLOBAL, which the driver's reading of the file does not
    follow: torch's weights_only load refuses it in the worker, and the line is the same advice to convert."""
    import argparse

    import torch
    from safetensors.torch import load_file
    from tiny_models import save_tiny_classifier

    from headsweep.workers.families.hf_classifier.config import ClassifierModel
    from headsweep.workers.families.hf_classifier.model import load_classifier_model
    from headsweep.workers.families.hf_shared.model_files import check_model_files, foreign_objects

    folder = save_tiny_classifier(tmp_path / "pickled4")
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    binary = folder / "pytorch_model.bin"
    torch.save({**weights, "args": argparse.Namespace(lr=0.1)}, binary, pickle_protocol=4)
    assert foreign_objects(binary) == []
    check_model_files(folder)
    with pytest.raises(HeadsweepError) as caught:
        load_classifier_model(ClassifierModel(path=str(folder)), "cpu")
    assert str(caught.value).startswith(f"{binary} holds pickled Python objects beside its tensors, which headsweep "
                                        "does not load (unpickling runs code from the file): convert it to "
                                        "safetensors once")
