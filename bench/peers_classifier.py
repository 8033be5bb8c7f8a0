"""Benchmark: headsweep against TransformerLens and nnsight on a classifier, the BERT-base shape (bench/peers.py's
comparison for the causal LMs, here on a classification set).

The model: BERT-base's published configuration with seeded weights and a 2-label head, a word tokenizer, and 128
SST-2 validation sentences (generated ones without ``../shared/data``), as ``bench/real_size.py`` builds and caches
it. The grid: every head of the first and the last layer alone, plus the baseline; the sentences in the classifier
adapter's own batches (length-sorted, 32 a batch, padded to the longest), which every route reads.

Routes (bench/peers.py's, for a classifier):

* **transformerlens**: ``HookedEncoder`` where TransformerLens still has it (4.0 removed it), else
  ``TransformerBridge.boot_transformers(folder, hf_model=model, model_class=BertForSequenceClassification)`` with one
  ``run_with_hooks`` per mask zeroing ``blocks.L.attn.hook_z[:, :, h]``; where neither loads the model, one line
  says why;
* **nnsight_loop**: ``NNsight(model)``, one trace per mask zeroing head h's slice of the self-attention's context
  (the tensor the output projection ``attention.output.dense`` takes; nnsight's ``.output`` names the module's
  output, so BERT's submodule ``attention.output`` is reached through the context it consumes);
* **nnsight_batched**: ``--invokes`` masks per trace, one ``invoke`` each;
* **plain**, **default**: headsweep's classifier adapter in this process (reuse off and one mask a pass; the
  defaults), and **run**: ``python -m headsweep run`` end to end (one worker, ``--threads`` threads).

``equal``: every route's per-mask mean cross-entropy within ``tests/tolerances.py``'s float32 bound of ``plain``'s and
the same accuracy. ``bound``: plain FLOPs / reuse FLOPs (bench/flops.py). Prints
``RESULT peers_classifier shape=bert-base bound=<x> vs_transformerlens=<x> vs_nnsight_loop=<x>
vs_nnsight_batched=<x> one_minute_vs_fastest=<x> startup_s=<x> equal=<true|false>`` (``n/a`` where a route did
not run; the grid is the one-minute kind, so ``one_minute_vs_fastest`` is ``run`` against the fastest peer's load
and grid).

Usage: python -m bench.peers_classifier [--threads 1] [--invokes 4] [--skip-run] [--smoke]
``--smoke``: real_size's shrunk BERT (4 layers of 12 heads of 8), 24 sentences, two heads per layer.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench import common, peers, real_size
from bench.common import log


def classifier_workload(folder: Path, args, heads: int | None):
    """The grid over the adapter's batches: a ``peers.Workload`` whose ``inputs`` are (indices, model inputs) per
    batch and ``scored`` the labels."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    adapter = adapter_for(folder, args, reuse=False)
    grid = peers.Grid("one_minute", len(adapter.labels), "ends", heads)
    masks = peers.grid_masks(grid, config.num_hidden_layers, config.num_attention_heads)
    return peers.Workload(grid, folder, masks, list(adapter.batches), adapter.labels, 32, args.threads)


def adapter_for(folder: Path, args, reuse: bool):
    from headsweep.workers.core.family import RuntimeOptions
    from headsweep.workers.families.hf_classifier.adapter import load_classifier
    from headsweep.workers.families.hf_classifier.config import ClassifierData, ClassifierModel

    runtime = RuntimeOptions(device="cpu", batch_size=32, masks_per_batch=0 if reuse else 1, reuse=reuse,
                             threads=args.threads)
    data = ClassifierData(path=str(folder / "eval.tsv"), max_length=real_size.SIZES.max_length)
    return load_classifier(ClassifierModel(path=str(folder), attn_implementation="sdpa"), data, runtime)


def scores(work, logits_of) -> list[tuple[float, float]]:
    """(mean cross-entropy, accuracy) of the baseline and every mask, ``logits_of(mask, inputs)`` giving a batch's
    logits."""
    import torch.nn.functional as F

    out = []
    for mask in [None, *work.masks]:
        loss, correct = 0.0, 0.0
        for idx, inputs in work.inputs:
            logits = logits_of(mask, inputs).float()
            labels = work.scored[idx]
            loss += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += float((logits.argmax(-1) == labels).sum())
        out.append((loss / len(work.scored), correct / len(work.scored)))
    return out


def transformerlens_route(work, model) -> list[tuple[float, float]]:
    """HookedEncoder where it exists, else the bridge over the sequence classifier (module docstring)."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    try:
        from transformer_lens import HookedEncoder  # pyright: ignore[reportMissingImports]  (removed in 4.0)
    except ImportError as exc:
        log(f"  transformerlens: HookedEncoder: {str(exc).splitlines()[0][:200]}; trying TransformerBridge")
    else:
        raise RuntimeError(f"HookedEncoder {HookedEncoder} exists in this TransformerLens: add its loop here")
    from transformer_lens.model_bridge import TransformerBridge  # pyright: ignore[reportMissingImports]

    bridge = TransformerBridge.boot_transformers(str(work.folder), device="cpu", dtype=torch.float32, hf_model=model,
                                                 tokenizer=AutoTokenizer.from_pretrained(work.folder),
                                                 model_class=BertForSequenceClassification)

    def logits_of(mask, inputs):
        hooks = []
        if mask is not None:
            def zero(z, hook, h=mask[1]):
                z[:, :, h, :] = 0.0
                return z
            hooks = [(f"blocks.{mask[0]}.attn.hook_z", zero)]
        return bridge.run_with_hooks(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                     fwd_hooks=hooks, return_type="logits")

    with torch.inference_mode():
        return scores(work, logits_of)


def nnsight_route(work, model, invokes: int) -> list[tuple[float, float]]:
    """nnsight over the classifier: one trace per mask, or ``invokes`` masks per trace."""
    import torch
    import torch.nn.functional as F
    from nnsight import NNsight  # pyright: ignore[reportMissingImports]

    wrapped = NNsight(model)
    d = model.config.hidden_size // model.config.num_attention_heads
    masks = [None, *work.masks]
    sums = [[0.0, 0.0] for _ in masks]
    with torch.inference_mode():
        for idx, inputs in work.inputs:
            labels = work.scored[idx]
            for start in range(0, len(masks), invokes):
                group, saved = masks[start : start + invokes], []
                with wrapped.trace() as tracer:
                    for mask in group:
                        with tracer.invoke(**inputs):
                            if mask is not None:
                                layer, h = mask
                                wrapped.bert.encoder.layer[layer].attention.self.output[0][..., h * d : (h + 1) * d] = 0
                            saved.append(wrapped.output.logits.save())
                for i, logits in enumerate(saved):
                    sums[start + i][0] += float(F.cross_entropy(logits.float(), labels, reduction="sum"))
                    sums[start + i][1] += float((logits.argmax(-1) == labels).sum())
    return [(loss / len(work.scored), correct / len(work.scored)) for loss, correct in sums]


def headsweep_route(work, args, reuse: bool) -> tuple[list[tuple[float, float]], float]:
    from headsweep.workers.core.heads import Head

    start = time.perf_counter()
    adapter = adapter_for(work.folder, args, reuse)
    load_s = time.perf_counter() - start
    outputs = adapter.evaluate([[], *([Head("self", lay, h)] for lay, h in work.masks)])
    return [(float(o.loss.mean()), float(o.score)) for o in outputs], load_s


def load_model(work):
    from transformers import AutoModelForSequenceClassification

    start = time.perf_counter()
    model = AutoModelForSequenceClassification.from_pretrained(work.folder, dtype="float32",
                                                               attn_implementation="sdpa").eval()
    return model, time.perf_counter() - start


def equality(work) -> bool:
    """Mean losses within the float32 bound of plain's, accuracies identical."""
    import numpy as np
    from transformers import AutoConfig

    from tests.tolerances import max_difference, route_bound

    config = AutoConfig.from_pretrained(work.folder)
    reference = np.array([v[0] for v in work.ppl["plain"]])
    tol = route_bound(reference, depth=config.num_hidden_layers, width=config.intermediate_size)
    ok, parts = True, []
    for name, values in work.ppl.items():
        if name != "plain":
            diff = max_difference([v[0] for v in values], reference)
            same_accuracy = [v[1] for v in values] == [v[1] for v in work.ppl["plain"]]
            ok &= diff <= tol and same_accuracy
            parts.append(f"{name} {diff:.2g}{'' if same_accuracy else ' (accuracy differs)'}")
    log(f"  equal: largest |mean loss - plain's| {', '.join(parts)}; bound {tol:.2g}: {'within' if ok else 'ABOVE'}")
    return ok


def main() -> None:
    parser = common.command_line(__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--invokes", type=int, default=4)
    parser.add_argument("--skip-run", action="store_true")
    parser.add_argument("--no-reexec", action="store_true")
    args = parser.parse_args()
    common.enable_smoke(args)
    if not args.no_reexec:
        peers.reexec_with_peers("bench.peers_classifier")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common.quiet_logging()
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    folder = real_size.build(real_size.SPECS["bert-base"])  # shrunk by --smoke (real_size.use_smoke)
    work = classifier_workload(folder, args, 2 if common.SMOKE else None)
    log(f"peers_classifier: bert-base, {len(work.masks)} single heads + baseline over {len(work.scored)} sentences "
        f"in {len(work.inputs)} batches, {args.threads} thread(s); load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, reuse in (("plain", False), ("default", True)):
        start = time.perf_counter()
        work.ppl[name], work.load_s[name] = headsweep_route(work, args, reuse)
        work.seconds[name] = time.perf_counter() - start - work.load_s[name]
        log(f"  {name:<16} {work.seconds[name]:7.1f} s (load {work.load_s[name]:.1f} s)")
    for name in peers.PEERS:
        why = peers.peer_available(name)
        if why is not None:
            work.failed[name] = why
            log(f"peers: {name} not run: {why}")
            continue
        model, work.load_s[name] = load_model(work)
        invokes = 1 if name == "nnsight_loop" else args.invokes
        if name == "transformerlens":
            peers.timed(work, name, lambda m=model: transformerlens_route(work, m))
        else:
            peers.timed(work, name, lambda m=model, k=invokes: nnsight_route(work, m, k))
        del model
    stamps = None
    if not args.skip_run:
        with tempfile.TemporaryDirectory(prefix="peers_classifier-") as tmp:
            stamps = peers.run_end_to_end(
                work, Path(tmp), {"kind": "hf_classifier", "path": str(folder), "attn_implementation": "sdpa",
                                  "dtype": "float32"},
                {"path": str(folder / "eval.tsv"), "max_length": real_size.SIZES.max_length})
        if stamps:
            peers.startup_phases(stamps, "classifier")
    equal = equality(work)
    fastest = peers.fastest_peer(work, with_load=True)
    fastest_in_process = peers.fastest_peer(work, with_load=False)
    default_s = work.seconds["default"]
    log(f"  bound {bound(work):.2f}; default over plain {peers.ratio(work.seconds['plain'], default_s)}"
        + (f"; the fastest peer ({fastest_in_process[0]}) over default {peers.ratio(fastest_in_process[1], default_s)}"
           if fastest_in_process else ""))
    common.result("peers_classifier", shape="bert-base", bound=f"{bound(work):.2f}",
                  vs_transformerlens=peers.ratio(work.seconds.get("transformerlens"), default_s),
                  vs_nnsight_loop=peers.ratio(work.seconds.get("nnsight_loop"), default_s),
                  vs_nnsight_batched=peers.ratio(work.seconds.get("nnsight_batched"), default_s),
                  one_minute_vs_fastest=peers.ratio(fastest[1] if fastest else None, work.seconds.get("run")),
                  startup_s="n/a" if not stamps or "ready" not in stamps else f"{stamps['ready']:.1f}",
                  equal=str(equal).lower())


def bound(work) -> float:
    """Plain FLOPs over reuse's for this grid (bench/flops.py; a BERT mask from layer l as reuse runs it)."""
    from transformers import AutoConfig

    from bench.flops import Arch

    arch = Arch.of(AutoConfig.from_pretrained(work.folder))
    rows = [(len(idx), inputs["input_ids"].shape[1], 0) for idx, inputs in work.inputs]
    full = arch.mask(rows, None)
    return full * (1 + len(work.masks)) / (full + sum(arch.mask(rows, layer) for layer, _ in work.masks))


if __name__ == "__main__":
    main()
