"""Multi30k en->fr through the hf_seq2seq family: a tiny Marian trained here, its BLEU against the plain generate loop.

A transformers ``MarianMTModel`` (3+3 layers, 4 heads, d=128; smoke: 1+1 layers, 2 heads, d=32) with a byte-level BPE
tokenizer trained on the Multi30k training text (``multi30k.VOCAB`` pieces, shared by both languages) is trained
for ``--minutes`` (batches of 64 pairs; bench/multi30k.py's fairseq recipe: Adam, a linear warm-up to the peak
learning rate, then its inverse square root, gradients clipped, label smoothing 0.1) and cached. The adapter of
``model.kind: hf_seq2seq`` then evaluates the unmasked model and the single-head grid on the first ``--sentences``
sentences of test_2016_flickr; the plain route is the users' loop: ``generate`` over the same sentences in batches
of the same size, in file order, decoded with ``batch_decode`` and scored with ``sacrebleu.corpus_bleu``.

RESULT ``multi30k_hf_seq2seq bleu=<adapter> plain_bleu=<plain loop> identical=<sentences with the same hypothesis>
sentences=<n> heads=<n> grid_s=<single-head grid seconds> train_minutes=<m> steps=<n>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from bench import common, multi30k

SPECIALS = ["<pad>", "</s>", "<unk>"]


def parse_args() -> argparse.Namespace:
    parser = common.command_line(__doc__)
    parser.add_argument("--minutes", type=float, default=20.0, help="training time (smoke: 0.1)")
    parser.add_argument("--sentences", type=int, default=200, help="test sentences evaluated (smoke: 6)")
    return parser.parse_args()


def sizes() -> dict:
    # bench/multi30k.py's fairseq recipe: peak learning rate after a linear warm-up, then its inverse square root;
    # gradients clipped at norm 1, label smoothing 0.1
    recipe = {"warmup": 300, "clip_norm": 1.0, "label_smoothing": 0.1}
    if common.SMOKE:  # an untrained model writes to its token limit: a short one keeps the smoke run short
        return {"layers": 1, "heads": 2, "d_model": 32, "ffn": 64, "lr": 1e-2, "max_new_tokens": 12, **recipe}
    return {"layers": 3, "heads": 4, "d_model": 128, "ffn": 512, "lr": 2e-3, "max_new_tokens": 64, **recipe}


def build_tokenizer(lines: list[str]):
    """A byte-level BPE of ``multi30k.VOCAB`` pieces over ``lines`` that ends every sequence in ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=multi30k.VOCAB, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def trained_model(minutes: float) -> tuple[Path, int]:
    """The cached model folder for these sizes and minutes (trained here the first time) and its update count."""
    from transformers import MarianConfig, MarianMTModel

    s = sizes()
    key = hashlib.sha256(json.dumps([s, minutes, multi30k.VOCAB]).encode()).hexdigest()[:10]
    folder = multi30k.CACHE / f"hf_seq2seq_marian_{key}"
    if (folder / "config.json").is_file():
        return folder, int(json.loads((folder / "headsweep_training.json").read_text())["steps"])
    src = common.read_gz(multi30k.DATA / f"train.{multi30k.SRC}.gz")
    tgt = common.read_gz(multi30k.DATA / f"train.{multi30k.TGT}.gz")
    tokenizer = build_tokenizer(src + tgt)
    torch.manual_seed(0)
    config = MarianConfig(vocab_size=len(tokenizer), d_model=s["d_model"], encoder_layers=s["layers"],
                          decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                          decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"],
                          max_position_embeddings=256, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                          dropout=0.1)
    model = MarianMTModel(config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=(0.9, 0.98))
    warmup = s["warmup"]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min((step + 1) / warmup,
                                                                             (warmup / (step + 1)) ** 0.5))
    g = torch.Generator().manual_seed(0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < minutes * 60:
        rows = torch.randint(0, len(src), (64,), generator=g).tolist()
        batch = tokenizer([src[i] for i in rows], padding=True, return_tensors="pt")
        labels = tokenizer(text_target=[tgt[i] for i in rows], padding=True, return_tensors="pt")["input_ids"]
        labels = labels.masked_fill(labels.eq(0), -100)
        # decoder inputs as ``labels=`` would shift them, without the model's own (unsmoothed) loss
        logits = model(**batch, decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 label_smoothing=s["label_smoothing"])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
        optimizer.step()
        schedule.step()
        steps += 1
    model.eval()
    model.generation_config.num_beams = 4
    model.generation_config.max_new_tokens = s["max_new_tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "headsweep_training.json").write_text(json.dumps({"steps": steps, "minutes": minutes, **s}))
    return folder, steps


def plain_loop(folder: Path, sources: list[str], references: list[str], batch: int, generation) -> tuple[float, list]:
    """The users' loop on a fresh load: ``generate`` in batches (file order), ``batch_decode``, sacrebleu."""
    import sacrebleu
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out: list[str] = []
    with torch.no_grad():
        for first in range(0, len(sources), batch):
            inputs = tokenizer(sources[first : first + batch], padding=True, return_tensors="pt")
            out += tokenizer.batch_decode(model.generate(**inputs, generation_config=generation),
                                          skip_special_tokens=True)
    return sacrebleu.corpus_bleu(out, [references]).score, out


def main() -> None:
    args = parse_args()
    smoke = common.enable_smoke(args)
    common.quiet_logging()
    multi30k.require("multi30k_hf_seq2seq")
    minutes = 0.1 if smoke else args.minutes
    n = 6 if smoke else args.sentences
    folder, steps = trained_model(minutes)
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.registry import model_family

    family = model_family("hf_seq2seq")
    test = multi30k.DATA / multi30k.TEST
    data = family.data_config(source=f"{test}.{multi30k.SRC}.gz", target=f"{test}.{multi30k.TGT}.gz",
                              max_examples=n)
    batch = 32
    adapter = family.load(family.model_config(path=str(folder)), data, RuntimeOptions(batch_size=batch))
    [baseline] = adapter.evaluate([[]])
    heads = adapter.describe().inventory.heads
    start = time.perf_counter()
    adapter.evaluate([[h] for h in heads])
    grid_s = time.perf_counter() - start
    plain_bleu, plain = plain_loop(folder, adapter.pairs.sources, adapter.pairs.references, batch, adapter.generation)
    identical = sum(a == b for a, b in zip(baseline.outputs, plain, strict=True))
    common.result("multi30k_hf_seq2seq", bleu=f"{baseline.score:.4f}", plain_bleu=f"{plain_bleu:.4f}",
                  identical=identical, sentences=len(plain), heads=len(heads), grid_s=f"{grid_s:.1f}",
                  train_minutes=f"{minutes:g}", steps=steps)


if __name__ == "__main__":
    main()
