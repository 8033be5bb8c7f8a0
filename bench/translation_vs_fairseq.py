"""Benchmark: single-head grids of a fairseq Transformer, headsweep against fairseq's own generator loop.

What a user writes without headsweep is the anchor: for each head, a weight-surgery
copy of the model (the head's columns of its attention's output projection zeroed, fairseq
``out_proj.weight[:, h*d:(h+1)*d] = 0``), decoded by fairseq's own ``SequenceGenerator``
through ``task.inference_step`` in batches of ``max_tokens=6000`` (``task.get_batch_iterator``
as fairseq-generate calls it, but with ``required_batch_size_multiple=1``: with its default 8,
fairseq drops the last batch when its size is not a multiple of 8, e.g. 4 of the first 100
test sentences), in one process.
Timed in the same run, on the same model, sentences and masks:

* (a) ``fairseq``: that loop, copy and surgery included in its time;
* (b) ``hs_plain``: headsweep's plain path (``sweep.reuse: false``, one mask per search, and
  the plain setting of every speed option it has);
* (c) ``hs_default``: headsweep's default settings (plus any ``--max-tokens`` / ``--no-loss`` /
  ``--batch-size`` given here), masks sent in calls of the driver's size.

(b) and (c) run headsweep's own adapter in this process (``load_translation`` with
``RuntimeOptions``, as ``bench/grid_speed.py`` does): no Ray, so Ray's start-up and the
driver's bookkeeping are not counted. Masks go round in chunks of the driver's call size,
(a), (b) and (c) one after another per chunk, so a change in the machine's load hits all three.

The model: a fairseq ``transformer`` of 3+3 layers, 8 heads, width 256 (ffn 1024), a joint
SentencePiece BPE of 8,000 pieces, trained on Multi30k en-fr with the machinery of
``bench/multi30k.py`` and cached under ``~/.cache/headsweep/bench`` (or
``$HEADSWEEP_BENCH_CACHE``) in a folder keyed by its settings; ``trained.json`` there records
its training and its BLEU on test_2016_flickr (beam 5, sacrebleu on the detokenised text, fairseq's
loop). ``--train-only`` trains and stops; ``--train-only --more-minutes M`` trains the cached model
M minutes longer from its checkpoint (``fairseq-train --restore-file --reset-optimizer`` style:
weights and update count kept, Adam's moments afresh), updating the record epoch by epoch.

Generation settings are the same on every path: beam 5 and fairseq-generate's defaults (lenpen 1,
unkpen 0, min_len 1, max_len_a 0, max_len_b 200), or what ``--model KEY=VALUE`` sets for all three.
Keep ``max_len_a`` at 0 for the comparison: fairseq's ``SequenceGenerator`` takes
``max_len_a x (the longest source in the batch) + max_len_b`` as every sentence's length limit,
so with a != 0 a sentence's limit depends on which batch it lands in, and (a)'s and headsweep's
batches differ.

Agreement: corpus BLEU per mask of (c) and (a) (sacrebleu on the same detokenised text), the
masks whose BLEU is identical (the baseline counts as one), and per mask the sentences whose
hypotheses differ, each difference classified: a beam tie (both best hypotheses scored within
``TIE``), at the length limit, holding <unk>, and whether (a)'s own route, decoding that sentence
alone (other batches, same model), gives (a)'s or (c)'s hypothesis, i.e. whether the difference is
batch-dependent float noise between near-equal beams. Memory: the highest resident set size
sampled during each path's calls, and the most it rose above a call's start (all paths live in
one process).

Run: ``python -m bench.translation_vs_fairseq [--masks 24] [--max-examples N] [--threads 2] [--smoke]``.
Last line: ``RESULT translation_vs_fairseq ratio=<a_s/c_s> identical_bleu=<n>/<masks> fairseq_s=<a_s>
default_s=<c_s> plain_s=<b_s>``.
Skips (exit 0) when ../shared/data is absent.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import time
from pathlib import Path

from bench import common, multi30k
from bench.measure import PeakRSS, mib, run_grid, spread

TEST = multi30k.TEST
TARGET_BLEU = 35.0
FAIRSEQ_MAX_TOKENS = 6000
# Two hypotheses whose scores (fairseq's length-normalised log-probability) differ by less than
# this are a beam tie: summation-order noise between batchings decides between them.
TIE = 1e-4


# -- the model (multi30k.vs_fairseq_settings, cached in multi30k.vs_fairseq_dir) ------------------------
def marker(workdir: Path) -> Path:
    """The file that marks the model in ``workdir`` complete: its training record and test BLEU."""
    return workdir / "checkpoints" / "trained.json"


def ensure_model(minutes: float, threads: int, max_tokens: int, measured: bool = True
                 ) -> tuple[Path, Path, Path, dict]:
    """(checkpoint, spm model, data-bin, marker record): trains once, then reads the cache; ``measured``
    False leaves a model without its BLEU unmeasured (the training record instead)."""
    from headsweep.workers.families.fairseq_translation.train import train_translation

    workdir = multi30k.vs_fairseq_dir(minutes)
    workdir.mkdir(parents=True, exist_ok=True)
    spm_model, data_bin = multi30k.prepare(workdir, vocab=multi30k.VS_FAIRSEQ_VOCAB)
    checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
    if marker(workdir).exists():
        record = json.loads(marker(workdir).read_text())
        print(f"using cached model {checkpoint}: {describe_record(record)}", flush=True)
        return checkpoint, spm_model, data_bin, record
    trained = workdir / "checkpoints" / "training.json"
    if not trained.exists():
        result = train_translation(data_bin, workdir / "checkpoints", multi30k.SRC, multi30k.TGT,
                                   multi30k.vs_fairseq_settings(minutes, threads), log=common.log)
        # Written once training is over, so that a failure in what follows does not train again.
        trained.write_text(json.dumps({
            "epochs": result.epochs, "updates": result.updates, "train_seconds": round(result.seconds, 1),
            "valid_loss": result.valid_loss, "train_loss": result.train_loss, "threads": threads,
            "settings": repr(multi30k.vs_fairseq_settings(minutes, threads)), "stages": [],
        }, indent=1) + "\n")
    if not measured:
        return checkpoint, spm_model, data_bin, json.loads(trained.read_text())
    return checkpoint, spm_model, data_bin, measure(workdir, max_tokens)


def measure(workdir: Path, max_tokens: int) -> dict:
    """The training record with the checkpoint's test BLEU, written as the model's marker."""
    checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
    record = json.loads((workdir / "checkpoints" / "training.json").read_text())
    record.update(test_bleu(checkpoint, workdir / "spm.model", workdir / "data-bin", max_tokens))
    # Written last: the model is complete, with its BLEU.
    marker(workdir).write_text(json.dumps(record, indent=1) + "\n")
    print(f"trained: {describe_record(record)}", flush=True)
    return record


def continue_training(minutes: float, more_minutes: float, threads: int, max_tokens: int) -> dict:
    """Train the cached model ``more_minutes`` longer, from its ``checkpoint_last.pt``, then measure it again.

    ``train_translation`` always starts from a fresh model and its checkpoints keep no optimizer
    state, so this continues the way ``fairseq-train --restore-file ... --reset-optimizer`` does:
    the weights and the update count (hence the inverse-sqrt learning rate) come from the
    checkpoint, Adam's moments start afresh. fairseq's ``Trainer`` is swapped, for the call, for
    one that loads the checkpoint when it is built (``train_translation`` has no restore option).
    """
    import fairseq.trainer

    from headsweep.workers.families.fairseq_translation.train import train_translation

    workdir = multi30k.vs_fairseq_dir(minutes)
    checkpoint = workdir / "checkpoints" / "checkpoint_last.pt"
    trained = workdir / "checkpoints" / "training.json"
    if not trained.exists():
        raise SystemExit(f"no trained model to continue in {workdir} (train it first: --train-only)")
    record = json.loads(trained.read_text())
    stock = fairseq.trainer.Trainer
    start_updates = checkpoint_updates(checkpoint)
    if start_updates != record["updates"]:
        # A continuation stopped from outside after saving an epoch: its checkpoint is the model.
        print(f"checkpoint holds {start_updates} updates, the record {record['updates']}: going on from the "
              f"checkpoint", flush=True)
        record.setdefault("unrecorded_updates", 0)
        record["unrecorded_updates"] += start_updates - record["updates"]

    class Restored(stock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.load_checkpoint(str(checkpoint), reset_optimizer=True, reset_meters=True)
            # No optimizer state in the file, so fairseq leaves the update count at 0: the
            # schedule goes on from the checkpoint's (the model already holds it).
            self.set_num_updates(start_updates)

    stage = {"minutes": more_minutes, "from_updates": start_updates,
             "bleu_before": json.loads(marker(workdir).read_text()).get("bleu") if marker(workdir).exists() else None}
    began = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("epoch "):
            # checkpoint_last.pt was just saved: the record follows it, epoch by epoch.
            updates = checkpoint_updates(checkpoint)
            stage.update(updates=updates - start_updates, seconds=round(time.perf_counter() - began, 1),
                         epochs=stage.get("epochs", 0) + 1, last=msg)
            valid = re.search(r"valid loss ([0-9.]+)", msg)
            if valid:
                stage["valid_loss"] = float(valid.group(1))
            done = {**record, "epochs": record["epochs"] + stage["epochs"], "updates": updates,
                    "valid_loss": stage.get("valid_loss", record["valid_loss"]),
                    "train_seconds": round(record["train_seconds"] + stage["seconds"], 1),
                    "stages": [*record.get("stages", []), stage]}
            trained.write_text(json.dumps(done, indent=1) + "\n")

    fairseq.trainer.Trainer = Restored
    try:
        result = train_translation(workdir / "data-bin", workdir / "checkpoints", multi30k.SRC, multi30k.TGT,
                                   multi30k.vs_fairseq_settings(more_minutes, threads), log=log)
    finally:
        fairseq.trainer.Trainer = stock
    record = json.loads(trained.read_text())
    record.update(valid_loss=result.valid_loss, train_loss=result.train_loss)
    trained.write_text(json.dumps(record, indent=1) + "\n")
    marker(workdir).unlink(missing_ok=True)
    return measure(workdir, max_tokens)


def checkpoint_updates(checkpoint: Path) -> int:
    """The update count a fairseq checkpoint records."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return int(state["optimizer_history"][-1]["num_updates"])


def describe_record(record: dict) -> str:
    """A model's training record and test BLEU, in a line."""
    return (f"{record['epochs']} epochs, {record['updates']} updates, {record['train_seconds']:.0f}s training, "
            f"valid loss {record['valid_loss']:.3f}; {TEST} BLEU {record['bleu']:.2f} (beam 5, fairseq loop, "
            f"{record['sacrebleu']})")


def test_bleu(checkpoint: Path, spm_model: Path, data_bin: Path, max_tokens: int) -> dict:
    """BLEU of the unmasked model on the whole test set, decoded by fairseq's own loop."""
    sources, references = read_test(None)
    loop = FairseqLoop(checkpoint, data_bin, spm_model, sources, max_tokens)
    start = time.perf_counter()
    hyps = loop.decode([])
    bleu = corpus_bleu(hyps.texts, references)
    return {"bleu": round(bleu.score, 2), "sacrebleu": str(bleu.get_signature()) if hasattr(bleu, "get_signature")
            else "", "bleu_decode_seconds": round(time.perf_counter() - start, 1), "checkpoint": str(checkpoint)}


def read_test(max_examples: int | None) -> tuple[list[str], list[str]]:
    """The first ``max_examples`` (None: all) test sources and references."""
    source, target = multi30k.pair(TEST)
    src = common.read_gz(source)
    ref = [line.strip() for line in common.read_gz(target)]
    n = len(src) if max_examples is None else min(len(src), max_examples)
    return src[:n], ref[:n]


_BLEU = {}


def corpus_bleu(hypotheses: list[str], references: list[str]):
    """sacrebleu's corpus BLEU (default 13a tokenisation), references cached per list."""
    from sacrebleu.metrics import BLEU

    key = id(references)
    if key not in _BLEU:
        _BLEU[key] = (references, BLEU(force=True, references=[references]))
    return _BLEU[key][1].corpus_score(hypotheses, None)


# -- (a): the loop a user writes with fairseq alone ------------------------------------------
@dataclasses.dataclass
class Decoded:
    """Best hypothesis per sentence: detokenised text, tokens and fairseq's score."""

    texts: list[str]
    tokens: list
    scores: list[float]


class FairseqLoop:
    """fairseq's own route: load with ``checkpoint_utils``, weight surgery per mask, ``task.inference_step``."""

    def __init__(self, checkpoint: Path, data_bin: Path, spm_model: Path, sources: list[str], max_tokens: int,
                 generation: dict | None = None):
        import sentencepiece as spm
        from fairseq import checkpoint_utils, utils
        from fairseq.dataclass.configs import GenerationConfig

        models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(checkpoint)], arg_overrides={"data": str(data_bin)})
        self.model, self.task = models[0].eval(), task
        sp = spm.SentencePieceProcessor(model_file=str(spm_model))
        src_dict = task.source_dictionary
        tokens = [src_dict.encode_line(" ".join(sp.encode(line.strip(), out_type=str)), add_if_not_exist=False,
                                       append_eos=True).long() for line in sources]
        self.tokens = tokens
        self.dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
        self.max_tokens = max_tokens
        self.max_positions = utils.resolve_max_positions(task.max_positions(), self.model.max_positions())
        self.generation = GenerationConfig(**{"beam": 5, **(generation or {})})

    def masked_model(self, mask):
        """A copy of the model with each head of ``mask`` cut out of its output projection's input."""
        import torch

        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for head in mask:
                attn = attention_module(model, head)
                d = attn.head_dim
                attn.out_proj.weight[:, head.head * d : (head.head + 1) * d] = 0
        return model

    def decode(self, mask) -> Decoded:
        """Every sentence under ``mask`` (a list of headsweep ``Head``), fairseq-generate style."""
        model = self.masked_model(mask) if mask else self.model
        generator = self.task.build_generator([model], self.generation)
        itr = self.task.get_batch_iterator(
            dataset=self.dataset, max_tokens=self.max_tokens, max_positions=self.max_positions,
            required_batch_size_multiple=1, seed=1, num_workers=0,
        ).next_epoch_itr(shuffle=False)
        n = len(self.dataset)
        texts, tokens, scores = [""] * n, [None] * n, [0.0] * n
        tgt_dict = self.task.target_dictionary
        strip = generator.symbols_to_strip_from_output
        for sample in itr:
            hypos = self.task.inference_step(generator, [model], sample)
            for i, hypo in zip(sample["id"].tolist(), hypos, strict=True):
                best = hypo[0]
                tokens[i] = best["tokens"].cpu()
                scores[i] = float(best["score"])
                texts[i] = tgt_dict.string(best["tokens"].int().cpu(), "sentencepiece",
                                           extra_symbols_to_ignore=strip)
        missing = [i for i, t in enumerate(tokens) if t is None]
        if missing:
            raise RuntimeError(f"fairseq's batches left out {len(missing)} sentences, e.g. {missing[:5]}")
        return Decoded(texts, tokens, scores)

    def decode_alone(self, mask, ids: list[int]) -> dict[int, str]:
        """Sentences ``ids`` under ``mask``, each in a batch of its own: the same route with other
        batches, which shows whether a difference is batch-dependent float noise (a near-tie)."""
        model = self.masked_model(mask) if mask else self.model
        generator = self.task.build_generator([model], self.generation)
        strip = generator.symbols_to_strip_from_output
        out = {}
        for i in ids:
            one = self.task.build_dataset_for_inference([self.tokens[i]], [self.tokens[i].numel()])
            sample = one.collater([one[0]])
            best = self.task.inference_step(generator, [model], sample)[0][0]
            out[i] = self.task.target_dictionary.string(best["tokens"].int().cpu(), "sentencepiece",
                                                        extra_symbols_to_ignore=strip)
        return out


def attention_module(model, head):
    """The fairseq ``MultiheadAttention`` a headsweep ``Head`` names."""
    if head.attention == "enc_self":
        return model.encoder.layers[head.layer].self_attn
    if head.attention == "enc_dec":
        return model.decoder.layers[head.layer].encoder_attn
    if head.attention == "dec_self":
        return model.decoder.layers[head.layer].self_attn
    raise ValueError(f"not a fairseq translation head: {head}")


# -- (b), (c): headsweep's adapter in this process ------------------------------------------
# The plain value of every speed option headsweep's RuntimeOptions may have; options this
# headsweep lacks are left out (the bench runs before and after they land).
PLAIN = {"reuse": False, "masks_per_batch": 1, "max_tokens": 0, "fused_attention": False, "loss": True}


def runtime_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(translation_runtime())}


def translation_runtime() -> type:
    """The translation family's RuntimeOptions (its own class where this headsweep has one)."""
    from headsweep.workers.families.registry import model_family

    return getattr(model_family("fairseq_translation"), "runtime_options", None) or _plain_runtime()


def _plain_runtime() -> type:
    from headsweep.workers.core.family import RuntimeOptions

    return RuntimeOptions


def parse_value(text: str):
    """A command-line value as YAML would read it (ints, floats, true/false, null, strings)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def headsweep_options(args) -> tuple[object, object, list[str]]:
    """(plain, default) RuntimeOptions and notes on what was set or could not be."""
    RuntimeOptions = translation_runtime()  # noqa: N806 (a class)
    fields = runtime_fields()
    notes = []
    plain = {k: v for k, v in PLAIN.items() if k in fields}
    notes.append("(b) plain: " + ", ".join(f"{k}={v}" for k, v in plain.items()))
    chosen = {}
    for item in args.sweep:
        key, _, value = item.partition("=")
        chosen[key.strip()] = parse_value(value.strip())
    if args.max_tokens is not None:
        chosen["max_tokens"] = args.max_tokens
    if args.batch_size is not None:
        chosen["batch_size"] = args.batch_size
    if args.masks_per_batch is not None:
        chosen["masks_per_batch"] = args.masks_per_batch
    if args.no_loss:
        chosen["loss"] = False
    unknown = sorted(set(chosen) - fields)
    if unknown:
        notes.append(f"not options of this headsweep, ignored: {', '.join(unknown)}")
    chosen = {k: v for k, v in chosen.items() if k in fields}
    notes.append("(c) default" + ("" if not chosen else " + " + ", ".join(f"{k}={v}" for k, v in chosen.items())))
    common = {"threads": args.threads}
    return RuntimeOptions(**common, **plain), RuntimeOptions(**common, **chosen), notes


def translation_configs(checkpoint: Path, data_bin: Path, spm_model: Path, max_examples: int | None, args):
    """headsweep's model and data sections: beam 5 and fairseq-generate's other defaults, like (a)."""
    from headsweep.workers.families.fairseq_translation.config import TranslationModel

    model_fields = {f.name for f in dataclasses.fields(TranslationModel)}
    extra = {}
    for item in args.model:
        key, _, value = item.partition("=")
        if key.strip() not in model_fields:
            raise SystemExit(f"--model {key!r}: not a key of headsweep's fairseq_translation model section")
        extra[key.strip()] = parse_value(value.strip())
    model = TranslationModel(checkpoint=str(checkpoint), data_bin=str(data_bin), beam=5, **extra)
    return model, multi30k.test_data(spm_model, max_examples, TEST)


def capture_hypotheses(task) -> list:
    """Keep what ``task.translate`` returns inside ``evaluate`` (hypotheses with their beam scores,
    which ``MaskOutput`` does not carry), one list per call; costs nothing measurable."""
    captured: list = []
    translate = task.translate

    def keeping(masks):
        out = translate(masks)
        captured.append(out)
        return out

    task.translate = keeping
    return captured


def choose_masks(inventory, count: int) -> list[list]:
    """``count`` single-head masks, a third per attention type, each third spread over its heads."""
    by_type: dict[str, list] = {}
    for head in inventory.heads:
        by_type.setdefault(head.attention, []).append(head)
    types = [t for t in ("enc_self", "enc_dec", "dec_self") if t in by_type]
    masks = []
    for i, kind in enumerate(types):
        share = count // len(types) + (1 if i < count % len(types) else 0)
        heads = by_type[kind]
        masks += [[heads[j]] for j in spread(len(heads), share)] if share else []
    return masks


# -- comparison -------------------------------------------------------------------------------
@dataclasses.dataclass
class Difference:
    """Sentences whose best hypotheses differ between two routes, and how."""

    n: int = 0
    ties: int = 0  # both hypotheses scored within TIE by their own searches
    max_len: int = 0  # one of them stopped at the length limit
    unk: int = 0  # one of them holds <unk>
    ids: list = dataclasses.field(default_factory=list)
    alone_a: int = 0  # decoded alone by (a)'s route: (a)'s hypothesis again
    alone_c: int = 0  # decoded alone by (a)'s route: (c)'s hypothesis
    examples: list = dataclasses.field(default_factory=list)


def compare(a: Decoded, c_outputs: list[str], c_hyps, max_lens: list[int]) -> Difference:
    """Where (a)'s hypotheses and (c)'s differ (text), and whether each difference is a beam tie."""
    diff = Difference()
    for i, (text_a, text_c) in enumerate(zip(a.texts, c_outputs, strict=True)):
        if text_a == text_c:
            continue
        diff.n += 1
        diff.ids.append(i)
        score_c = c_hyps[i].score if c_hyps is not None else float("nan")
        gap = abs(a.scores[i] - score_c)
        diff.ties += gap < TIE
        len_a, len_c = len(a.tokens[i]), (len(c_hyps[i].tokens) if c_hyps is not None else -1)
        diff.max_len += max(len_a, len_c) >= max_lens[i]
        diff.unk += "<unk>" in text_a or "<unk>" in text_c
        if len(diff.examples) < 3:
            diff.examples.append((i, a.scores[i], score_c, len_a, len_c, text_a, text_c))
    return diff


# -- (d): headsweep's default in several worker processes ---------------------------------------------------------
_WORKER: dict = {}


def _start_worker(model_cfg, data_cfg, options, threads: int) -> None:
    """A (d) process: headsweep's adapter with ``threads`` torch threads, as a Ray worker holds it."""
    common.quiet_logging()
    import torch

    from headsweep.workers.families.fairseq_translation.adapter import load_translation

    torch.set_num_threads(threads)
    _WORKER["task"] = load_translation(model_cfg, data_cfg, options)


def _worker_call(masks: list) -> list:
    """One call of a (d) process."""
    return _WORKER["task"].evaluate(masks)


class WorkerProcesses:
    """(d): headsweep's default settings in ``workers`` processes of ``threads // workers`` threads each, as
    ``sweep.workers`` Ray actors run them (without Ray's start-up and the driver); each round of masks is split
    evenly between the processes, one call each."""

    def __init__(self, workers: int, threads: int, model_cfg, data_cfg, options):
        import multiprocessing

        per = max(1, threads // workers)
        self.workers = workers
        self.options = dataclasses.replace(options, threads=per)
        self.pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_start_worker, initargs=(model_cfg, data_cfg, self.options, per))
        # every process loaded before timing starts (the pool starts them lazily: one tiny call each)
        self.pool.map(_worker_call, [[] for _ in range(workers)], chunksize=1)

    def evaluate(self, masks: list) -> list:
        """The outputs of ``masks``, in order."""
        share = -(-len(masks) // self.workers)
        parts = [masks[i : i + share] for i in range(0, len(masks), share)]
        return [o for outs in self.pool.map(_worker_call, parts, chunksize=1) for o in outs]

    def close(self) -> None:
        self.pool.terminate()


# -- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    """The command line; in smoke mode, 3 masks on a few sentences, hypotheses capped at 20 tokens."""
    parser = common.command_line(__doc__)
    parser.add_argument("--masks", type=int, default=24,
                        help="single-head masks, spread evenly over enc_self, enc_dec and dec_self (besides the "
                             "baseline)")
    parser.add_argument("--max-examples", type=int, default=None, help="the first N test sentences (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, every path alike")
    parser.add_argument("--train-minutes", type=float, default=multi30k.VS_FAIRSEQ_MINUTES,
                        help="training budget (part of the cache key)")
    parser.add_argument("--train-only", action="store_true", help="train (or read) the model, report its BLEU, stop")
    parser.add_argument("--more-minutes", type=float, default=0.0,
                        help="with --train-only: train the cached model this much longer (from its checkpoint)")
    parser.add_argument("--fairseq-max-tokens", type=int, default=FAIRSEQ_MAX_TOKENS,
                        help="(a)'s batches, in tokens (fairseq-generate's --max-tokens)")
    parser.add_argument("--skip-a", action="store_true", help="leave out (a), fairseq's loop")
    parser.add_argument("--skip-b", action="store_true", help="leave out (b), headsweep's plain path")
    parser.add_argument("--max-tokens", type=int, default=None, help="(c): sweep.max_tokens (token-budget batches)")
    parser.add_argument("--batch-size", type=int, default=None, help="(c): sweep.batch_size")
    parser.add_argument("--masks-per-batch", type=int, default=None, help="(c): sweep.masks_per_batch")
    parser.add_argument("--no-loss", action="store_true", help="(c): no teacher-forced loss pass")
    parser.add_argument("--workers", type=int, default=0,
                        help="(d): headsweep's default settings (as (c)) in this many worker processes of "
                             "threads / workers torch threads each (sweep.workers); below 2: no (d)")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=VALUE",
                        help="(c): any other RuntimeOptions field (repeatable)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="headsweep's model section for (b) and (c), e.g. lenpen=1.0 (repeatable); (a) gets "
                             "the same generation keys")
    args = parser.parse_args()
    if common.enable_smoke(args):
        args.masks, args.threads, args.max_examples = 3, 1, common.SMOKE_EXAMPLES
        args.model.append("max_len_b=20")  # the smoke model babbles: cap its hypotheses, on every path alike
    return args


def trained_model(args: argparse.Namespace) -> tuple[Path, Path, Path, dict]:
    """(checkpoint, spm model, data-bin, record) of the model: read from the cache, trained, or with
    ``--train-only --more-minutes`` trained longer."""
    more = args.train_only and args.more_minutes > 0
    checkpoint, spm_model, data_bin, record = ensure_model(args.train_minutes, args.threads, args.fairseq_max_tokens,
                                                           measured=not more)
    if more:
        record = continue_training(args.train_minutes, args.more_minutes, args.threads, args.fairseq_max_tokens)
    return checkpoint, spm_model, data_bin, record


@dataclasses.dataclass
class Routes:
    """What is timed side by side: (a) fairseq's loop (None with ``--skip-a``), headsweep's adapters (``hs_plain``
    (b), absent with ``--skip-b``; ``hs_default`` (c)) with their options, and (d)'s processes (None below 2)."""

    loop: FairseqLoop | None
    tasks: dict
    options: dict
    procs: WorkerProcesses | None
    model_cfg: object
    generation: dict
    notes: list[str]  # how (b) and (c) are set
    rss: dict  # resident memory after each route loaded


def load_routes(args: argparse.Namespace, checkpoint: Path, spm_model: Path, data_bin: Path,
                sources: list[str]) -> Routes:
    """Every route loaded, the resident memory noted after each."""
    from headsweep.workers.families.fairseq_translation.adapter import load_translation

    plain_opts, default_opts, notes = headsweep_options(args)
    model_cfg, data_cfg = translation_configs(checkpoint, data_bin, spm_model, args.max_examples, args)
    generation = {k: getattr(model_cfg, k) for k in ("beam", "lenpen", "max_len_a", "max_len_b", "min_len",
                                                     "unkpen", "no_repeat_ngram_size")}
    rss = {"start": PeakRSS.rss()}
    loop = None if args.skip_a else FairseqLoop(checkpoint, data_bin, spm_model, sources, args.fairseq_max_tokens,
                                                generation)
    rss["after (a) load"] = PeakRSS.rss()
    tasks = {}
    if not args.skip_b:
        tasks["hs_plain"] = load_translation(model_cfg, data_cfg, plain_opts)
    rss["after (b) load"] = PeakRSS.rss()
    tasks["hs_default"] = load_translation(model_cfg, data_cfg, default_opts)
    rss["after (c) load"] = PeakRSS.rss()
    procs = None
    if args.workers > 1:
        procs = WorkerProcesses(args.workers, args.threads, model_cfg, data_cfg, default_opts)
        print(f"(d): headsweep default in {args.workers} worker processes of {procs.options.threads} torch "
              "thread(s) each, each round of masks split evenly between them", flush=True)
    return Routes(loop, tasks, {"hs_plain": plain_opts, "hs_default": default_opts}, procs, model_cfg, generation,
                  notes, rss)


def describe(routes: Routes, info, masks: list, record: dict, args: argparse.Namespace) -> None:
    """The model, the data and how each route runs."""
    from headsweep.sweep.cluster.dispatch import units_per_call

    default_opts = routes.options["hs_default"]
    n_total = len(common.read_gz(multi30k.pair(TEST)[0]))
    print(f"model: {describe_record(record)}")
    print(f"data: {TEST}, {info.n_examples} of {n_total} sentences; beam 5, generation {routes.generation}; "
          f"torch threads {args.threads}; {len(masks) - 1} single-head masks + the baseline")
    print(f"(a) fairseq: checkpoint_utils.load_model_ensemble_and_task, a deepcopy with out_proj columns zeroed per "
          f"mask, task.build_generator + task.inference_step, get_batch_iterator(max_tokens="
          f"{args.fairseq_max_tokens}, required_batch_size_multiple=1)")
    print("(b), (c): headsweep's TranslationAdapter in this process (no Ray: its start-up is not counted); "
          + "; ".join(routes.notes))
    print(f"(c): reuse: {info.facts.get('reuse')}; masks per call {units_per_call(default_opts.masks_per_batch)}, "
          f"masks per search {routes.tasks['hs_default'].masks_per_forward()}", flush=True)


@dataclasses.dataclass
class Timings:
    """Per route: its seconds in all, per mask, and its outputs (``Decoded`` for (a), ``MaskOutput`` otherwise);
    and (c)'s hypotheses with their scores, one list per call."""

    seconds: dict
    per_mask: dict
    outs: dict
    captured: list


def time_rounds(routes: Routes, masks: list, args: argparse.Namespace, peak: PeakRSS) -> Timings:
    """Every route on ``masks``, round by round (a round: the driver's call size, one call per (d) worker), so that
    a change in the machine's load hits all of them."""
    from headsweep.sweep.cluster.dispatch import units_per_call

    call = units_per_call(routes.options["hs_default"].masks_per_batch)
    captured = capture_hypotheses(routes.tasks["hs_default"])
    seconds = {"fairseq": 0.0, **dict.fromkeys(routes.tasks, 0.0), **({"hs_workers": 0.0} if routes.procs else {})}
    per_mask = {k: [] for k in seconds}
    outs: dict[str, list] = {k: [] for k in seconds}
    round_size = call * max(1, args.workers)  # (d) gets one call per worker a round
    for first in range(0, len(masks), round_size):
        chunk = masks[first : first + round_size]
        if routes.loop is not None:
            for mask in chunk:
                got, s = peak.timed("fairseq", routes.loop.decode, mask)
                outs["fairseq"].append(got)
                per_mask["fairseq"].append(s)
                seconds["fairseq"] += s
        for k, task in routes.tasks.items():
            got, s = run_grid(task, chunk, routes.options[k], peak, k)
            outs[k] += got
            per_mask[k] += [o.seconds for o in got]
            seconds[k] += s
        if routes.procs is not None:
            start = time.perf_counter()
            got = routes.procs.evaluate(chunk)
            s = time.perf_counter() - start
            outs["hs_workers"] += got
            seconds["hs_workers"] += s
        print(f"  masks {first}..{first + len(chunk) - 1}: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
              + " (cumulative)", flush=True)
    return Timings(seconds, per_mask, outs, captured)


@dataclasses.dataclass
class Agreement:
    """Per mask a table row (BLEU and seconds per route, (a)'s differences from (c)); the masks whose BLEU (a) and
    (c), and (a) and (d), give alike; the sentences (d) and (c) decode differently; (a)'s differences in all."""

    rows: list = dataclasses.field(default_factory=list)
    identical: int = 0
    identical_d: int = 0
    d_vs_c: int = 0
    total: Difference = dataclasses.field(default_factory=Difference)


def agreement(routes: Routes, masks: list, timings: Timings, references: list[str]) -> Agreement:
    """How the routes' hypotheses and BLEU agree, mask by mask; (a)'s differing sentences decoded again alone."""
    outs, per_mask, task = timings.outs, timings.per_mask, routes.tasks["hs_default"]
    hyps_c = [h for call_hyps in timings.captured for h in call_hyps]
    if len(hyps_c) != len(masks):
        # This headsweep's evaluate() does not go through translate(): one more, untimed, decode.
        print("(c)'s hypothesis scores come from one more, untimed, translate() call", flush=True)
        hyps_c = task.translate(masks)
    lengths = [len(t) for t in task.examples.source]
    max_lens = [int(min(routes.model_cfg.max_len_a * n + routes.model_cfg.max_len_b,
                        task.model.max_decoder_positions() - 1)) for n in lengths]
    found = Agreement()
    for j, mask in enumerate(masks):
        c = outs["hs_default"][j]
        c_text_again = [h.text for h in hyps_c[j]]
        if c_text_again != c.outputs:
            print(f"  note: (c)'s untimed translate() of {mask} differs from its timed evaluate() "
                  f"in {sum(x != y for x, y in zip(c_text_again, c.outputs, strict=True))} sentences")
        bleu_c = corpus_bleu(c.outputs, references).score
        row = {"mask": str(mask[0]) if mask else "baseline", "c": bleu_c, "c_s": per_mask["hs_default"][j]}
        if "hs_plain" in outs:
            b = outs["hs_plain"][j]
            row.update(b=corpus_bleu(b.outputs, references).score, b_s=per_mask["hs_plain"][j],
                       b_vs_c=sum(x != y for x, y in zip(b.outputs, c.outputs, strict=True)))
        if routes.procs is not None:
            d = outs["hs_workers"][j]
            row.update(d=corpus_bleu(d.outputs, references).score)
            found.d_vs_c += sum(x != y for x, y in zip(d.outputs, c.outputs, strict=True))
        if routes.loop is not None:
            a = outs["fairseq"][j]
            bleu_a = corpus_bleu(a.texts, references).score
            found.identical_d += routes.procs is not None and bleu_a == row["d"]
            diff = compare(a, c.outputs, hyps_c[j], max_lens)
            if diff.ids:
                alone = routes.loop.decode_alone(mask, diff.ids)
                diff.alone_a = sum(alone[i] == a.texts[i] for i in diff.ids)
                diff.alone_c = sum(alone[i] == c.outputs[i] for i in diff.ids)
            found.identical += bleu_a == bleu_c
            row.update(a=bleu_a, a_s=per_mask["fairseq"][j], diff=diff)
            for name in ("n", "ties", "max_len", "unk", "alone_a", "alone_c"):
                setattr(found.total, name, getattr(found.total, name) + getattr(diff, name))
            found.total.examples += [(row["mask"], *e) for e in diff.examples]
        found.rows.append(row)
    return found


def print_table(rows: list[dict]) -> None:
    """BLEU per route, (a)'s differences from (c) and seconds, a line per mask."""
    print(f"\n{'mask':<14}{'BLEU a':>8}{'BLEU b':>8}{'BLEU c':>8}  same  {'differ a/c':>10}{'ties':>6}"
          f"{'b/c':>5}{'a s':>7}{'b s':>7}{'c s':>7}")
    for r in rows:
        d = r.get("diff")
        print(f"{r['mask']:<14}{r.get('a', float('nan')):8.2f}{r.get('b', float('nan')):8.2f}{r['c']:8.2f}  "
              f"{('yes' if r.get('a') == r['c'] else 'NO') if d else '-':<4}  {d.n if d else '-':>10}"
              f"{d.ties if d else '-':>6}{r.get('b_vs_c', '-'):>5}{r.get('a_s', float('nan')):7.2f}"
              f"{r.get('b_s', float('nan')):7.2f}{r['c_s']:7.2f}")


def print_times(routes: Routes, timings: Timings, found: Agreement, peak: PeakRSS, n_examples: int,
                args: argparse.Namespace) -> None:
    """Each route's seconds and memory; (d) against (c) and (a); the resident memory after each load."""
    n = len(timings.outs["hs_default"])
    print(f"\ntimes for {n} decodes of {n_examples} sentences (baseline included):")
    labels = {"fairseq": "(a) fairseq loop", "hs_plain": "(b) headsweep plain", "hs_default": "(c) headsweep default",
              "hs_workers": f"(d) default, {args.workers} workers"}
    for k, s in timings.seconds.items():
        if k == "fairseq" and routes.loop is None:
            continue
        memory = (f"  peak RSS {mib(peak.peak[k])}, at most {mib(peak.rise[k])} above a call's start"
                  if k in peak.peak else "  (memory: other processes, not sampled)")
        print(f"  {labels[k]:<22} {s:7.1f}s  ({s / n:.2f}s a decode){memory}")
    if routes.procs is not None:
        routes.procs.close()
        print(f"(d) vs (c): {found.d_vs_c} sentence hypotheses differ over {n} masks x {n_examples} sentences "
              f"(other thread counts: summation order); BLEU of (d) equals (a)'s for {found.identical_d} of {n} "
              f"masks")
    print("  resident memory: " + ", ".join(f"{k} {mib(v)}" for k, v in routes.rss.items()))


def print_differences(total: Difference, n: int, n_examples: int) -> None:
    """What the sentences (a) and (c) decode differently are, with a few of them."""
    print(f"(a) vs (c): {total.n} sentence hypotheses differ over {n} masks x {n_examples} sentences; "
          f"{total.ties} of them beam ties (scores within {TIE:g}), {total.max_len} at the length "
          f"limit, {total.unk} with <unk>; decoded again by (a)'s route one sentence a batch: "
          f"{total.alone_a} give (a)'s hypothesis, {total.alone_c} give (c)'s")
    for mask_name, i, sa, sc, la, lc, ta, tc in total.examples[:8]:
        print(f"  {mask_name} sentence {i}: (a) score {sa:.6f} len {la}: {ta!r}\n"
              f"  {'':<{len(mask_name)}} {'':>{len(str(i)) + 9}} (c) score {sc:.6f} len {lc}: {tc!r}")


def main() -> None:
    """Train or read the model; time the routes on the same masks, compare them; the RESULT line."""
    args = parse_args()
    multi30k.require("translation_vs_fairseq")
    common.quiet_logging()
    import torch

    torch.set_num_threads(args.threads)
    checkpoint, spm_model, data_bin, record = trained_model(args)
    if args.train_only:
        common.result("translation_vs_fairseq_model", bleu=f"{record['bleu']:.2f}",
                      train_s=f"{record['train_seconds']:.0f}")
        return

    sources, references = read_test(args.max_examples)
    peak = PeakRSS()
    routes = load_routes(args, checkpoint, spm_model, data_bin, sources)
    info = routes.tasks["hs_default"].describe()
    masks = [[]] + choose_masks(info.inventory, args.masks)
    describe(routes, info, masks, record, args)
    timings = time_rounds(routes, masks, args, peak)
    found = agreement(routes, masks, timings, references)
    print_table(found.rows)
    print_times(routes, timings, found, peak, info.n_examples, args)
    peak.stop()
    seconds, n = timings.seconds, len(masks)
    if routes.loop is None:
        common.result("translation_vs_fairseq", ratio="nan", identical_bleu="0/0",
                      plain_s=f"{seconds.get('hs_plain', 0):.1f}", default_s=f"{seconds['hs_default']:.1f}")
        return
    print_differences(found.total, n, info.n_examples)
    extra = {"plain_s": f"{seconds['hs_plain']:.1f}"} if "hs_plain" in seconds else {}
    if routes.procs is not None:
        extra.update(workers=args.workers, workers_s=f"{seconds['hs_workers']:.1f}",
                     workers_ratio=f"{seconds['fairseq'] / seconds['hs_workers']:.2f}",
                     workers_identical_bleu=f"{found.identical_d}/{n}")
    common.result("translation_vs_fairseq", ratio=f"{seconds['fairseq'] / seconds['hs_default']:.2f}",
                  identical_bleu=f"{found.identical}/{n}", fairseq_s=f"{seconds['fairseq']:.1f}",
                  default_s=f"{seconds['hs_default']:.1f}", **extra)


if __name__ == "__main__":
    main()
