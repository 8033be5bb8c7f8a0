"""Tiny transformers models built in the test, with random but fixed weights."""

from __future__ import annotations

import copy

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)


def tiny_classifier(family: str = "bert", attn: str = "eager", layers: int = 2, heads: int = 4, seed: int = 0):
    """A randomly initialised sequence classifier of the given family, in eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=60, num_labels=3, attn_implementation=attn)
    if family == "bert":
        cfg = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=64, max_position_embeddings=64, **common)
        model = BertForSequenceClassification(cfg)
    elif family == "roberta":
        cfg = RobertaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=64, max_position_embeddings=70, pad_token_id=1, **common)
        model = RobertaForSequenceClassification(cfg)
    elif family == "distilbert":
        cfg = DistilBertConfig(dim=32, n_layers=layers, n_heads=heads, hidden_dim=64,
                               max_position_embeddings=64, **common)
        model = DistilBertForSequenceClassification(cfg)
    else:
        raise ValueError(family)
    return model.eval()


def random_batch(batch: int = 5, length: int = 9, seed: int = 1):
    """Token ids with ragged padding so the attention mask matters."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        cut = length - (i % 3)
        ids[i, cut:] = 0
        mask[i, cut:] = 0
    return ids, mask


def save_tiny_classifier(out_dir, layers: int = 2, heads: int = 4, seed: int = 0):
    """A tiny random BERT classifier over the demo vocabulary, saved like a user's model directory."""
    from transformers import BertConfig, BertForSequenceClassification

    from headsweep.sweep.demo.sentiment import build_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    cfg = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=64, max_position_embeddings=64, num_labels=2,
        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1},
        # Large random weights, so that predictions depend on the input and on single heads.
        initializer_range=1.0,
    )
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_float64_bert(num_labels: int = 3, layers: int = 2, heads: int = 4, seed: int = 0,
                      initializer_range: float = 0.3, attn: str = "eager"):
    """A tiny random BERT classifier in float64 and eval mode, for gradient checks.

    Weights larger than BERT's default (0.02) so that heads change the loss visibly, and
    float64 so that finite differences agree with autograd to many digits.
    """
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=64, max_position_embeddings=64, num_labels=num_labels,
                     initializer_range=initializer_range, attn_implementation=attn)
    return BertForSequenceClassification(cfg).double().eval()


def zeroed_copy(model, heads):
    """The independent route to an ablation: a copy with the output-projection (W_O) columns of ``heads``
    set to zero, the bias kept."""
    from headsweep.workers.families.hf_classifier.sites import find_sites

    ref = copy.deepcopy(model)
    sites = {s.key: s for s in find_sites(ref)}
    with torch.no_grad():
        for h in heads:
            s = sites[(h.attention, h.layer)]
            s.out_proj.weight[:, h.head * s.head_dim : (h.head + 1) * s.head_dim] = 0.0
    return ref
