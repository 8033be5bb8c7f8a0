"""Resample ablation for fairseq translation's encoder self-attention.

The independent route is written here with fairseq alone, one sentence at a time (no padding, no batching): the
donor sentence runs through a freshly loaded, ungated model's encoder with a pre-hook on every encoder layer's
``self_attn.out_proj`` recording its input; then fairseq's own beam search of the example runs with a pre-hook on
the masked heads' projections writing the donor's slices over the example's (TransformerLens's ``hook_z``
patching). The adapter runs the same through ``evaluate``: every batch's donors padded on the left as the batch,
recorded once by the encoder alone and installed as the per-example fill, with encoder reuse on and off, one mask
per search and three packed into one, batches of sentences and token batches. Hypotheses, sacrebleu's per-sentence
statistics and corpus BLEU must be identical; teacher-forced losses agree within the summation-order bound.

Also: K = 2 draws average each sentence's statistics; what the driver refuses (decoder attention, patch,
sentences without another of their source length) is one line, exit 2, nothing written; a run through the CLI
stores ``ablation = 'resample'``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
import torch.nn.functional as F
import yaml
from conftest import run_cli, run_refused
from sacrebleu.metrics import BLEU
from tiny_fairseq import BOUND_SHAPE, fairseq_load
from tolerances import assert_routes_agree

from headsweep.errors import HeadsweepError
from headsweep.workers.ablation.resample import ResampleSettings
from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.heads import Head
from headsweep.workers.families.fairseq_translation.adapter import TranslationAdapter, load_translation
from headsweep.workers.families.fairseq_translation.config import TranslationData, TranslationModel
from headsweep.workers.families.fairseq_translation.config import TranslationRuntime as RuntimeOptions

pytestmark = pytest.mark.usefixtures("one_thread")
BEAM, MAX_LEN_B, SEED = 3, 24, 5
LAYERS, HEADS = 2, 4  # tiny_fairseq.TINY_SETTINGS
ENC_SELF = [Head("enc_self", layer, h) for layer in range(LAYERS) for h in range(HEADS)]
# Every enc_self head alone, two heads in two layers (reuse starts at layer 0 and gates layer 1 with the hook), and
# three heads of the last layer (an all-but-one mask)
MASKS: list[list[Head]] = [[h] for h in ENC_SELF] + [
    [Head("enc_self", 0, 1), Head("enc_self", 1, 2)],
    [Head("enc_self", 1, 0), Head("enc_self", 1, 1), Head("enc_self", 1, 3)],
]
# (reuse, masks per search, batching): encoder reuse on and off, one mask per search and three packed in one, batches
# of 8 sentences (length-sorted: donors of a length split between batches) and token batches
PATHS = [(False, 1, {"batch_size": 8, "max_tokens": 0}), (True, 1, {"batch_size": 8, "max_tokens": 0}),
         (False, 3, {"max_tokens": 90}), (True, 3, {"max_tokens": 90})]


@pytest.fixture(scope="module")
def tiny(trained_tiny_fairseq):
    """The session's tiny model (conftest.trained_tiny_fairseq: read, never changed); its 40 test sentences share their
    source lengths (every sentence has a donor)."""
    return trained_tiny_fairseq


def adapter(tiny, reuse: bool = False, per: int = 1, loss: bool = False, method: str = "resample",
            resamples: int = 1, batching: dict | None = None, source: Path | None = None) -> TranslationAdapter:
    model = TranslationModel(checkpoint=str(tiny.checkpoint), data_bin=str(tiny.data.data_bin), beam=BEAM,
                             max_len_b=MAX_LEN_B)
    data = TranslationData(source=str(source or tiny.data.test_source), target=str(tiny.data.test_target))
    settings = ResampleSettings(seed=SEED, resamples=resamples) if method == "resample" else None
    runtime = RuntimeOptions(reuse=reuse, masks_per_batch=per, loss=loss,
                             ablation=AblationSpec(method=method, settings=settings),
                             **(batching or {"batch_size": 8, "max_tokens": 0}))
    return load_translation(model, data, runtime)


# -- the independent route: fairseq alone, one sentence at a time --------------------------------------------------
@dataclass
class Route:
    """A fresh fairseq model (every encoder self-attention off the fused kernel, fairseq's own switch, so that its
    ``out_proj`` runs as a module), the test sentences encoded by fairseq's dictionaries, and the references."""

    model: torch.nn.Module
    task: object
    sources: list[torch.Tensor]
    targets: list[torch.Tensor]
    references: list[str]

    @property
    def projections(self) -> list[torch.nn.Module]:
        return [layer.self_attn.out_proj for layer in self.model.encoder.layers]

    @property
    def head_dim(self) -> int:
        return self.model.encoder.layers[0].self_attn.head_dim

    def record(self, i: int) -> list[torch.Tensor]:
        """Sentence ``i`` alone through the ungated encoder: each layer's projection input, (T, 1, E)."""
        seen: list = [None] * len(self.projections)
        handles = [p.register_forward_pre_hook(lambda _m, args, n=n: seen.__setitem__(n, args[0].clone()))
                   for n, p in enumerate(self.projections)]
        try:
            with torch.no_grad():
                self.model.encoder(self.sources[i][None], src_lengths=torch.tensor([len(self.sources[i])]))
        finally:
            for h in handles:
                h.remove()
        return seen

    def patched(self, mask: Sequence[Head], donor: list[torch.Tensor]):
        """Pre-hooks writing ``donor``'s slices of the masked heads over the example's (remove them after)."""
        d = self.head_dim

        def hook(layer: int):
            def write(_m, args):
                x = args[0].clone()
                for head in mask:
                    if head.layer == layer:
                        cols = slice(head.head * d, (head.head + 1) * d)
                        x[..., cols] = donor[layer][..., cols]
                return (x, *args[1:])
            return write

        return [self.projections[layer].register_forward_pre_hook(hook(layer))
                for layer in sorted({h.layer for h in mask})]

    def translate(self, i: int, mask: Sequence[Head], donor: list[torch.Tensor]) -> str:
        """fairseq's beam search of sentence ``i`` alone with the donor's slices in place: the detokenised best
        hypothesis (the synthetic data have no BPE)."""
        from fairseq.sequence_generator import SequenceGenerator

        generator = SequenceGenerator([self.model], self.task.target_dictionary, beam_size=BEAM, max_len_b=MAX_LEN_B)
        sample = {"id": torch.tensor([0]), "net_input": {"src_tokens": self.sources[i][None],
                                                         "src_lengths": torch.tensor([len(self.sources[i])])}}
        handles = self.patched(mask, donor)
        try:
            with torch.no_grad():
                best = generator.generate([self.model], sample)[0][0]
        finally:
            for h in handles:
                h.remove()
        return self.task.target_dictionary.string(best["tokens"])

    def nll(self, i: int, mask: Sequence[Head], donor: list[torch.Tensor]) -> float:
        """Teacher-forced cross-entropy of reference ``i`` (nats per target token, EOS included)."""
        target = self.targets[i]
        previous = torch.cat([target[-1:], target[:-1]])  # fairseq's: EOS moved to the front
        handles = self.patched(mask, donor)
        try:
            with torch.no_grad():
                logits = self.model(self.sources[i][None], torch.tensor([len(self.sources[i])]), previous[None])[0]
        finally:
            for h in handles:
                h.remove()
        return float(F.cross_entropy(logits[0].float(), target, reduction="mean"))

    def outputs(self, mask: Sequence[Head], donors: np.ndarray) -> list[str]:
        recorded = [self.record(i) for i in range(len(self.sources))]
        return [self.translate(i, mask, recorded[int(donors[i])]) for i in range(len(self.sources))]

    def stats(self, hypotheses: list[str]) -> np.ndarray:
        """sacrebleu's per-sentence BLEU statistics (its own significance tests' call)."""
        return np.asarray(BLEU(force=True, references=[self.references])._extract_corpus_statistics(hypotheses, None))


@pytest.fixture(scope="module")
def route(tiny) -> Route:
    model, task = fairseq_load(tiny.checkpoint, tiny.data.data_bin)
    for layer in model.encoder.layers:
        layer.self_attn.skip_embed_dim_check = True
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    source_lines = tiny.data.test_source.read_text().splitlines()
    target_lines = tiny.data.test_target.read_text().splitlines()
    sources = [src_dict.encode_line(line, add_if_not_exist=False, append_eos=True).long() for line in source_lines]
    targets = [tgt_dict.encode_line(line, add_if_not_exist=False, append_eos=True).long() for line in target_lines]
    return Route(model, task, sources, targets, target_lines)


@pytest.fixture(scope="module")
def reference(route, tiny) -> dict:
    """The route's hypotheses for every mask under draw 0 of the adapter's donors, and the donors."""
    donors = adapter(tiny).donors.donors
    return {"donors": donors, "outputs": [route.outputs(m, donors[0]) for m in MASKS]}


def test_resample_equals_a_hook_loop_on_every_path(tiny, route, reference):
    donors = reference["donors"][0]
    lengths = np.array([len(s) for s in route.sources])
    # the donors: another sentence of the same source length (EOS included)
    assert (lengths[donors] == lengths).all() and not (donors == np.arange(len(lengths))).any()
    zero = adapter(tiny, method="zero").evaluate(MASKS)
    for m, (mask, out) in enumerate(zip(MASKS, zero, strict=True)):
        # other: the route can fail: the donor's slices change some hypothesis against zero ablation
        assert out.outputs != reference["outputs"][m], f"{mask}: resample changes nothing against zero ablation"
    recorded = [route.record(int(d)) for d in donors]  # each sentence's donor, alone through the encoder
    for reuse, per, batching in PATHS:
        with_loss = not reuse and per == 1  # the teacher-forced pass on one path: its cost is not the point here
        a = adapter(tiny, reuse, per, loss=with_loss, batching=batching)
        what = (reuse, per, batching)
        assert np.array_equal(a.donors.donors[0], donors)
        assert a.reuse_note.startswith("encoder") == reuse
        widths = [(s["net_input"]["src_lengths"].min(), s["net_input"]["src_lengths"].max()) for s in a.batches]
        # the left padding is exercised: some batch holds sentences of two lengths
        assert any(lo < hi for lo, hi in widths) and len(a.batches) > 1, what
        outputs = a.evaluate(MASKS)
        for m, (mask, out) in enumerate(zip(MASKS, outputs, strict=True)):
            want = reference["outputs"][m]
            # exact: the same hypotheses, so the same sacrebleu statistics and BLEU
            assert out.outputs == want, (what, mask, [i for i, (x, y) in enumerate(zip(out.outputs, want, strict=True))
                                                       if x != y])
            assert np.array_equal(out.stats, route.stats(want)), (what, mask)
            assert out.score == pytest.approx(sacrebleu.corpus_bleu(want, [route.references]).score, abs=1e-9)
            if with_loss:
                expected = [route.nll(i, mask, recorded[i]) for i in range(len(route.sources))]
                # summation order: batched and padded against one sentence at a time
                assert_routes_agree(out.loss, expected, **BOUND_SHAPE, what=(what, mask, "loss"))


def test_two_draws_average_each_sentences_statistics(tiny, route, reference):
    a = adapter(tiny, reuse=True, per=3, resamples=2)
    donors = a.donors.donors
    assert donors.shape == (2, len(route.sources)) and np.array_equal(donors[0], reference["donors"][0])
    masks = MASKS[:2] + MASKS[-1:]
    first = [reference["outputs"][MASKS.index(m)] for m in masks]
    second = [route.outputs(m, donors[1]) for m in masks]
    outputs = a.evaluate(masks)
    for mask, out, one, two in zip(masks, outputs, first, second, strict=True):
        expected = (route.stats(one) + route.stats(two)) / 2
        # exact: the statistics are counts, their mean over two draws is exact in float64
        assert np.array_equal(out.stats, expected), mask
        assert out.outputs == one  # the first draw's hypotheses
    # other: the draws differ: some mask's statistics are not draw 0's alone
    assert any(not np.array_equal(o.stats, route.stats(one)) for o, one in zip(outputs, first, strict=True))
    (base,) = a.evaluate([[]])  # the baseline gates nothing: one search, whatever the draws
    assert np.array_equal(base.stats, route.stats([route.translate(i, [], []) for i in range(len(route.sources))]))


def test_gate_gradients_under_resample_are_attribution_patching(tiny, route):
    """``loss_batches`` under resample (gradient importance, the L0 gates): each enc_self gate's gradient at 1 is
    ``dL/dz' . (z - c)``, c the donor's slice, from a hook that mixes ``xi z + (1 - xi) c`` itself, one sentence at
    a time. The gates are set while each batch's donor pass runs: a gated module must stay off the fused kernel after
    it, or its hook would silently not run."""
    a = adapter(tiny)
    sites = [s for s in a.gates.sites if s.attention == "enc_self"]
    gates = {s.key: torch.ones(s.num_heads, dtype=torch.float64, requires_grad=True) for s in sites}
    a.gates.set_values(gates)
    try:
        for batch in a.loss_batches(0.0, torch.float64).batches:  # no label smoothing: the summed NLL
            batch.loss().backward()
    finally:
        a.gates.clear()
    got = torch.stack([gates[s.key].grad for s in sites])

    heads, d = HEADS, route.head_dim
    xi = torch.ones(LAYERS, heads, dtype=torch.float64, requires_grad=True)
    donors = a.donors.donors[0]
    for i, target in enumerate(route.targets):
        donor = route.record(int(donors[i]))

        def mix(layer, donor=donor):
            def hook(_m, args):
                z = args[0].view(*args[0].shape[:-1], heads, d)
                c = donor[layer].view_as(z)
                w = xi[layer].view(heads, 1).to(z.dtype)
                return ((z * w + (1 - w) * c).reshape(args[0].shape),)
            return hook

        handles = [p.register_forward_pre_hook(mix(layer)) for layer, p in enumerate(route.projections)]
        try:
            previous = torch.cat([target[-1:], target[:-1]])
            logits = route.model(route.sources[i][None], torch.tensor([len(route.sources[i])]), previous[None])[0]
            F.cross_entropy(torch.log_softmax(logits[0].double(), -1), target, reduction="sum").backward()
        finally:
            for h in handles:
                h.remove()
    route.model.zero_grad(set_to_none=True)
    # float32 forward passes batched and padded against one sentence at a time; the gradients are O(1e-2 .. 10)
    assert got.abs().max() > 1e-2
    assert torch.allclose(got, xi.grad, rtol=1e-4, atol=1e-5), (got - xi.grad).abs().max()
    # other: the check can fail: zero ablation's gradient z . dL/dz' differs from the donor's
    zero = adapter(tiny, method="zero")
    zero_gates = {s.key: torch.ones(s.num_heads, dtype=torch.float64, requires_grad=True)
                  for s in zero.gates.sites if s.attention == "enc_self"}
    zero.gates.set_values(zero_gates)
    try:
        for batch in zero.loss_batches(0.0, torch.float64).batches:
            batch.loss().backward()
    finally:
        zero.gates.clear()
    assert not torch.allclose(torch.stack([g.grad for g in zero_gates.values()]), xi.grad, rtol=1e-2, atol=1e-3)


def test_an_adapter_refuses_decoder_heads_under_resample(tiny):
    a = adapter(tiny)
    with pytest.raises(HeadsweepError, match="a mask of this run gates dec_self:1:0"):
        a.evaluate([[Head("enc_self", 0, 0)], [Head("dec_self", 1, 0)]])


# -- what the driver refuses ---------------------------------------------------------------------------------------
def config(tiny, source: Path | None = None, **sweep) -> dict:
    return {"name": "tiny-resample",
            "model": {"kind": "fairseq_translation", "checkpoint": str(tiny.checkpoint),
                      "data_bin": str(tiny.data.data_bin), "beam": BEAM, "max_len_b": MAX_LEN_B},
            "data": {"source": str(source or tiny.data.test_source), "target": str(tiny.data.test_target)},
            "sweep": {"experiments": ["baseline", "single_head"], "workers": 1, "batch_size": 20,
                      "ablation": "resample", **sweep},
            "significance": {"n_resamples": 100}}


@pytest.mark.parametrize(("change", "message"), [
    ({"sweep": {"attention": ["enc_self", "dec_self"]}}, "sweep.attention takes in dec_self heads"),
    ({"sweep": {"attention": ["enc_self"], "masks": [["enc_self:0:1", "enc_dec:1:2"]]}},
     "sweep.masks names enc_dec:1:2"),
    ({"sweep": {"attention": ["enc_self"], "experiments": ["baseline", "pairs"]},
      "pairs": {"select": "list", "heads": ["enc_self:0:0", "dec_self:0:1"]}}, "pairs.heads names dec_self:0:1"),
    ({"sweep": {"attention": ["enc_self"], "experiments": ["baseline", "prune_level"]},
      "importance": {"method": "lrp", "data": "HELDOUT"}}, "prune.attention is unset (every attention type)"),
    ({"sweep": {"attention": ["enc_self"], "experiments": ["baseline", "l0"]},
      "l0": {"data": "HELDOUT", "attention": ["enc_self", "enc_dec"]}}, "l0.attention takes in enc_dec heads"),
    ({"sweep": {"attention": ["enc_self"], "experiments": ["baseline", "importance"]},
      "importance": {"data": "HELDOUT"}}, "gradient importance scores every head"),
])
def test_config_checks(tiny, change, message):
    """What the driver refuses before any worker starts, for every kind that gates heads (the CLI prints it as one
    line, as below)."""
    from headsweep.sweep.configuration.config import build_config

    cfg = config(tiny)
    heldout = {"data_bin": str(tiny.data.data_bin), "split": "valid"}
    for key, value in change.items():
        value = json.loads(json.dumps(value).replace('"HELDOUT"', json.dumps(heldout)))
        cfg[key] = {**cfg.get(key, {}), **value}
    with pytest.raises(HeadsweepError, match=re.escape(message)) as refused:
        build_config(cfg)
    assert "available for fairseq_translation models on enc_self heads only" in str(refused.value)
    # the same run gating enc_self heads only is accepted
    if "masks" in cfg["sweep"] or "pairs" in cfg:
        return
    for key, section in (("prune", "prune.attention"), ("l0", "l0.attention"), ("sweep", "sweep.attention")):
        if section in message:
            cfg[key] = {**cfg.get(key, {}), "attention": ["enc_self"]}
    if "importance" in message:
        cfg["importance"]["method"] = "lrp"
    build_config(cfg)


def refused(tmp_path: Path, ray_address: str, cfg: dict, *parts: str) -> None:
    tmp_path.mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_refused(path, tmp_path / "store", ray_address, *parts)


def test_refusals_through_the_cli_are_one_line(tmp_path, tiny, ray_address):
    # decoder attention: sweep.attention unset takes in every attention type
    refused(tmp_path / "a", ray_address, config(tiny),
            "sweep.ablation resample is available for fairseq_translation models on enc_self heads only",
            "sweep.attention is unset", "decoder attention cannot take another sentence's states",
            "set sweep.attention: [enc_self], or use sweep.ablation mean")
    # patch: no paired translation data
    cfg = config(tiny, attention=["enc_self"])
    cfg["sweep"]["ablation"] = "patch"
    refused(tmp_path / "b", ray_address, cfg, "sweep.ablation patch is not available for fairseq_translation models",
            "no paired data format")
    # a sentence whose source length no other sentence has: refused when the worker loads the data
    lines = tiny.data.test_source.read_text().splitlines()
    odd = tmp_path / "odd.src"
    odd.write_text("\n".join([*lines[:-1], " ".join(lines[-1].split() * 3)]) + "\n")
    refused(tmp_path / "c", ray_address, config(tiny, source=odd, attention=["enc_self"]),
            "1 of the 40 sentences of data", "have no other of their length", "sweep.ablation mean")


# -- a run through the CLI -----------------------------------------------------------------------------------------
def test_a_resample_run_through_the_cli(tmp_path, tiny, ray_address):
    from headsweep.results.store import ResultStore

    cfg = config(tiny)
    cfg["sweep"]["ablation"] = "zero"
    cfg["sweep"]["experiments"] = ["single_head"]  # the baseline comes with it
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    proc = run_cli("run", str(path), "sweep.ablation=resample", "sweep.attention=[enc_self]", f"ablation.seed={SEED}",
                   "significance.enabled=false", "--store", str(store), "--address", ray_address, "--quiet")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    results = ResultStore(str(store))
    assert results.read("significance", run_id).num_rows == 0
    rows = results.read("evaluations", run_id).to_pylist()
    assert {r["ablation"] for r in rows} == {"resample"}
    assert sorted(r["experiment"] for r in rows) == ["baseline"] + ["single_head"] * len(ENC_SELF)
    assert {(r["attention"], r["layer"], r["head"]) for r in rows if r["experiment"] == "single_head"} == {
        (h.attention, h.layer, h.head) for h in ENC_SELF}
    (run,) = results.read("runs", run_id).to_pylist()
    assert json.loads(run["facts"])["ablation"]["method"] == "resample"
    # the worker's scores: what the adapter gives with the run's seed and batching
    local = adapter(tiny, batching={"batch_size": 20, "max_tokens": 0})
    singles = MASKS[: len(ENC_SELF)]
    scores = {str(m[0]): o.score for m, o in zip(singles, local.evaluate(singles), strict=True)}
    for r in rows:
        if r["experiment"] == "single_head":
            assert r["score"] == pytest.approx(scores[f"{r['attention']}:{r['layer']}:{r['head']}"], abs=1e-9)
