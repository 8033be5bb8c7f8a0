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
    from headsweep.workers.families.hf_shared.sites import find_sites

    ref = copy.deepcopy(model)
    sites = {s.key: s for s in find_sites(ref)}
    with torch.no_grad():
        for h in heads:
            s = sites[(h.attention, h.layer)]
            s.out_proj.weight[:, h.head * s.head_dim : (h.head + 1) * s.head_dim] = 0.0
    return ref


def tiny_albert(layers: int = 3, groups: int = 1, inner: int = 1, heads: int = 4, seed: int = 0, vocab: int = 60,
                attn: str = "eager", **extra):
    """A random ALBERT classifier in eval mode: ``groups`` layer groups of ``inner`` layers each, run ``layers``
    times (the stock ALBERT: one group of one layer, shared by every depth). Weights larger than ALBERT's default,
    so that single heads move the logits."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(seed)
    cfg = AlbertConfig(vocab_size=vocab, embedding_size=16, hidden_size=32, num_hidden_layers=layers,
                       num_hidden_groups=groups, inner_group_num=inner, num_attention_heads=heads,
                       intermediate_size=64, max_position_embeddings=64, num_labels=extra.pop("num_labels", 3),
                       initializer_range=0.3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       classifier_dropout_prob=0.0, attn_implementation=attn, **extra)
    return AlbertForSequenceClassification(cfg).eval()


def save_tiny_albert(out_dir, layers: int = 3, heads: int = 4, seed: int = 0):
    """A tiny random ALBERT classifier (one layer shared by ``layers`` depths) over the demo vocabulary, with the
    demo's BERT-style word-level tokenizer, saved like a user's model directory."""
    from headsweep.sweep.demo.sentiment import build_tokenizer

    tokenizer = build_tokenizer()
    model = tiny_albert(layers=layers, heads=heads, seed=seed, vocab=len(tokenizer), num_labels=2,
                        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# -- decoder-only language models -------------------------------------------------------------------------

LM_WORDS = ("the a cat dog bird sees likes eats runs sleeps big small red green and then today here there "
            "quickly slowly river tree house").split()
LM_SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]

# (transformers config class name, query heads, key/value heads, extra config): the shapes the gate tests cover.
CAUSAL_LM_SHAPES = {
    "llama_8q2kv": ("LlamaConfig", 8, 2, {}),
    "qwen2_14q2kv": ("Qwen2Config", 14, 2, {}),  # Qwen2.5-0.5B's non-power-of-two shape; q/k/v biases
    "llama_mqa_4q1kv": ("LlamaConfig", 4, 1, {}),
    "llama_4q4kv": ("LlamaConfig", 4, 4, {}),
    "mistral_4q2kv": ("MistralConfig", 4, 2, {}),
    "qwen3_4q2kv": ("Qwen3Config", 4, 2, {}),
    "gpt2": ("GPT2Config", 4, 4, {}),
    "gpt_bigcode_mqa": ("GPTBigCodeConfig", 4, 1, {"multi_query": True}),
    "gpt_neox": ("GPTNeoXConfig", 4, 4, {"rotary_pct": 0.25}),  # Pythia's layout: fused per-head query_key_value
}


def build_lm_tokenizer():
    """A word-level tokenizer over ``LM_WORDS`` with BOS ``<s>`` and EOS ``</s>``, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(LM_SPECIALS + LM_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def tiny_causal_lm(shape: str = "llama_8q2kv", attn: str = "eager", layers: int = 2, seed: int = 0,
                   head_dim: int = 4, vocab_size: int | None = None, max_positions: int = 64):
    """A randomly initialised causal LM of one of ``CAUSAL_LM_SHAPES``, in eval mode.

    Weights larger than the default initialisation, so that single heads change the logits visibly.
    """
    import transformers

    name, heads, kv, extra = CAUSAL_LM_SHAPES[shape]
    torch.manual_seed(seed)
    vocab = vocab_size or len(LM_SPECIALS) + len(LM_WORDS)
    width = heads * head_dim
    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                  attn_implementation=attn)
    if name in ("GPT2Config", "GPTBigCodeConfig"):
        cfg = getattr(transformers, name)(n_embd=width, n_layer=layers, n_head=heads, n_inner=2 * width,
                                          n_positions=max_positions, **common, **extra)
    elif name == "GPTNeoXConfig":  # no head_dim nor key/value heads of its own: hidden_size / heads
        cfg = transformers.GPTNeoXConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                                         intermediate_size=2 * width, max_position_embeddings=max_positions,
                                         **common, **extra)
    else:
        cfg = getattr(transformers, name)(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv, head_dim=head_dim, intermediate_size=2 * width,
                                          max_position_embeddings=max_positions, **common, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if name == "Qwen2Config":  # the biases start at zero: make them matter
        with torch.no_grad():
            for module in model.modules():
                for proj in ("q_proj", "k_proj", "v_proj"):
                    bias = getattr(getattr(module, proj, None), "bias", None)
                    if bias is not None:
                        bias.normal_(0.0, 0.5)
    return model.eval()


def save_tiny_causal_lm(out_dir, shape: str = "llama_8q2kv", layers: int = 2, seed: int = 0,
                        max_positions: int = 64, tokenizer: bool = True):
    """A tiny random causal LM and its word-level tokenizer, saved like a user's model directory."""
    model = tiny_causal_lm(shape, "eager", layers=layers, seed=seed, max_positions=max_positions)
    model.config._attn_implementation = None  # let the loader choose (eager / sdpa) as a user's folder does
    model.save_pretrained(out_dir)
    if tokenizer:
        build_lm_tokenizer().save_pretrained(out_dir)
    return out_dir


def lm_text(n_words: int, seed: int = 0) -> str:
    """Random text over ``LM_WORDS``: lines of 3 to 12 words."""
    import random

    rng = random.Random(seed)
    lines, left = [], n_words
    while left > 0:
        k = min(left, rng.randint(3, 12))
        lines.append(" ".join(rng.choice(LM_WORDS) for _ in range(k)))
        left -= k
    return "\n".join(lines) + "\n"


def zeroed_output_columns(model, heads):
    """The independent route for decoder-only models: a copy whose output projection has each head's input
    features zeroed by weight surgery (``o_proj`` columns; rows of GPT-2's transposed ``Conv1D`` ``c_proj``)."""
    from torch import nn

    from headsweep.workers.families.hf_causal_lm.model.sites import find_sites

    ref = copy.deepcopy(model)
    sites = {s.key: s for s in find_sites(ref)}
    with torch.no_grad():
        for h in heads:
            s = sites[(h.attention, h.layer)]
            span = slice(h.head * s.head_dim, (h.head + 1) * s.head_dim)
            if isinstance(s.out_proj, nn.Linear):
                s.out_proj.weight[:, span] = 0.0
            else:  # Conv1D: weight (in, out)
                s.out_proj.weight[span, :] = 0.0
    return ref


def lm_batch(vocab: int, rows: int = 3, length: int = 10, seed: int = 1) -> torch.Tensor:
    """Random token ids (above the special tokens 0-3) for a tiny causal LM."""
    return torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def lm_logits(model, ids):
    """A causal LM's logits for ``ids``, without gradients or a key/value cache."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits
