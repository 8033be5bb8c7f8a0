"""Benchmark: what a removed head leaves behind. The single-head grid under zero, mean, resample (and optimal)
ablation, through the real driver, and mean ablation against a TransformerLens-style hook loop.

Models (each swept through ``headsweep.run`` into a temporary store, read back with ``headsweep.open_store``, one
worker of ``--threads`` torch threads; experiments ``baseline`` and ``single_head``, one run per method):

* ``classifier``: the demo classifier (``headsweep demo``: a 3-layer, 4-head BERT trained on generated sentiment
  sentences, cached in ``$HEADSWEEP_CACHE/demo-v1``), accuracy on its generated dev sentences less those whose
  token length no other sentence has (resample's same-length donors cannot pair them: 1 of the 1,000), the same
  data for every method;
* ``lm``: the demo LM (3-layer Llama, 8 query / 2 key-value heads), perplexity on its generated test text in
  windows of 64 tokens;
* ``multi30k``: the Multi30k en->fr benchmark model of ``bench/multi30k.py`` (3+3 layers, 4 heads,
  trained once for 12 minutes and cached), BLEU (beam 5) on the first ``--m30k-examples`` (default: all 1,000)
  sentences of test_2016_flickr less those whose source length (sentencepiece pieces and EOS) no other of them has
  (resample cannot pair them), the same data for every method, encoder self-attention heads only
  (``sweep.attention: [enc_self]``: 12 heads, which bounds the run, and the only heads resample can fill in a
  translation model: a donor's decoder states follow its own hypotheses). Without ../shared/data this part prints
  ``SKIP ablation_methods multi30k: ... not found``.

Methods: ``zero`` (Michel et al.'s mask), ``mean`` (each head's mean output over the reference data, here the
evaluation data, headsweep's default), ``resample`` (another example's output, seeded same-length derangement),
and ``optimal`` on the classifier and the LM (constants trained on the demo's validation data, which the evaluation
set may not be); a method the installed headsweep refuses prints ``SKIP <method>: <its one-line refusal>`` and
its figures read ``n/a``. Per model and method: the heads significant (the ``heads`` view: the run's default tests,
Benjamini-Hochberg at alpha 0.01), the worst head (largest ``harm``, the delta in the metric's harmful direction)
and the single-head grid's seconds relative to zero's (the span of the ``single_head`` evaluations in the worker:
worker start and the means' pass are outside it). Between methods: Spearman's rank correlation of the heads'
deltas (scipy).

The hook loop (on the LM): a fresh ``transformers`` model, no headsweep code on its path besides the token windows
the LM adapter cuts (``adapter.inputs`` / ``adapter.scored``, the data both routes score): one pass with forward
pre-hooks on every ``o_proj`` summing its input (TransformerLens's ``hook_z``, heads side by side) over every token
of every window whose attention mask is 1 (windows are all full here, so no padding exists to leave out) in
float64, giving each head's mean; then one forward per head with a pre-hook replacing that head's slice by its
mean, perplexity as headsweep scores windows (exp of the summed NLL of the scored tokens over their count). Its
deltas must equal headsweep's mean-ablation deltas within ``TOLERANCE`` x the baseline perplexity (float32 sums in
another order); ``mean_vs_hook_loop`` = the hook loop's seconds for the per-head forwards / headsweep's mean grid
seconds (above 1: headsweep faster; both on ``--threads`` threads, neither counting its means pass).

Each model's section ends with ``RESULT ablation_methods model=<name> significant_zero=<n> significant_mean=<n>
significant_resample=<n> spearman_zero_mean=<x> mean_vs_hook_loop=<ratio>`` (``n/a`` where not measured) followed
by the worst-head harms, the time ratios and, on the LM, the hook loop's largest delta difference.

Usage: python -m bench.ablation_methods [--threads T] [--m30k-examples N] [--skip-multi30k] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

from bench import common, multi30k
from bench.common import log
from bench.sweeps import run_sweep

METHODS = ("zero", "mean", "resample", "optimal")
# Smoke mode: each run starts its Ray worker (about 5 s), so each method runs on one model: the classifier resample
# (its same-length donors), the LM mean (and the hook loop) and optimal (the comparisons between methods), Multi30k
# zero (encoder self-attention).
SMOKE_METHODS = {"classifier": ("resample",), "lm": ("mean", "optimal"), "multi30k": ("zero",)}
TOLERANCE = 1e-4  # hook loop vs headsweep: |delta difference| / baseline perplexity
N_M30K = 1000
NA = "n/a"


# -- the models and their configs -----------------------------------------------------------------------------------

def demo_configs(folder: Path) -> dict[str, tuple[dict, dict]]:
    """Per demo model: (config without sweep.ablation, optimal's reference data section). The demo's own models and
    data at full size; in smoke mode tiny ones trained in seconds in the smoke cache. The classifier's evaluation
    data is written to ``folder`` (``paired_lengths``)."""
    if not common.SMOKE:
        from headsweep.sweep.demo import classifier_config, language_model_config

        out = {}
        for name, make in (("classifier", classifier_config), ("lm", language_model_config)):
            cfg = make(1, False)
            reference = cfg.pop("importance")["data"]
            out[name] = (cfg, reference)
        paired_lengths(out["classifier"][0], folder)
        return out
    from headsweep.sweep.demo.language_model import generate as generate_text
    from headsweep.sweep.demo.language_model import train_language_model
    from headsweep.sweep.demo.sentiment import generate, train_classifier, write_tsv

    root = common.smoke_cache() / "ablation_methods"
    clf, lm = root / "classifier", root / "lm"
    if not (clf / "config.json").is_file():
        train_classifier(clf, layers=2, heads=2, hidden=16, n_train=200, epochs=1, log=lambda _m: None)
    if not (lm / "config.json").is_file():
        train_language_model(lm, layers=2, heads=4, kv_heads=2, hidden=32, window=32, n_sentences=300, epochs=1,
                             log=lambda _m: None)
    files = {"dev.tsv": lambda p: write_tsv(generate(60, seed=2024), p),
             "valid.tsv": lambda p: write_tsv(generate(40, seed=2025), p),
             "test.txt": lambda p: p.write_text(generate_text(60, seed=2024), encoding="utf-8"),
             "valid.txt": lambda p: p.write_text(generate_text(60, seed=2025), encoding="utf-8")}
    for name, write in files.items():
        if not (root / name).is_file():
            write(root / name)
    out = {
        "classifier": ({"name": "smoke-classifier", "model": {"kind": "hf_classifier", "path": str(clf)},
                        "data": {"path": str(root / "dev.tsv")}, "sweep": {"batch_size": 64}},
                       {"path": str(root / "valid.tsv")}),
        "lm": ({"name": "smoke-lm", "model": {"kind": "hf_causal_lm", "path": str(lm)},
                "data": {"path": str(root / "test.txt"), "window": 32}, "sweep": {"batch_size": 16}},
               {"path": str(root / "valid.txt"), "window": 32}),
    }
    paired_lengths(out["classifier"][0], folder)
    return out


def paired_lengths(cfg: dict, folder: Path) -> None:
    """Point the classifier's ``data`` at a copy without the sentences whose token length no other sentence has
    (resample draws donors of the same length and refuses such data): the same data for every method."""
    import csv

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["path"])
    with open(cfg["data"]["path"], encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    lengths = [len(tokenizer(r["sentence"])["input_ids"]) for r in rows]
    kept = [r for r, n in zip(rows, lengths, strict=True) if lengths.count(n) > 1]
    path = folder / "classifier-eval.tsv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t", quoting=csv.QUOTE_NONE,
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
    log(f"classifier data: {len(kept)} of the {len(rows)} sentences of {cfg['data']['path']} (left out: "
        f"{len(rows) - len(kept)} whose token length no other sentence has, which resample cannot pair)")
    cfg["data"] = {**cfg["data"], "path": str(path)}


def multi30k_config(threads: int, examples: int, folder: Path) -> dict:
    """The Multi30k benchmark model (trained once, cached; shared with the other Multi30k benchmarks), encoder
    self-attention only, on the first ``examples`` test sentences less those resample cannot pair (written to
    ``folder``: :func:`paired_sources`)."""
    checkpoint, spm_model, data_bin = multi30k.cached_model(threads)
    test = multi30k.TEST
    source, target = paired_sources(*multi30k.pair(test), spm_model, examples, folder)
    return {"name": "multi30k-enc-self",
            "model": {"kind": "fairseq_translation", "checkpoint": str(checkpoint), "data_bin": str(data_bin),
                      "beam": 5},
            "data": {"source": str(source), "target": str(target), "sentencepiece_model": str(spm_model),
                     "name": test},
            "sweep": {"attention": ["enc_self"]}}


def paired_sources(source: Path, target: Path, spm_model: Path, examples: int, folder: Path) -> tuple[Path, Path]:
    """The first ``examples`` sentence pairs less those whose source length no other of them has, as plain text in
    ``folder``: resample draws each sentence's donor among sources of its length in tokens (sentencepiece pieces and
    EOS, as the model reads them) and refuses data with a sentence alone at its length."""
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    src, tgt = common.read_gz(source)[:examples], common.read_gz(target)[:examples]
    lengths = [len(pieces.encode(line.strip(), out_type=str)) + 1 for line in src]
    kept = [i for i, n in enumerate(lengths) if lengths.count(n) > 1]
    paths = folder / "multi30k-eval.src", folder / "multi30k-eval.tgt"
    for path, lines in zip(paths, (src, tgt), strict=True):
        path.write_text("".join(lines[i] + "\n" for i in kept), encoding="utf-8")
    log(f"multi30k data: {len(kept)} of the first {len(src)} sentences of {source.name} (left out: "
        f"{len(src) - len(kept)} whose source length no other sentence has, which resample cannot pair)")
    return paths


# -- one run per method ------------------------------------------------------------------------------------------

class Sweep:
    """One model's single-head grid under one method, read back from the store."""

    def __init__(self, method: str, run, heads: dict[str, tuple[float, float, bool]]):
        self.method, self.run, self.heads = method, run, heads
        span = run.span("single_head")
        self.grid_s = span[1] - span[0] if span else float("nan")

    @property
    def significant(self) -> int:
        return sum(sig for _, _, sig in self.heads.values())

    def worst(self) -> tuple[str, float]:
        name = max(self.heads, key=lambda h: self.heads[h][1])
        return name, self.heads[name][1]


def sweep(base: dict, method: str, reference: dict | None, threads: int, store: str, folder: Path) -> Sweep | None:
    """Run ``base`` under ``method``; None (after a SKIP line) when headsweep refuses it."""
    import headsweep
    from headsweep.errors import HeadsweepError

    cfg = json.loads(json.dumps(base))
    cfg["name"] = f"{base['name']}-{method}"
    cfg["seed"] = 0
    cfg["sweep"] = {**cfg.get("sweep", {}), "experiments": ["baseline", "single_head"], "workers": 1,
                    "threads_per_worker": threads, "ablation": method}
    if method == "optimal" and reference is not None:
        cfg["ablation"] = {"reference": reference}
    path = folder / f"{cfg['name']}.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    try:
        run = run_sweep(path, store)
    except HeadsweepError as exc:
        log(f"SKIP {method}: {str(exc).splitlines()[0]}")
        return None
    with headsweep.open_store(store) as s:
        rows = s.sql("SELECT name, delta, harm, significant FROM heads WHERE run_id = ? AND delta IS NOT NULL",
                     [run.run_id]).fetchall()
        metric, score = s.sql("SELECT metric, baseline_score FROM runs WHERE run_id = ?", [run.run_id]).fetchall()[0]
    log(f"{method}: run {run.run_id}, baseline {metric} {score:.4f}")
    return Sweep(method, run, {name: (float(d), float(h), bool(sig)) for name, d, h, sig in rows})


def head_order(name: str) -> tuple[str, int, int]:
    """``attention:layer:head`` in layer and head order."""
    attention, layer, head = name.rsplit(":", 2)
    return attention, int(layer), int(head)


def spearman(a: Sweep | None, b: Sweep | None) -> str:
    """Spearman's rho of the two runs' single-head deltas over their common heads."""
    if a is None or b is None:
        return NA
    from scipy.stats import spearmanr

    names = sorted(set(a.heads) & set(b.heads))
    rho = spearmanr([a.heads[n][0] for n in names], [b.heads[n][0] for n in names]).statistic
    return NA if math.isnan(rho) else f"{rho:.3f}"


# -- the TransformerLens-style hook loop -----------------------------------------------------------------------------

def hook_loop(cfg: dict, threads: int) -> tuple[dict[str, float], float, float]:
    """Mean ablation of every head of the demo LM, one forward per head (see the module docstring): per-head deltas
    of perplexity by head name, the baseline perplexity, and the seconds of the per-head forwards."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
    from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel

    torch.set_num_threads(threads)
    model_cfg = CausalLMModel(path=cfg["model"]["path"], attn_implementation="sdpa")
    data_keys = {k: v for k, v in cfg["data"].items() if k in ("path", "window", "max_windows")}
    batch = cfg["sweep"].get("batch_size", 32)
    adapter = load_causal_lm_adapter(model_cfg, CausalLMData(**data_keys), RuntimeOptions(batch_size=batch))
    inputs, scored = adapter.inputs.cpu(), adapter.scored.cpu()
    mask = torch.ones_like(inputs)  # the attention mask: windows are full, every position is a real token
    del adapter
    model = AutoModelForCausalLM.from_pretrained(cfg["model"]["path"], attn_implementation="sdpa",
                                                 torch_dtype=torch.float32).eval()
    layers = model.model.layers
    heads, d_head = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    d_head = getattr(model.config, "head_dim", None) or d_head
    batches = [slice(i, i + batch) for i in range(0, len(inputs), batch)]

    sums = [torch.zeros(heads * d_head, dtype=torch.float64) for _ in layers]
    count = float(mask.sum())
    current: dict[str, torch.Tensor] = {}

    def record(i):
        def pre(_module, args):
            z = args[0].double() * current["mask"].unsqueeze(-1).double()
            sums[i].add_(z.sum(dim=(0, 1)))
        return pre

    with torch.inference_mode():
        handles = [layer.self_attn.o_proj.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
        for b in batches:
            current["mask"] = mask[b]
            model(input_ids=inputs[b], attention_mask=mask[b], use_cache=False)
        for h in handles:
            h.remove()
    means = [(s / count).float().view(heads, d_head) for s in sums]

    def perplexity() -> float:
        nll_sum, tokens = 0.0, 0.0
        for b in batches:
            logits = model(input_ids=inputs[b], attention_mask=mask[b], use_cache=False).logits
            ids = inputs[b]
            nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.shape[0], -1)
            nll_sum += float((nll.double() * scored[b]).sum())
            tokens += float(scored[b].sum())
        return math.exp(nll_sum / tokens)

    with torch.inference_mode():
        base = perplexity()
        deltas = {}
        start = time.perf_counter()
        for layer_index, layer in enumerate(layers):
            for head in range(heads):
                def replace(_module, args, h=head, value=means[layer_index][head]):
                    z = args[0].clone()
                    z[..., h * d_head:(h + 1) * d_head] = value
                    return (z,) + tuple(args[1:])
                handle = layer.self_attn.o_proj.register_forward_pre_hook(replace)
                try:
                    deltas[f"self:{layer_index}:{head}"] = perplexity() - base
                finally:
                    handle.remove()
        seconds = time.perf_counter() - start
    return deltas, base, seconds


# -- one model's section ---------------------------------------------------------------------------------------------

def section(model: str, base: dict, reference: dict | None, methods: tuple[str, ...], args: argparse.Namespace,
            store: str, folder: Path) -> None:
    """One model's runs, one per method, their comparison (and on the LM the hook loop), and its RESULT line."""
    log(f"\n== {model}: single-head grid under {', '.join(methods)} ==")
    runs: dict[str, Sweep | None] = {}
    for method in methods:
        runs[method] = sweep(base, method, reference, args.threads, store, folder)
    zero = runs.get("zero")
    log(f"{'method':<9} {'heads':>5} {'significant':>11} {'worst head':>12} {'harm':>10} {'grid s':>8} "
        f"{'x zero':>7}  spearman vs zero")
    for method, r in runs.items():
        if r is None:
            log(f"{method:<9} not run")
            continue
        worst, harm = r.worst()
        rel = r.grid_s / zero.grid_s if zero else float("nan")
        log(f"{method:<9} {len(r.heads):>5} {r.significant:>11} {worst:>12} {harm:>10.4g} {r.grid_s:>8.2f} "
            f"{rel:>7.2f}  {spearman(zero, r)}")
    done = {m: r for m, r in runs.items() if r is not None}
    if done:
        log("per head: delta under each method (* significant)")
        log(f"{'head':<14}" + "".join(f"{m:>12}" for m in done))
        for name in sorted(next(iter(done.values())).heads, key=head_order):
            log(f"{name:<14}" + "".join(f"{r.heads[name][0]:>11.4g}{'*' if r.heads[name][2] else ' '}"
                                         for r in done.values()))
    for a, b in (("mean", "resample"), ("mean", "optimal"), ("resample", "optimal")):
        if runs.get(a) and runs.get(b):
            log(f"spearman {a} vs {b}: {spearman(runs[a], runs[b])}")

    mean = runs.get("mean")
    extra: dict[str, str] = {}
    ratio = NA
    if model == "lm" and mean is not None:
        deltas, base_ppl, loop_s = hook_loop(base, args.threads)
        diff = max(abs(deltas[n] - mean.heads[n][0]) for n in deltas)
        missing = sorted(set(deltas) ^ set(mean.heads))
        equal = not missing and diff <= TOLERANCE * base_ppl
        ratio = f"{loop_s / mean.grid_s:.2f}"
        log(f"hook loop (transformers, one forward per head, mean on hook_z): {len(deltas)} heads in {loop_s:.2f} s, "
            f"headsweep mean grid {mean.grid_s:.2f} s; baseline perplexity {base_ppl:.4f}; largest delta difference "
            f"{diff:.3g} (tolerance {TOLERANCE:g} x baseline = {TOLERANCE * base_ppl:.3g}); "
            f"{'equal' if equal else 'NOT EQUAL'}{'; heads on one side only: ' + str(missing) if missing else ''}")
        extra = {"hook_loop_max_delta_diff": f"{diff:.3g}", "hook_loop_equal": str(equal).lower()}

    def fmt(method: str, what) -> str:
        r = runs.get(method)
        return NA if r is None else what(r)

    common.result("ablation_methods", model=model,
                  significant_zero=fmt("zero", lambda r: str(r.significant)),
                  significant_mean=fmt("mean", lambda r: str(r.significant)),
                  significant_resample=fmt("resample", lambda r: str(r.significant)),
                  spearman_zero_mean=spearman(zero, mean), mean_vs_hook_loop=ratio,
                  significant_optimal=fmt("optimal", lambda r: str(r.significant)),
                  heads=str(len(next(iter(done.values())).heads)) if done else NA,
                  **{f"worst_harm_{m}": fmt(m, lambda r: f"{r.worst()[1] + 0.0:.4g}") for m in methods},
                  **{f"time_{m}_over_zero": fmt(m, lambda r: f"{r.grid_s / zero.grid_s:.2f}" if zero else NA)
                     for m in methods if m != "zero"},
                  **extra)


def methods(model: str, full: tuple[str, ...]) -> tuple[str, ...]:
    """The methods swept on ``model``: ``full``, or in smoke mode its smoke set."""
    return SMOKE_METHODS[model] if common.SMOKE else full


def main() -> None:
    """Each model's section, printing its RESULT line as soon as it is measured."""
    parser = common.command_line(__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker and of the hook loop")
    parser.add_argument("--m30k-examples", type=int, default=N_M30K, help="test_2016_flickr sentences decoded")
    parser.add_argument("--skip-multi30k", action="store_true")
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.m30k_examples = common.SMOKE_EXAMPLES
    os.environ.setdefault("HEADSWEEP_PLAIN_PROGRESS", "1")
    import warnings

    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory(prefix="ablation-methods-") as tmp:
        folder = Path(tmp)
        store = str(folder / "store")
        for model, (cfg, reference) in demo_configs(folder).items():
            section(model, cfg, reference, methods(model, METHODS), args, store, folder)
        if args.skip_multi30k:
            log("SKIP ablation_methods multi30k: --skip-multi30k")
        elif not multi30k.DATA.is_dir():
            log(f"SKIP ablation_methods multi30k: {multi30k.DATA} not found (the shared data folder beside the "
                "repository)")
        else:
            # Optimal ablation runs on the demo models only (it would need a Multi30k reference split besides).
            section("multi30k", multi30k_config(args.threads, args.m30k_examples, folder), None,
                    methods("multi30k", METHODS[:3]), args, store, folder)


if __name__ == "__main__":
    main()
