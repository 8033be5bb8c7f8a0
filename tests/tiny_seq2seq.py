"""Tiny transformers encoder-decoder models (Marian, T5, FSMT) built in the test from their config classes, with a
word-level tokenizer over the synthetic translation task's words (FSMT: its own Moses + BPE tokenizer, with
vocabulary and merges files written here), and a few seconds of training where a test needs translations that are
partly right."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from headsweep.sweep.demo.translation import synthetic_pairs

SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2: T5's convention (Marian starts decoding from <pad> too)
FAIRSEQ_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3: fairseq's dictionary, which FSMT keeps
KINDS = ("marian", "t5", "fsmt")


def words() -> list[str]:
    """Every word of the synthetic task (source and target side), in a fixed order."""
    src, tgt = synthetic_pairs(3000, seed=0)
    return sorted({w for line in src + tgt for w in line.split()})


def build_tokenizer():
    """A word-level tokenizer over :func:`words` that ends every sequence in ``</s>``, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def bpe_files(folder: Path) -> tuple[Path, Path]:
    """FSMT's vocabulary (``vocab-src.json``, also the target's) and ``merges.txt`` over :func:`words`: every word is
    merged from its first letter on (``c a``, ``ca t</w>``), so every word is one token and every piece a merge can
    leave is in the vocabulary (a merge of another word's may split a word into two known pieces)."""
    import json

    merges: list[tuple[str, str]] = []
    pieces = {c for w in words() for c in w} | {f"{w[-1]}</w>" for w in words()}
    for word in words():
        symbols = [*word[:-1], f"{word[-1]}</w>"]
        left = symbols[0]
        for right in symbols[1:]:
            merges.append((left, right))
            left += right
            pieces.add(left)
    vocab = {w: i for i, w in enumerate(FAIRSEQ_SPECIALS + sorted(pieces))}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("".join(f"{a} {b} {i}\n" for i, (a, b) in enumerate(dict.fromkeys(merges))))
    return folder / "vocab.json", folder / "merges.txt"


def build_fsmt_tokenizer(folder: Path):
    """FSMT's own tokenizer (Moses, then BPE) over :func:`bpe_files` written in ``folder``, English to French."""
    from transformers import FSMTTokenizer

    vocab, merges = bpe_files(folder)
    return FSMTTokenizer(langs=["en", "fr"], src_vocab_file=str(vocab), tgt_vocab_file=str(vocab),
                         merges_file=str(merges))


def tiny_seq2seq(kind: str = "marian", seed: int = 0, layers: int = 2, heads: int = 4, head_dim: int = 8,
                 vocab_size: int | None = None):
    """A randomly initialised tiny Marian, T5 (``t5_v1_1``: T5 v1.1's gated feed-forward), FSMT, MVP, NLLB-MoE or
    Switch Transformers model (eval mode), weights larger than the default initialisation so that single heads change
    the beams."""
    import transformers

    torch.manual_seed(seed)
    vocab = vocab_size or (len(fsmt_vocab()) if kind == "fsmt" else len(SPECIALS) + len(words()))
    width = heads * head_dim
    ids = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if kind == "marian":
        cfg = transformers.MarianConfig(vocab_size=vocab, d_model=width, encoder_layers=layers, decoder_layers=layers,
                                        encoder_attention_heads=heads, decoder_attention_heads=heads,
                                        encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                                        max_position_embeddings=64, init_std=0.2, dropout=0.0,
                                        attention_dropout=0.0, activation_dropout=0.0, **ids)
        model = transformers.MarianMTModel(cfg)
    elif kind in ("t5", "t5_v1_1"):  # T5 v1.1 / mT5: gated-GELU feed-forward, untied embeddings
        v1_1 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if kind == "t5_v1_1" else {}
        cfg = transformers.T5Config(vocab_size=vocab, d_model=width, d_kv=head_dim, num_heads=heads, d_ff=2 * width,
                                    num_layers=layers, num_decoder_layers=layers, dropout_rate=0.0,
                                    initializer_factor=3.0, **v1_1, **ids)
        model = transformers.T5ForConditionalGeneration(cfg)
    elif kind == "fsmt":  # fairseq's dictionary order: <s> 0, <pad> 1, </s> 2; decoding starts from </s>
        cfg = transformers.FSMTConfig(langs=["en", "fr"], src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=width,
                                      encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
                                      decoder_attention_heads=heads, encoder_ffn_dim=2 * width,
                                      decoder_ffn_dim=2 * width, max_position_embeddings=64, init_std=0.2,
                                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        model = transformers.FSMTForConditionalGeneration(cfg)
    elif kind == "mvp":  # BART's blocks (no prompts)
        cfg = transformers.MvpConfig(vocab_size=vocab, d_model=width, encoder_layers=layers, decoder_layers=layers,
                                     encoder_attention_heads=heads, decoder_attention_heads=heads,
                                     encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width, max_position_embeddings=64,
                                     init_std=0.2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids)
        model = transformers.MvpForConditionalGeneration(cfg)
    elif kind == "nllb_moe":  # every feed-forward layer a top-2 mixture of 4 experts
        cfg = transformers.NllbMoeConfig(vocab_size=vocab, d_model=width, encoder_layers=layers, decoder_layers=layers,
                                         encoder_attention_heads=heads, decoder_attention_heads=heads,
                                         encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width, num_experts=4,
                                         encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=64,
                                         init_std=0.2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                         **ids)
        model = transformers.NllbMoeForConditionalGeneration(cfg)
    elif kind == "switch":  # T5's blocks, every feed-forward layer a top-1 mixture of 4 experts
        cfg = transformers.SwitchTransformersConfig(vocab_size=vocab, d_model=width, d_kv=head_dim, num_heads=heads,
                                                    d_ff=2 * width, num_layers=layers, num_decoder_layers=layers,
                                                    num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1,
                                                    dropout_rate=0.0, initializer_factor=3.0, **ids)
        model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    else:
        raise ValueError(kind)
    model.generation_config.num_beams = 4
    model.generation_config.max_new_tokens = 20
    return model.eval()


def train(model, tokenizer, n_pairs: int = 1500, steps: int = 300, seed: int = 0, lr: float = 3e-3):
    """A few hundred Adam steps on the synthetic task (batches of 32), so that beam search gives partly right
    translations; eval mode after."""
    src, tgt = synthetic_pairs(n_pairs, seed=seed)
    g = torch.Generator().manual_seed(seed)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        rows = torch.randint(0, len(src), (32,), generator=g).tolist()
        batch = tokenizer([src[i] for i in rows], padding=True, return_tensors="pt")
        labels = tokenizer(text_target=[tgt[i] for i in rows], padding=True, return_tensors="pt")["input_ids"]
        labels = labels.masked_fill(labels.eq(tokenizer.pad_token_id), -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def fsmt_vocab() -> dict[str, int]:
    """The vocabulary :func:`bpe_files` writes (built in a scratch folder)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        return json.loads(bpe_files(Path(scratch))[0].read_text())


def save_tiny_seq2seq(out_dir: Path, kind: str = "marian", steps: int = 0, seed: int = 0) -> Path:
    """A tiny Marian, T5 or FSMT model (trained for ``steps`` steps) and its tokenizer, saved like a user's
    folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:  # FSMT's tokenizer reads its files once; save_pretrained copies them
        tokenizer = build_fsmt_tokenizer(Path(scratch)) if kind == "fsmt" else build_tokenizer()
    model = tiny_seq2seq(kind, seed)
    if steps:
        train(model, tokenizer, steps=steps, seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def write_pairs(folder: Path, n: int = 12, seed: int = 11, split: str = "test") -> tuple[Path, Path]:
    """``n`` synthetic pairs as raw text files (``<split>.src``, ``<split>.tgt``)."""
    src, tgt = synthetic_pairs(n, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.src").write_text("\n".join(src) + "\n")
    (folder / f"{split}.tgt").write_text("\n".join(tgt) + "\n")
    return folder / f"{split}.src", folder / f"{split}.tgt"


@contextlib.contextmanager
def zeroed_head(model, head):
    """The independent route: inside, ``model``'s output projection has ``head``'s input columns set to zero by
    weight surgery (no hooks, no gate code; found by the architecture's own module names); restored after."""
    proj, head_dim = projection(model, head)
    columns = slice(head.head * head_dim, (head.head + 1) * head_dim)
    saved = proj.weight[:, columns].detach().clone()
    with torch.no_grad():
        proj.weight[:, columns] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            proj.weight[:, columns] = saved


def projection(model, head):
    """The output projection of ``head``'s module and the head size, by the architecture's own module names."""
    if hasattr(model, "model") and hasattr(model.model, "encoder"):  # Marian / BART
        stack = model.model.encoder if head.attention == "enc_self" else model.model.decoder
        layer = stack.layers[head.layer]
        module = layer.encoder_attn if head.attention == "enc_dec" else layer.self_attn
        return module.out_proj, module.head_dim
    stack = model.encoder if head.attention == "enc_self" else model.decoder  # T5
    block = stack.block[head.layer]
    module = block.layer[1].EncDecAttention if head.attention == "enc_dec" else block.layer[0].SelfAttention
    return module.o, module.key_value_proj_dim
