"""Reading every head's attention maps through a model family's adapter, and the ``roles`` worker step.

The statistics are family-independent (:mod:`headsweep.workers.head_roles`); what is per family is
small: a reader that runs the adapter's evaluation batches through the unmasked model and hands each
site's weights ``(batch, heads, query, key)``, with the tokens its queries and keys run over
(:class:`~headsweep.workers.head_roles.SiteAttention`), to a sink as the module returns them.

The weights are captured at the attention modules, on the path that computes them:

* transformers (``hf_classifier``, ``hf_causal_lm``): the model is switched to the eager attention
  path for the analysis (``set_attn_implementation("eager")``, the implementation it had is put back
  afterwards) and a forward hook on each attention module takes the weights the module returns. SDPA
  and flash kernels return none; a module that still returns none on the eager path is an error,
  never a map of zeros.
* fairseq (``fairseq_translation``): each ``MultiheadAttention`` is taken off its fused path for the
  analysis (``F.multi_head_attention_forward`` returns the heads' average at best) and asked for per-head
  weights (``need_head_weights``); its caller gets back what it asked for (no weights, or the head
  average), so the model computes what its unfused path computes without the analysis. Teacher forcing
  on the references: the decoder reads the reference's previous tokens.

Each site's maps are handed on as its module returns them, so one layer's maps are held at a time. A
plugin family takes part by giving its adapter an ``attention_maps(sink)`` method that runs its batches,
calls ``sink(site_key, SiteAttention)`` for every site and yields after each batch.
"""

from __future__ import annotations

import html
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.gates import AttentionSite
from headsweep.workers.head_roles import (
    FrequencyTable,
    HeadRole,
    RoleSettings,
    RoleTotals,
    SiteAttention,
    TokenSide,
    sentence_statistics,
)
from headsweep.workers.heads import SiteKey
from headsweep.workers.syntax import (
    Aligned,
    SyntaxSettings,
    SyntaxTotals,
    align,
    check_parses,
    describe_parses,
    offset_spans,
    parses_source,
    piece_string_spans,
    read_conllu,
    sentence_syntax,
    spacy_parses,
    word_spans,
)
from headsweep.workers.text_files import read_text, split_lines

AttentionBatch = dict[SiteKey, SiteAttention]
DICTIONARY = "dictionary"


# -- capture at the attention modules ------------------------------------------------------------------
Consumer = Callable[[SiteKey, torch.Tensor], None]


@contextmanager
def transformers_attention(model: nn.Module, sites: Sequence[AttentionSite],
                           consume: Consumer | None = None) -> Iterator[dict[SiteKey, torch.Tensor]]:
    """While inside, every forward of ``model`` leaves each site's attention weights (B, H, Q, K) in the
    yielded dict (replaced at each forward), or hands them to ``consume(key, weights)`` as each module
    returns them (so only one layer's maps are held at a time). The model runs the eager path meanwhile."""
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if previous != "eager":
        model.set_attn_implementation("eager")
        if config._attn_implementation != "eager":
            raise HeadsweepError(f"{type(model).__name__} cannot switch to the eager attention path "
                                 f"(it runs {previous!r}, whose kernel returns no attention weights): roles "
                                 "cannot read its heads' attention")
    captured: dict[SiteKey, torch.Tensor] = {}
    handles = []

    def recorder(site: AttentionSite) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or weights.shape[1] != site.num_heads:
                raise HeadsweepError(f"{site.module_name} returned no per-head attention weights on the eager "
                                     "path: roles cannot read this model's attention")
            if consume is None:
                captured[site.key] = weights.detach()
            else:
                consume(site.key, weights.detach())

        return hook

    try:
        for site in sites:
            handles.append(site.module.register_forward_hook(recorder(site)))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        if previous != "eager" and previous is not None:
            model.set_attn_implementation(previous)


@contextmanager
def fairseq_attention(sites: Sequence[AttentionSite],
                      consume: Consumer | None = None) -> Iterator[dict[SiteKey, torch.Tensor]]:
    """While inside, every forward through the sites' fairseq ``MultiheadAttention`` modules leaves their
    per-head weights (B, H, Q, K) in the yielded dict, or hands them to ``consume(key, weights)``; callers
    still get the weights they asked for."""
    captured: dict[SiteKey, torch.Tensor] = {}
    asked: dict[int, list[tuple[bool, bool]]] = {}
    handles, flags = [], []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        asked.setdefault(id(module), []).append((bool(kwargs.get("need_weights", True)),
                                                 bool(kwargs.get("need_head_weights", False))))
        return args, {**kwargs, "need_weights": True, "need_head_weights": True}

    def recorder(site: AttentionSite) -> Callable:
        def after(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
            need_weights, need_heads = asked[id(module)].pop()
            attn, weights = output
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
                raise HeadsweepError(f"{site.module_name} returned no per-head attention weights: roles cannot "
                                     "read this model's attention")
            per_head = weights.detach().transpose(0, 1)  # fairseq: (H, B, Q, K)
            if consume is None:
                captured[site.key] = per_head
            else:
                consume(site.key, per_head)
            if need_heads:
                return attn, weights
            # As MultiheadAttention averages when only need_weights is asked for.
            return attn, weights.mean(dim=0) if need_weights else None

        return after

    try:
        for site in sites:
            module = site.module
            if hasattr(module, "skip_embed_dim_check"):
                # Off the fused path (F.multi_head_attention_forward), which averages the heads' weights.
                flags.append((module, module.skip_embed_dim_check))
                module.skip_embed_dim_check = True
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(recorder(site), with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in flags:
            module.skip_embed_dim_check = flag


# -- per-family readers ----------------------------------------------------------------------------
def _special(ids: torch.Tensor, special_ids: set[int]) -> torch.Tensor:
    if not special_ids:
        return torch.zeros_like(ids, dtype=torch.bool)
    return torch.isin(ids, torch.tensor(sorted(special_ids), device=ids.device))


def tokenizer_specials(tokenizer: Any) -> set[int]:
    """A transformers tokenizer's special ids ([CLS], [SEP], BOS, EOS, padding...) except the unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None and i != unk}


Sink = Callable[[SiteKey, SiteAttention], None]


def classifier_maps(adapter: Any, sink: Sink) -> Iterator[None]:
    """A transformers classifier (``hf_classifier``) on its evaluation batches: every site is self-attention
    over the batch's tokens; [CLS]/[SEP] (the tokenizer's special ids but the unknown token) are special.
    Hands each site's maps to ``sink`` as its module returns them; yields after each batch."""
    specials = tokenizer_specials(adapter.tokenizer)
    now: dict[str, TokenSide] = {}
    adapter.gates.clear()
    with transformers_attention(adapter.model, adapter.gates.sites,
                                lambda key, w: sink(key, SiteAttention(w, now["side"], now["side"]))):
        for _idx, inputs in adapter.batches:
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            now["side"] = TokenSide(ids, real, _special(ids, specials) & real, "text", _idx)
            with torch.inference_mode():  # not across the yield: the caller's code runs as it chose
                adapter.model(**inputs)
            yield


def causal_lm_maps(adapter: Any, sink: Sink) -> Iterator[None]:
    """A decoder-only model (``hf_causal_lm``) on its evaluation windows: causal self-attention over each
    window; a window's BOS (``data.add_bos``) and any other special id are special."""
    if not hasattr(adapter, "inputs") or not hasattr(adapter, "batches"):
        raise HeadsweepError(f"{type(adapter).__name__}: roles reads decoder-only models on perplexity windows "
                             "(data.task: perplexity) only")
    specials = tokenizer_specials(adapter.tokenizer)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(adapter.model.forward).parameters else {}
    now: dict[str, TokenSide] = {}
    adapter.gates.clear()
    with transformers_attention(adapter.model, adapter.gates.sites,
                                lambda key, w: sink(key, SiteAttention(w, now["side"], now["side"], causal=True))):
        for idx in adapter.batches:
            ids = adapter.inputs[idx.to(adapter.inputs.device)]
            now["side"] = TokenSide(ids, torch.ones_like(ids, dtype=torch.bool), _special(ids, specials), "text")
            with torch.inference_mode():
                adapter.model(input_ids=ids, use_cache=False, **extra)
            yield


def _dictionary_side(tokens: torch.Tensor, dictionary: Any, vocab: str, examples: torch.Tensor | None = None
                     ) -> TokenSide:
    real = tokens.ne(dictionary.pad())
    special = _special(tokens, {dictionary.bos(), dictionary.eos(), dictionary.pad()}) & real
    return TokenSide(tokens, real, special, vocab, examples)


def translation_maps(adapter: Any, sink: Sink) -> Iterator[None]:
    """A fairseq translation model (``fairseq_translation``), teacher-forced on the references: ``enc_self``
    over the source, ``dec_self`` (causal) over the decoder's input (EOS, then the reference but its last
    token), ``enc_dec`` from the decoder's input to the source. EOS, BOS and padding are special."""
    model = adapter.model
    if hasattr(model.decoder, "set_beam_size"):
        model.decoder.set_beam_size(1)  # a beam search may have left "beamable" encoder attention on
    sides: dict[str, tuple[TokenSide, TokenSide, bool]] = {}
    adapter.gates.clear()
    with fairseq_attention(adapter.gates.sites, lambda key, w: sink(key, SiteAttention(w, *sides[key[0]]))):
        for sample in adapter.batches:
            net = sample["net_input"]
            source = _dictionary_side(net["src_tokens"], adapter.src_dict, "source", sample["id"])
            target = _dictionary_side(net["prev_output_tokens"], adapter.tgt_dict, "target")
            sides.update({"enc_self": (source, source, False), "dec_self": (target, target, True),
                          "enc_dec": (target, source, False)})
            with torch.inference_mode():
                model(**net)
            yield


READERS: dict[str, Callable[[Any, Sink], Iterator[None]]] = {
    "hf_classifier": classifier_maps,
    "hf_causal_lm": causal_lm_maps,
    "fairseq_translation": translation_maps,
}


def read_attention(adapter: Any, family: str, sink: Sink) -> Iterator[None]:
    """Run ``adapter``'s unmasked model on its batches, handing every site's maps to ``sink`` as its module
    returns them (family ``family``'s reader, or the adapter's own ``attention_maps(sink)``); yields per batch."""
    own = getattr(adapter, "attention_maps", None)
    if callable(own):
        return own(sink)
    if family not in READERS:
        raise HeadsweepError(f"model family {family!r} gives no attention maps (its adapter has no "
                             "attention_maps()): roles cannot run on it")
    return READERS[family](adapter, sink)


def attention_maps(adapter: Any, family: str) -> Iterator[AttentionBatch]:
    """Each batch's maps of every site, together (holds all layers' maps of a batch: for inspection and tests)."""
    batch: AttentionBatch = {}
    for _ in read_attention(adapter, family, batch.__setitem__):
        yield dict(batch)
        batch.clear()


# -- token frequencies ----------------------------------------------------------------------------
def frequency_tables(adapter: Any, family: str, spec: str | None, top: int) -> tuple[dict[str, FrequencyTable], str]:
    """The frequency table of each vocabulary ``spec`` gives (``roles.frequencies``) and a description of it.

    ``dictionary``: a fairseq model's source and target dictionaries' counts (as fairseq wrote them into
    ``dict.<lang>.txt`` from the training data; its special symbols count 1). A file: a corpus, one
    sentence a line (UTF-8, plain or .gz), tokenised as the model's inputs are (without special tokens;
    for fairseq as the source side, so only source keys get frequencies). None: fairseq's dictionaries,
    for other families no frequencies (rare-word statistics are left null).
    """
    if spec is None:
        if family != "fairseq_translation":
            return {}, "none: rare-word statistics not computed (set roles.frequencies to a corpus file)"
        spec = DICTIONARY
    if spec == DICTIONARY:
        if not hasattr(adapter, "src_dict"):
            raise HeadsweepError("roles.frequencies: dictionary needs a fairseq model (its dictionaries' counts); "
                                 "give a corpus file instead")
        tables = {"source": FrequencyTable(np.asarray(adapter.src_dict.count), top, "source dictionary"),
                  "target": FrequencyTable(np.asarray(adapter.tgt_dict.count), top, "target dictionary")}
        return tables, (f"fairseq dictionaries' counts (dict.{adapter.source_lang}.txt, dict.{adapter.target_lang}.txt"
                        f" of the model's data_bin); rare: outside the {top} most frequent types")
    lines = [line for line in split_lines(read_text(spec, key="roles.frequencies")) if line.strip()]
    if hasattr(adapter, "pipeline"):  # fairseq: the source side's tokenisation and dictionary
        counts = np.zeros(len(adapter.src_dict), dtype=np.int64)
        for line in lines:
            ids = adapter.pipeline.encode(line, "source")[:-1].numpy()  # without the EOS it appends
            np.add.at(counts, ids, 1)
        vocab = "source"
    elif hasattr(adapter, "tokenizer"):
        counts = np.zeros(len(adapter.tokenizer), dtype=np.int64)
        for ids in adapter.tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]:
            np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
        vocab = "text"
    else:
        raise HeadsweepError(f"roles.frequencies: cannot tokenise a corpus for {type(adapter).__name__}")
    name = Path(spec).name
    return ({vocab: FrequencyTable(counts, top, name)},
            f"corpus file {spec} ({len(lines)} lines, {int(counts.sum())} tokens, tokenised as the model's "
            f"{'source ' if vocab == 'source' else ''}input); rare: outside the {top} most frequent types")


# -- syntactic heads: parses aligned with the model's pieces -------------------------------------------
# Attention types scored against the parses: self-attention over the parsed text. Translation models: the source
# side (enc_self); dec_self and enc_dec would need target-side parses, which roles does not read (yet).
SYNTAX_ATTENTION = {"hf_classifier": "self", "fairseq_translation": "enc_self"}
SYNTAX_FAMILIES = tuple(SYNTAX_ATTENTION)


@dataclass
class SyntaxInputs:
    """The aligned sentences by example index (unaligned ones left out), and what runs.facts records."""

    attention: str
    sentences: dict[int, Aligned]
    facts: dict


def _classifier_pieces(adapter: Any, texts: list[str]) -> list[list[tuple[int, int] | None]]:
    """Each example's pieces (as the adapter tokenises it: the same truncation) as compact character spans of
    its first text; the second text of a pair and special tokens span nothing."""
    tok = adapter.tokenizer
    if not getattr(tok, "is_fast", False):
        raise HeadsweepError(f"syntactic heads need a fast tokenizer (character offsets); {type(tok).__name__} "
                             "gives none")
    ex = adapter.examples
    enc = tok(ex.texts, ex.text_pairs, truncation=True, max_length=adapter.max_length, return_offsets_mapping=True,
              verbose=False)
    spans = []
    for i, text in enumerate(texts):
        first = [s == 0 for s in enc.sequence_ids(i)]
        offsets = [o if keep else (0, 0) for o, keep in zip(enc["offset_mapping"][i], first, strict=True)]
        spans.append(offset_spans(text, offsets))
    return spans


def _fairseq_pieces(adapter: Any) -> tuple[list[str], list[list[tuple[int, int] | None] | None]]:
    """Each source sentence spelled by its pieces (BPE markers removed, Moses escapes undone) and the pieces'
    compact spans (EOS spans nothing); None for a sentence holding ``<unk>`` (it spells no characters)."""
    d = adapter.src_dict
    pipeline = getattr(adapter, "pipeline", None)
    continuation = "" if getattr(pipeline, "post_process", None) == "sentencepiece" else "@@"
    texts, spans = [], []
    for ids in adapter.examples.source:
        ids = [int(i) for i in ids]
        pieces = [html.unescape(d[i]) for i in ids if i != d.eos()]
        text, piece_spans = piece_string_spans(pieces, continuation)
        texts.append(text)
        spans.append(None if d.unk() in ids else [*piece_spans, None])
    return texts, spans


def syntax_inputs(adapter: Any, family: str, settings: RoleSettings) -> SyntaxInputs | None:
    """The parses of ``adapter``'s evaluation text (``roles.parses`` or spaCy), checked against it word by word
    and aligned with the model's pieces; None when no syntax is asked for. Cached on the adapter, so the check
    before the run and the run parse once."""
    if not settings.syntax:
        return None
    key = (settings.parses, settings.parser, settings.spacy_model)
    cached = getattr(adapter, "_headsweep_syntax", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if family not in SYNTAX_ATTENTION:
        raise HeadsweepError(f"syntactic heads need sentences of a parsed text: model families "
                             f"{', '.join(SYNTAX_FAMILIES)}, not {family!r}")
    if family == "fairseq_translation":
        texts, spans = _fairseq_pieces(adapter)
    else:
        texts = list(adapter.examples.texts)
        spans = None
    made_by = ""
    if settings.parses:
        parses = read_conllu(settings.parses)
        source = f"roles.parses {settings.parses}"
    else:
        parses, made_by = spacy_parses(texts, settings.spacy_model)
        source = f"spaCy {settings.spacy_model}"
    checked = [i for i in range(len(texts)) if spans is None or spans[i] is not None]
    if len(parses) != len(texts):
        check_parses(parses, texts, source)  # raises: the counts differ
    check_parses([parses[i] for i in checked], [texts[i] for i in checked], source)
    if spans is None:
        spans = _classifier_pieces(adapter, texts)
    sentences: dict[int, Aligned] = {}
    unaligned = []
    for i, parse in enumerate(parses):
        pieces = None if spans[i] is None else align(spans[i], word_spans(parse.words))
        if pieces is None:
            unaligned.append(i)
        else:
            sentences[i] = Aligned(pieces, parse.arcs)
    ids = getattr(adapter.examples, "ids", None) or [str(i) for i in range(len(texts))]
    counts = describe_parses([parses[i] for i in sentences])
    facts = {"parses": parses_source(settings.parses, settings.parser, settings.spacy_model, made_by),
             "attention": SYNTAX_ATTENTION[family], "sentences": len(parses), "aligned": len(sentences),
             "unaligned": len(unaligned), "unaligned_examples": [ids[i] for i in unaligned[:10]],
             "instances": counts, "relations": list(settings.relations), "margin": settings.syntactic_margin,
             "min_instances": settings.syntactic_min_instances, "directions": "either (dep2gov or gov2dep)"}
    result = SyntaxInputs(SYNTAX_ATTENTION[family], sentences, facts)
    adapter._headsweep_syntax = (key, result)
    return result


def _add_syntax(site: SiteAttention, syntax: SyntaxInputs, totals: SyntaxTotals) -> None:
    """Add the statistics of the batch's parsed sentences (each row's real tokens, so padding does not matter)."""
    examples = site.keys.examples
    if examples is None:
        raise HeadsweepError("syntactic heads: the attention reader gives no example indices")
    for b, ex in enumerate(examples.tolist()):
        sentence = syntax.sentences.get(int(ex))
        if sentence is None:
            continue
        real = site.keys.real[b].nonzero().squeeze(1)
        weights = site.weights[b][:, real][:, :, real]
        totals.add(sentence_syntax(weights, sentence))


# -- the worker step -------------------------------------------------------------------------------
@dataclass
class RolesResult:
    """Every head's statistics and roles, with what they were computed on."""

    heads: list[HeadRole]
    frequencies: str
    n_sentences: int
    syntax: dict | None = None  # what runs.facts records of the parses (None: no syntax asked for)


def head_roles(adapter: Any, family: str, settings: RoleSettings) -> RolesResult:
    """Statistics and roles of every head of ``adapter``'s unmasked model on its evaluation data."""
    tables, described = frequency_tables(adapter, family, settings.frequencies, settings.rare_top)
    syntax = syntax_inputs(adapter, family, settings)
    totals: dict[SiteKey, RoleTotals] = {}
    syntax_totals: dict[SiteKey, SyntaxTotals] = {}

    def add(key: SiteKey, site: SiteAttention) -> None:
        stats = sentence_statistics(site, tables.get(site.keys.vocab))
        totals.setdefault(key, RoleTotals(site.weights.shape[1])).add(stats)
        if syntax is not None and key[0] == syntax.attention:
            _add_syntax(site, syntax, syntax_totals.setdefault(key, SyntaxTotals(site.weights.shape[1])))

    for _ in read_attention(adapter, family, add):
        pass
    heads: list[HeadRole] = []
    rules = SyntaxSettings(settings.relations, settings.syntactic_margin, settings.syntactic_min_instances)
    for shape in adapter.gates.inventory.layers:
        key = (shape.attention, shape.layer)
        if key not in totals:
            raise HeadsweepError(f"{shape.attention}:{shape.layer}: no attention weights were read for this layer")
        layer = totals[key].heads(shape.attention, shape.layer, settings)
        if key in syntax_totals:
            for head in layer:
                head.syntax, roles = syntax_totals[key].head(head.head, rules)
                head.roles += roles
        heads += layer
    n_sentences = max((t.n_sentences for t in totals.values()), default=0)
    return RolesResult(heads, described, n_sentences, None if syntax is None else syntax.facts)


def roles_on_worker(worker: Any, data_cfg: Any, settings: RoleSettings) -> RolesResult:
    """Worker-side step of the ``roles`` experiment (``EvalWorker.run``) on ``data_cfg`` (None: the evaluation set)."""
    return head_roles(worker.adapter(data_cfg), worker.kind, settings)


def roles_problem_on_worker(worker: Any, data_cfg: Any, settings: RoleSettings | None = None) -> str | None:
    """Why roles cannot read this worker's model or align its parses (None when it can), asked before anything
    is written."""
    adapter = worker.adapter(data_cfg)
    if settings is not None and settings.syntax:
        try:
            syntax_inputs(adapter, worker.kind, settings)
        except HeadsweepError as exc:
            return str(exc)
    if callable(getattr(adapter, "attention_maps", None)):
        return None
    if worker.kind not in READERS:
        return (f"model family {worker.kind!r} gives no attention maps (its adapter has no attention_maps()): "
                "roles cannot run on it")
    if worker.kind == "hf_causal_lm" and not hasattr(adapter, "inputs"):
        return f"{type(adapter).__name__}: roles reads decoder-only models on perplexity windows only"
    return None
