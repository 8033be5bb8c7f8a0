"""What roles reads besides the attention maps: token frequencies (rare-word statistics) and the parses of the
evaluation text aligned with the model's pieces (syntactic heads). The family's
:class:`~headsweep.workers.attention.reader.AttentionReader` says how its model tokenises; the rest is the same for
every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.attention.head_roles import FrequencyTable, SiteAttention
from headsweep.workers.attention.reader import AttentionReader
from headsweep.workers.attention.syntax import (
    Aligned,
    SyntaxTotals,
    align,
    check_parses,
    describe_parses,
    parses_source,
    read_conllu,
    sentence_syntax,
    spacy_parses,
    word_spans,
)
from headsweep.workers.core.family import ModelFamily
from headsweep.workers.data.text_files import read_text, split_lines
from headsweep.workers.families.registry import syntax_families

DICTIONARY = "dictionary"


def frequency_tables(reader: AttentionReader, spec: str | None, top: int) -> tuple[dict[str, FrequencyTable], str]:
    """The frequency table of each vocabulary ``spec`` gives (``roles.frequencies``) and a description of it.

    ``dictionary``: the model's own counts (a fairseq model's source and target dictionaries, as fairseq wrote
    them into ``dict.<lang>.txt`` from the training data; its special symbols count 1). A file: a corpus, one
    sentence a line (UTF-8, plain or .gz), tokenised as the model's inputs are (without special tokens; for
    fairseq as the source side, so only source keys get frequencies). None: the model's own counts where it has
    some, else no frequencies (rare-word statistics are left null).
    """
    if spec is None or spec == DICTIONARY:
        own = reader.dictionaries(top)
        if own is not None:
            return own
        if spec is None:
            return {}, "none: rare-word statistics not computed (set roles.frequencies to a corpus file)"
        raise HeadsweepError("roles.frequencies: dictionary needs a fairseq model (its dictionaries' counts); "
                             "give a corpus file instead")
    lines = [line for line in split_lines(read_text(spec, key="roles.frequencies")) if line.strip()]
    vocab, counts = reader.corpus_counts(lines)
    return ({vocab: FrequencyTable(counts, top, Path(spec).name)},
            f"corpus file {spec} ({len(lines)} lines, {int(counts.sum())} tokens, tokenised as the model's "
            f"{'source ' if vocab == 'source' else ''}input); rare: outside the {top} most frequent types")


@dataclass
class SyntaxInputs:
    """The aligned sentences by example index (unaligned ones left out), and what runs.facts records."""

    attention: str
    sentences: dict[int, Aligned]
    facts: dict


def syntax_inputs(adapter: Any, family: ModelFamily, settings: Any) -> SyntaxInputs | None:
    """The parses of ``adapter``'s evaluation text (``roles.parses`` or spaCy), checked against it word by word
    and aligned with the model's pieces; None when no syntax is asked for. Cached on the adapter, so the check
    before the run and the run parse once."""
    if not settings.syntax:
        return None
    key = (settings.parses, settings.parser, settings.spacy_model)
    cached = getattr(adapter, "_headsweep_syntax", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    attention = family.syntax_attention
    if attention is None:
        raise HeadsweepError(f"syntactic heads need sentences of a parsed text: model families "
                             f"{', '.join(syntax_families())}, not {family.name!r}")
    reader = family.attention_reader(adapter)
    texts, spans = reader.sentences()
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
        spans = reader.piece_spans(texts)
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
             "attention": attention, "sentences": len(parses), "aligned": len(sentences),
             "unaligned": len(unaligned), "unaligned_examples": [ids[i] for i in unaligned[:10]],
             "instances": counts, "relations": list(settings.relations), "margin": settings.syntactic_margin,
             "min_instances": settings.syntactic_min_instances, "directions": "either (dep2gov or gov2dep)"}
    result = SyntaxInputs(attention, sentences, facts)
    adapter._headsweep_syntax = (key, result)
    return result


def add_syntax(site: SiteAttention, syntax: SyntaxInputs, totals: SyntaxTotals) -> None:
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
