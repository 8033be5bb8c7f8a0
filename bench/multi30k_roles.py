"""Benchmark: what the encoder heads of the Multi30k model do (Voita et al. 2019), and whether it predicts
what removing them costs.

Model (``--model``): ``vs_fairseq`` (default), the en->fr Transformer of ``bench/translation_vs_fairseq.py``
(3+3 layers x 8 heads, d=256, SentencePiece 8k; its cached checkpoint as it stands, trained there), or ``small``,
the 3+3 x 4-head model of ``bench/multi30k_translation.py`` (``bench/multi30k.py``: trained and cached on first use,
shared with ``bench/multi30k_pruning.py``). On test_2016_flickr:

1. single-head BLEU deltas of every encoder self-attention head (beam 5, sacrebleu);
2. the roles of every encoder head (``head_roles`` of ``headsweep.sweep.experiments.roles.worker``): confidence,
   positional, rare-word (token frequencies from the fairseq dictionary's counts) and, when spaCy and an English
   pipeline are installed (``pip install -e .[syntax]``, see docs/experiments.md), syntactic roles from spaCy's
   parses of the English source;
3. LRP relevance of every head (``headsweep.workers.analyses.lrp``) on validation pairs, never on the test set;
4. Spearman's rank correlation of confidence and of LRP relevance with the harm of each encoder head's removal
   (minus its BLEU delta), as the paper relates confidence and relevance to importance.

Ends with ``RESULT roles positional=<n> rare_words=<n> syntactic=<n> spearman_confidence_delta=<x>
spearman_lrp_delta=<x>`` (``syntactic=na`` without spaCy).

Usage: python -m bench.multi30k_roles [--max-examples N] [--lrp-examples N] [--threads T] [--smoke]
Skips (exit 0) when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import common, multi30k


def spacy_available(model: str) -> str | None:
    """None when spaCy can parse with ``model`` here, else why not."""
    from headsweep.errors import HeadsweepError
    from headsweep.workers.attention.syntax import spacy_pipeline

    try:
        spacy_pipeline(model)
    except HeadsweepError as exc:
        return str(exc)
    return None


def model_files(name: str, threads: int) -> tuple[Path, Path, Path]:
    """(checkpoint, SentencePiece model, data-bin) of the chosen benchmark model."""
    if name == "vs_fairseq":
        workdir = multi30k.vs_fairseq_dir()
        checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
        if not checkpoint.exists():
            sys.exit(f"no trained model in {workdir}: train it with python -m bench.translation_vs_fairseq "
                     "--train-only, or use --model small")
        return checkpoint, workdir / "spm.model", workdir / "data-bin"
    return multi30k.cached_model(threads)


def encoder_rows(roles, encoder) -> list:
    """The roles result's rows of the encoder heads."""
    wanted = {(h.attention, h.layer, h.head) for h in encoder}
    return [r for r in roles.heads if (r.attention, r.layer, r.head) in wanted]


def parse_args() -> argparse.Namespace:
    """The command line; in smoke mode, the small (smoke) model and a few sentences."""
    parser = common.command_line(__doc__)
    parser.add_argument("--max-examples", type=int, default=None, help="test sentences (default: all 1,000)")
    parser.add_argument("--lrp-examples", type=int, default=500, help="validation pairs for LRP relevance")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--spacy-model", default="en_core_web_sm")
    parser.add_argument("--model", choices=("vs_fairseq", "small"), default="vs_fairseq",
                        help="(--smoke: always small, the smoke model)")
    args = parser.parse_args()
    if common.enable_smoke(args):
        # The vs_fairseq model is trained by another benchmark, for 30 minutes: smoke mode trains its own.
        args.model, args.lrp_examples = "small", common.SMOKE_EXAMPLES
        args.max_examples = common.SMOKE_EXAMPLES
    return args


def ablations(flickr, encoder: list) -> tuple[dict, float]:
    """Every encoder self-attention head's single-head BLEU delta on the test set; and the seconds they took."""
    start = time.perf_counter()
    outs = flickr.evaluate([[]] + [[h] for h in encoder])
    baseline = outs[0].score
    delta = {h: o.score - baseline for h, o in zip(encoder, outs[1:], strict=True)}
    seconds = time.perf_counter() - start
    print(f"{multi30k.TEST}: baseline BLEU {baseline:.2f}; {len(encoder)} encoder single-head ablations in "
          f"{seconds:.1f}s", flush=True)
    return delta, seconds


def roles_of(flickr, encoder: list, spacy_model: str):
    """Every head's roles on the test set (syntactic ones where spaCy parses), the best encoder head per relation
    printed; (roles, why syntactic roles were not computed or None, seconds)."""
    from headsweep.sweep.experiments.roles.settings import RolesSection
    from headsweep.sweep.experiments.roles.worker import head_roles

    why_not = spacy_available(spacy_model)
    settings = RolesSection(parser=None if why_not else "spacy", spacy_model=spacy_model)
    if why_not:
        print(f"syntactic roles: not computed (spaCy with {spacy_model}: {why_not})", flush=True)
    start = time.perf_counter()
    roles = head_roles(flickr, "fairseq_translation", settings)
    seconds = time.perf_counter() - start
    print(f"roles of {len(roles.heads)} heads on {roles.n_sentences} sentences in {seconds:.1f}s "
          f"(frequencies: {roles.frequencies})", flush=True)
    if roles.syntax is not None:
        from headsweep.workers.attention.syntax import DIRECTIONS, RELATIONS

        print(f"parses: {json.dumps(roles.syntax, default=str)[:600]}")
        for rel in RELATIONS:
            for d in DIRECTIONS:
                best = max(encoder_rows(roles, encoder), key=lambda r: r.syntax.get(f"{rel}_{d}") or -1.0)
                print(f"  {rel:<7} {d}: best head {best.attention}:{best.layer}:{best.head} accuracy "
                      f"{best.syntax.get(f'{rel}_{d}')}, baseline {best.syntax.get(f'{rel}_{d}_baseline')}, "
                      f"instances {best.syntax.get(f'{rel}_instances')}")
    return roles, why_not, seconds


def relevance_of(model_cfg, data_bin: Path, runtime, examples: int):
    """LRP relevance of every head on ``examples`` validation pairs; (relevance, seconds)."""
    from headsweep.workers.analyses.lrp import lrp_relevance
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationData

    start = time.perf_counter()
    valid = load_translation(model_cfg, TranslationData(data_bin=str(data_bin), split="valid",
                                                        max_examples=examples), runtime)
    relevance = lrp_relevance(valid)
    seconds = time.perf_counter() - start
    print(f"LRP relevance on {relevance.n_examples} validation pairs in {seconds:.1f}s", flush=True)
    return relevance, seconds


def main() -> None:
    """Deltas, roles and relevance of the encoder heads, their table and correlations; the RESULT roles line."""
    args = parse_args()
    multi30k.require("roles")
    common.quiet_logging()
    import torch
    from scipy import stats

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.fairseq_translation.adapter import load_translation
    from headsweep.workers.families.fairseq_translation.config import TranslationModel

    torch.set_num_threads(args.threads)
    checkpoint, spm_model, data_bin = model_files(args.model, args.threads)
    print(f"model {checkpoint}", flush=True)
    model_cfg = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=args.beam)
    runtime = RuntimeOptions()
    flickr = load_translation(model_cfg, multi30k.test_data(spm_model, args.max_examples), runtime)
    encoder = [h for h in flickr.describe().inventory.heads if h.attention == "enc_self"]

    delta, ablation_s = ablations(flickr, encoder)
    roles, why_not, roles_s = roles_of(flickr, encoder, args.spacy_model)
    relevance, lrp_s = relevance_of(model_cfg, data_bin, runtime, args.lrp_examples)

    mine = {(r.attention, r.layer, r.head): r for r in roles.heads}
    print(f"\n{'head':<12} {'delta':>7} {'conf':>6} {'lrp':>6}  roles")
    for h in encoder:
        r = mine[(h.attention, h.layer, h.head)]
        print(f"{h!s:<12} {delta[h]:+7.2f} {r.confidence:6.3f} {relevance.normalized[h]:6.3f}  "
              f"{', '.join(r.roles) or '-'}")
    harm = [-delta[h] for h in encoder]
    rho_conf = stats.spearmanr([mine[(h.attention, h.layer, h.head)].confidence for h in encoder], harm).statistic
    rho_lrp = stats.spearmanr([relevance.normalized[h] for h in encoder], harm).statistic
    enc_roles = [mine[(h.attention, h.layer, h.head)].roles for h in encoder]

    def count(kind: str) -> int:
        return sum(any(x.split(":")[0] == kind for x in rs) for rs in enc_roles)

    syntactic = "na" if why_not else str(count("syntactic"))
    print(f"\nencoder heads: {len(encoder)}; positional {count('positional')}, rare words {count('rare_words')}, "
          f"syntactic {syntactic}; wall time {ablation_s + roles_s + lrp_s:.0f}s")
    common.result("roles", positional=count("positional"), rare_words=count("rare_words"), syntactic=syntactic,
                  spearman_confidence_delta=f"{rho_conf:.3f}", spearman_lrp_delta=f"{rho_lrp:.3f}")


if __name__ == "__main__":
    main()
