"""The benchmarks' BERT classifiers: a word-level tokenizer with BERT's special tokens (real_size, grid_speed), and
grid_speed's random classifier on SST-2, which screening sweeps too.

The classifier: a 6-layer, 12-head BERT (hidden 384 = 12 x 32, intermediate 1536), randomly initialised (seeded;
``initializer_range`` 0.2 so that predictions depend on the input and on heads), a word-level tokenizer over the
SST-2 training vocabulary, and the first sentences of SST-2 dev (``../shared/data/sst2``; generated sentences where
that is absent). Smoke mode: a 2-layer, 4-head BERT of width 32 on the smoke copy of SST-2.
"""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from bench import common

SST2 = common.DATA / "sst2"
N_CLASSIFIER = 1000
CLASSIFIER = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}


@common.on_smoke
def use_smoke() -> None:
    """A 2x4 BERT of width 32 on the smoke copy of SST-2."""
    global SST2, N_CLASSIFIER, CLASSIFIER
    SST2 = common.smoke_data() / "sst2"
    N_CLASSIFIER = common.SMOKE_EXAMPLES
    CLASSIFIER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def frequent_words(sentences: list[str], n: int) -> list[str]:
    """The ``n`` most frequent words of ``sentences``, lower-cased, split as the tokenizer splits them."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Whitespace()
    counts = Counter(w for s in sentences for w, _ in split.pre_tokenize_str(s.lower()))
    return [w for w, _ in counts.most_common(n)]


def bert_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over ``words`` with BERT's special tokens (``[CLS] text [SEP]``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def sst2_rows(n: int) -> tuple[list[tuple[str, str]], list[str], str]:
    """``n`` (sentence, label) rows to evaluate, training sentences for the vocabulary, and the source."""
    if (SST2 / "dev.tsv").exists() and (SST2 / "train.tsv").exists():
        def read(name):
            with open(SST2 / name, newline="", encoding="utf-8") as f:
                return [(r[0].strip(), r[1]) for r in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]
        return read("dev.tsv")[:n], [s for s, _ in read("train.tsv")], f"SST-2 dev (first {n})"
    from headsweep.sweep.demo.sentiment import generate

    rows = [(t, str(y)) for t, y in generate(n, seed=11)]
    return rows, [t for t, _ in generate(5000, seed=12)], "generated sentences (SST-2 absent)"


def classifier_shape() -> str:
    """``<layers> layers x <heads> heads`` of the classifier."""
    return f"{CLASSIFIER['num_hidden_layers']} layers x {CLASSIFIER['num_attention_heads']} heads"


def save_classifier(workdir: Path, n_examples: int | None = None) -> tuple[Path, Path, str]:
    """The classifier (random BERT of ``CLASSIFIER``'s shape, word tokenizer over the 16,000 most frequent words of
    SST-2 train) and its first ``n_examples`` (default ``N_CLASSIFIER``) SST-2 dev rows, saved under ``workdir``:
    (model folder, data file, where the rows came from)."""
    n_examples = n_examples or N_CLASSIFIER
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    rows, train_text, source = sst2_rows(n_examples)
    tokenizer = bert_tokenizer(frequent_words(train_text, 16000))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tokenizer), **CLASSIFIER, max_position_embeddings=128, num_labels=2,
                     initializer_range=0.2, id2label={0: "0", 1: "1"}, label2id={"0": 0, "1": 1})
    model_dir = workdir / f"bert-{CLASSIFIER['num_hidden_layers']}x{CLASSIFIER['num_attention_heads']}"
    BertForSequenceClassification(cfg).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = workdir / f"sst2-{n_examples}.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows), encoding="utf-8")
    return model_dir, data, source
