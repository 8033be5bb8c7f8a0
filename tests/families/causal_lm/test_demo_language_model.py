"""The demo's decoder-only model: its generated text, its tokenizer, and a briefly trained model that the
``hf_causal_lm`` family loads and scores (the demo itself is too slow for the suite; `make demo` runs it)."""

from __future__ import annotations

import math
import random

from headsweep.sweep.demo.language_model import NOUNS, VERBS, build_tokenizer, generate, sentence, train_language_model
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel


def test_generated_text_has_no_unknown_tokens_and_verbs_agree():
    tokenizer = build_tokenizer()
    text = generate(300, seed=5)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    rng = random.Random(7)
    plural_verbs, singular_nouns = set(VERBS.values()), set(NOUNS)
    for _ in range(200):
        words = sentence(rng).split()
        # the main verb is the one before the adverb; its subject the noun after "name :"
        subject = next(w for w in words[2:] if w in NOUNS or w in NOUNS.values())
        verb = words[-5]
        assert verb in VERBS or verb in plural_verbs
        assert (subject in singular_nouns) == (verb in VERBS), " ".join(words)
        assert words[0] == words[-2]  # the sentence ends with the name it began with


def test_a_briefly_trained_demo_model_loads_and_scores(tmp_path):
    model_dir = train_language_model(tmp_path / "lm", layers=2, heads=4, kv_heads=2, hidden=16, window=16,
                                     n_sentences=200, epochs=1, log=lambda _m: None)
    text = tmp_path / "test.txt"
    text.write_text(generate(40, seed=9), encoding="utf-8")
    adapter = load_causal_lm_adapter(CausalLMModel(path=str(model_dir)), CausalLMData(path=str(text), window=16),
                                     RuntimeOptions(batch_size=8))
    info = adapter.describe()
    assert info.facts["kv_groups"] == {"self:0": [[0, 1], [2, 3]], "self:1": [[0, 1], [2, 3]]}
    baseline = adapter.baseline()
    # other route: perplexity straight from the summed statistics
    assert math.isclose(baseline.score, math.exp(baseline.stats[:, 0].sum() / baseline.stats[:, 1].sum()),
                        rel_tol=1e-12)  # float64 on both sides, same sums
    assert 1.0 < baseline.score < len(build_tokenizer())
