"""Language codes of multilingual translation models, on real sentencepiece tokenizers: NLLB-200's and M2M100's
(the source code before the sentence, the target code forced as the first generated token) and mBART's (the source
code after the sentence's ``</s>``, the target code as the decoder's start token, as facebook/mbart-large-en-ro's
``decoder_start_token_id``). Each tokenizer folder is what its class saves (the hub's form), over a sentencepiece BPE
model trained here on the synthetic task's sentences, beside a tiny model of the matching architecture.

Checked against the route each model's documentation gives, not against the family's code: the token each
tokenizer's format puts where, and a plain ``generate`` per sentence with ``forced_bos_token_id`` or
``decoder_start_token_id`` set by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_seq2seq import write_pairs

from headsweep.errors import HeadsweepError
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.families.hf_seq2seq.languages import check_language_codes
from headsweep.workers.families.registry import model_family

N_SENTENCES = 6
GENERATION = {"num_beams": 2, "max_new_tokens": 6}


def train_sentencepiece(folder: Path, sentences: list[str]) -> Path:
    """A sentencepiece BPE model over ``sentences`` (what a multilingual model's ``sentencepiece.bpe.model`` is)."""
    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "text.txt").write_text("\n".join(sentences) + "\n")
    sentencepiece.SentencePieceTrainer.train(input=str(folder / "text.txt"), model_prefix=str(folder / "sp"),
                                             vocab_size=120, model_type="bpe", minloglevel=2)
    return folder / "sp.model"


def nllb_tokenizer(spm: Path, out: Path):
    from transformers import NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    raw = out.parent / "nllb_spm"
    raw.mkdir()
    shutil.copy(spm, raw / "sentencepiece.bpe.model")
    # The hub's NLLB folders list their 202 codes as additional special tokens.
    return NllbTokenizer.from_pretrained(raw, additional_special_tokens=FAIRSEQ_LANGUAGE_CODES)


def m2m100_tokenizer(spm: Path, out: Path):
    import sentencepiece
    from transformers import M2M100Tokenizer

    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    raw = out.parent / "m2m_vocab"
    raw.mkdir()
    (raw / "vocab.json").write_text(json.dumps({processor.id_to_piece(i): i
                                                for i in range(processor.get_piece_size())}))
    return M2M100Tokenizer(str(raw / "vocab.json"), str(spm))


def mbart_tokenizer(spm: Path, out: Path):
    from transformers import MBartTokenizer

    raw = out.parent / "mbart_spm"
    raw.mkdir()
    shutil.copy(spm, raw / "sentencepiece.bpe.model")
    return MBartTokenizer.from_pretrained(raw)


# model type, tokenizer builder, source and target codes, where the source code goes, how the target code starts
CASES = {
    "nllb": ("m2m_100", nllb_tokenizer, "fra_Latn", "deu_Latn", "first", "forced_bos_token_id"),
    "m2m100": ("m2m_100", m2m100_tokenizer, "fr", "de", "first", "forced_bos_token_id"),
    "mbart": ("mbart", mbart_tokenizer, "fr_XX", "de_DE", "last", "decoder_start_token_id"),
}


def code_id(tokenizer, code: str) -> int:
    """The code's token id as each tokenizer's documentation looks it up (M2M100: ``get_lang_id``)."""
    getter = getattr(tokenizer, "get_lang_id", None)
    return int(getter(code)) if callable(getter) else int(tokenizer.convert_tokens_to_ids(code))


def tiny_model(model_type: str, tokenizer, target_start: int | None):
    """A 1-layer model of ``model_type`` whose vocabulary covers every id the tokenizer has, codes included. The
    codes' output rows are zero, so that the random model writes words (decoded) rather than codes (skipped)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    # M2M100's codes come after its vocabulary, outside get_vocab()
    ids = [*tokenizer.get_vocab().values(), *getattr(tokenizer, "lang_token_to_id", {}).values()]
    vocab_size = max(ids) + 1
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                               decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                               eos_token_id=2, decoder_start_token_id=target_start if target_start is not None else 2)
    model = AutoModelForSeq2SeqLM.from_config(cfg).eval()
    specials = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "lang_token_to_id", {}))
    codes = sorted({tokenizer.convert_tokens_to_ids(t) for t in specials} - {tokenizer.eos_token_id})
    with torch.no_grad():
        model.get_output_embeddings().weight[codes] = 0.0
    return model


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    from headsweep.sweep.demo.translation import synthetic_pairs

    src, tgt = synthetic_pairs(400, seed=0)
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), src + tgt)


@pytest.fixture(scope="module", params=list(CASES))
def multilingual(request, tmp_path_factory, sentencepiece_model):
    """(case, model folder with the tokenizer as its class saves it, source file, target file)."""
    model_type, build, source_lang, target_lang, _, start = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model_dir = folder / "model"
    tokenizer = build(sentencepiece_model, model_dir)
    # mBART's fine-tuned translation models start decoding from the target code (their config says so)
    target_start = code_id(tokenizer, target_lang) if start == "decoder_start_token_id" else None
    tiny_model(model_type, tokenizer, target_start).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    source, target = write_pairs(folder, N_SENTENCES)
    return request.param, model_dir, source, target


def load(model_dir: Path, source: Path, target: Path, source_lang: str | None, target_lang: str | None):
    family = model_family("hf_seq2seq")
    model_cfg = family.model_config(path=str(model_dir), source_lang=source_lang, target_lang=target_lang,
                                    **GENERATION)
    return family.load(model_cfg, family.data_config(source=str(source), target=str(target)),
                       RuntimeOptions(batch_size=4, masks_per_batch=1))


def test_source_codes_sit_where_the_tokenizer_format_puts_them_and_translations_equal_plain_generate(multilingual):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    case, model_dir, source, target = multilingual
    _, _, source_lang, target_lang, where, start = CASES[case]
    adapter = load(model_dir, source, target, source_lang, target_lang)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # a fresh copy: no language set by the family
    source_code, target_code = code_id(tokenizer, source_lang), code_id(tokenizer, target_lang)
    assert source_code != tokenizer.unk_token_id and target_code != tokenizer.unk_token_id

    # The sources the family encoded: each carries the source code where the format puts it, once.
    for batch in adapter.batches:
        for ids, mask in zip(batch.inputs["input_ids"], batch.inputs["attention_mask"], strict=True):
            real = ids[mask.bool()].tolist()
            assert real[0 if where == "first" else -1] == source_code, (case, real)
            assert real.count(source_code) == 1 and target_code not in real, (case, real)
            assert real[-1 if where == "first" else -2] == tokenizer.eos_token_id, (case, real)

    # The documented route: the target code forced first (NLLB, M2M100) or as the decoder's start (mBART).
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer.src_lang = source_lang
    plain, first_tokens = [], []
    with torch.no_grad():
        for line in source.read_text().splitlines():
            ids = model.generate(**tokenizer([line], return_tensors="pt"), **GENERATION, do_sample=False,
                                 **{start: target_code})
            first_tokens.append(ids[0, 1 if start == "forced_bos_token_id" else 0].item())
            plain.extend(tokenizer.batch_decode(ids, skip_special_tokens=True))
    assert first_tokens == [target_code] * N_SENTENCES
    [baseline] = adapter.evaluate([[]])
    assert baseline.outputs == plain
    assert any(plain), "every translation is empty: the comparison shows nothing"
    facts = adapter.describe().facts
    assert facts["source_lang"] == source_lang and facts["target_lang"] == target_lang
    assert facts[start] == target_code
    other = "decoder_start_token_id" if start == "forced_bos_token_id" else "forced_bos_token_id"
    assert facts[other] != target_code  # the code starts the output once, not twice


def test_a_code_the_tokenizer_lacks_and_missing_codes_are_refused_in_one_line(multilingual):
    case, model_dir, source, target = multilingual
    _, _, source_lang, target_lang, _, _ = CASES[case]
    unknown = {"nllb": "xxx_Latn", "m2m100": "xx", "mbart": "xx_XX"}[case]
    with pytest.raises(HeadsweepError) as info:
        load(model_dir, source, target, source_lang, unknown)
    line = str(info.value)
    assert f"model.target_lang {unknown!r} is not a language code of the model's tokenizer" in line, line
    assert "\n" not in line
    # The driver's check, from the folder's files alone (before Ray starts).
    with pytest.raises(HeadsweepError) as info:
        check_language_codes(model_dir, model_dir, source_lang, None)
    assert "is a multilingual model" in str(info.value) and "set model.target_lang" in str(info.value)
