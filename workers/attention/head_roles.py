"""What a head attends to (Voita et al. 2019, secs. 4, 5.1 and 5.3), computed on attention maps.

Everything here is a pure function of attention maps and token information; which model produced the
maps (and how they were read) is the business of the roles kind's worker step
(``headsweep.sweep.experiments.roles.worker``). The statistics follow sacrebleu's shape: each sentence gives
sufficient statistics (:func:`sentence_statistics`), a corpus value is a ratio of their sums
(:class:`RoleTotals`), so the value of any subset of sentences (a bootstrap resample, one batch) comes from the
same numbers.

Conventions (docs/experiments.md, "What the heads do", says the same for users):

* **Words.** A position is a *word* when it is a real token (not padding) and not a special symbol:
  EOS and BOS (fairseq: ``</s>``, also the decoder's first input; decoder-only: the BOS a window starts
  with), ``[CLS]``/``[SEP]`` (BERT-style; ``<s>``/``</s>`` for RoBERTa), i.e. the tokenizer's special
  ids except the unknown token, which stands for a word.
* **Counted tokens.** Queries are words only: a query is counted when it is a word and may attend to
  at least one word key (in causal attention, keys at or before it). ``n_tokens`` is their number.
* **Confidence** (sec. 4): the mean over counted tokens of the head's largest attention weight on a
  *word* key. The weights are the model's, not renormalised over words: a head that puts 0.9 on EOS
  or ``[SEP]`` and spreads the rest has low confidence, which is why the paper excludes EOS.
* **Entropy**: the mean over counted tokens of the entropy (nats) of the head's whole attention
  distribution, special keys included (what the model computes; padding has weight 0).
* **Offsets** (sec. 5.1): for each counted token, the real key (special symbols included: a head
  attending to the token before the first word attends to its ``[CLS]``) with the largest weight (ties:
  the lowest position), as ``key position - query position``, positions counted over the real tokens
  of each sequence from its first (so left padding does not shift them; for encoder-decoder attention
  the query counts from the decoder's first input, the key from the source's first token).
  ``top_offset`` is the offset most tokens point to (ties: the smaller ``|offset|``, then the
  negative), ``top_offset_share`` its share of ``n_tokens``. Role ``positional`` when one of the
  configured offsets (default -1 and +1) takes at least ``positional_threshold`` (0.9) of the tokens.
* **Rare words** (sec. 5.3): a sentence's *rarest words* are its word keys of the lowest frequency
  (ties all count). A sentence is *eligible* when that frequency is below the frequency of the
  ``rare_top``-th (500th) most frequent token type (types tied with it count as frequent), as the
  paper counts only sentences whose rarest token is outside the 500 most frequent. In an eligible
  sentence the head *points to* the real key receiving its largest mean attention from the counted
  queries (the mean over the queries that may attend to that key: all of them, or in causal attention
  those at or after it; ties: the lowest position); a *hit* when that key is a rarest word (a head
  pointing at EOS or ``[SEP]`` misses). ``rare_share`` = hits / eligible sentences; ``rare_chance`` =
  the mean over eligible sentences of (rarest words / real keys), the share a head pointing at a
  uniformly random key would reach. Role ``rare_words`` when ``rare_share >= rare_threshold`` (0.5)
  over at least ``rare_min_sentences`` (10) eligible sentences. The paper gives no threshold; its
  rare-word head points to the rarest token in 66% of eligible sentences, while chance is about
  1 / sentence length (5-10% for sentences of 10 to 20 tokens). 0.5 asks that the rarest word win in a
  majority of sentences, at least five times chance for sentences of 10 tokens or more, and still
  admits the paper's head with a margin.
* **Attention sinks** (causal sites: decoder-only models, a translation's decoder self-attention): the share of
  a head's attention that goes to the first position of the sequence (a window's BOS, or its first token where
  there is none), averaged over the counted queries after that position (the first query can only attend to
  itself). ``sink_share``; role ``attention_sink`` when it reaches ``sink_threshold`` (0.5: most of the head's
  attention). Pretrained decoder LMs' most confident heads are of this kind (Xiao et al. 2023, "Efficient
  Streaming Language Models with Attention Sinks"), so without it they would read as role-less. Null for
  bidirectional sites.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

POSITIONAL = "positional"
RARE_WORDS = "rare_words"
ATTENTION_SINK = "attention_sink"


@dataclass
class TokenSide:
    """The tokens one side of an attention map runs over (its queries or its keys).

    ``ids``, ``real`` and ``special`` are (B, T): token ids, not-padding, and special symbols (real
    tokens that are not words). ``vocab`` names the frequency table the ids index (``text``, or
    ``source`` / ``target`` for translation).
    """

    ids: torch.Tensor
    real: torch.Tensor
    special: torch.Tensor
    vocab: str = "text"
    examples: torch.Tensor | None = None  # (B,) the evaluation example of each row, where the reader knows it

    @property
    def words(self) -> torch.Tensor:
        """(B, T) bool: real tokens that are not special symbols."""
        return self.real & ~self.special

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) long: each token's index among its sequence's real tokens (padding: that of the token before)."""
        return self.real.long().cumsum(1) - 1


@dataclass
class SiteAttention:
    """One attention site's maps for one batch: ``weights`` (B, H, Q, K), each query's row summing to 1
    over the keys; ``causal``: query i may attend to keys 0..i only (both sides are then one sequence)."""

    weights: torch.Tensor
    queries: TokenSide
    keys: TokenSide
    causal: bool = False


@dataclass
class FrequencyTable:
    """Token counts by id for one vocabulary, and the count below which a token is rare.

    ``floor`` is the count of the ``top``-th most frequent type (over the whole vocabulary, unseen types
    counting 0); a token is outside the ``top`` most frequent when its count is below it. A vocabulary
    of ``top`` types or fewer has no token outside (``floor`` is then -1).
    """

    counts: np.ndarray
    top: int
    source: str
    floor: float = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.asarray(self.counts, dtype=np.float64)
        ranked = np.sort(self.counts)[::-1]
        self.floor = float(ranked[self.top - 1]) if len(ranked) > self.top else -1.0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts of ``ids`` (ids outside the table count 0) as a float64 tensor on their device."""
        table = torch.as_tensor(self.counts, dtype=torch.float64, device=ids.device)
        inside = ids.lt(len(table)) & ids.ge(0)
        return torch.where(inside, table[ids.clamp(0, max(len(table) - 1, 0))], torch.zeros((), dtype=table.dtype,
                                                                                                device=ids.device))


@dataclass
class SentenceStats:
    """Per-sentence sufficient statistics of one site (B sentences, H heads).

    ``offset_counts[b, h, i]`` counts sentence b's tokens whose maximum lies at offset ``first_offset + i``.
    The ``rare_*`` fields are None when no frequency table applies to the site's keys.
    """

    n_tokens: np.ndarray  # (B,) int
    max_sum: np.ndarray  # (B, H) float
    entropy_sum: np.ndarray  # (B, H) float
    offset_counts: np.ndarray  # (B, H, n_offsets) int
    first_offset: int
    rare_eligible: np.ndarray | None = None  # (B,) bool
    rare_hits: np.ndarray | None = None  # (B, H) bool (False where not eligible)
    rare_chance: np.ndarray | None = None  # (B,) float (0 where not eligible)
    sink_sum: np.ndarray | None = None  # (B, H) float: attention on the first position, summed over sink queries
    sink_queries: np.ndarray | None = None  # (B,) int: counted queries after the first position (causal sites)


@dataclass
class HeadRole:
    """One head's statistics and roles (a row of ``head_roles`` without run and checkpoint)."""

    attention: str
    layer: int
    head: int
    n_tokens: int
    confidence: float | None
    entropy: float | None
    top_offset: int | None
    top_offset_share: float | None
    rare_share: float | None
    rare_sentences: int | None
    rare_chance: float | None
    roles: list[str]
    syntax: dict[str, float | int | None] = field(default_factory=dict)  # headsweep.workers.attention.syntax columns
    sink_share: float | None = None  # attention on the first position (causal sites only)


def _allowed(site: SiteAttention, keys: torch.Tensor) -> torch.Tensor:
    """(B, Q, K) bool: query q may attend to key k and ``keys[b, k]`` holds."""
    keys = keys[:, None, :]
    if not site.causal:
        return keys.expand(-1, site.weights.shape[2], -1)
    q, k = site.weights.shape[2], site.weights.shape[3]
    order = torch.ones(q, k, dtype=torch.bool, device=keys.device).tril(k - q)
    return keys & order


def sentence_statistics(site: SiteAttention, frequencies: FrequencyTable | None = None) -> SentenceStats:
    """Sufficient statistics of every sentence of ``site`` (see the module docstring for the definitions)."""
    # At least float32 (bfloat16 maps lose digits); float64 maps (the tests' hand-built ones) stay float64.
    w = site.weights.to(torch.promote_types(site.weights.dtype, torch.float32))
    b, h, q, k = w.shape
    real = _allowed(site, site.keys.real)  # (B, Q, K): keys a query may attend to
    words = _allowed(site, site.keys.words)  # ... that are words
    counted = site.queries.words & words.any(-1)  # (B, Q)
    counted_h = counted[:, None, :]
    # Largest weight on a word key (confidence) and the real key of the largest weight (offsets): other keys
    # set to -1, below any probability. max() returns the first of equal maxima (the lowest position).
    top = w.masked_fill(~words[:, None], -1.0).amax(-1)  # (B, H, Q)
    where = w.masked_fill(~real[:, None], -1.0).argmax(-1)
    max_sum = (top.double() * counted_h).sum(-1)
    # Per-query entropy in the map's dtype (a sum over one row), summed over queries in float64.
    entropy = -torch.special.xlogy(w, w).sum(-1)
    entropy_sum = (entropy.double() * counted_h).sum(-1)
    key_pos = site.keys.positions.gather(1, where.reshape(b, -1)).view(b, h, q)
    offsets = key_pos - site.queries.positions[:, None, :]
    first_offset = -(q - 1)
    index = (offsets - first_offset).clamp(0, q + k - 2)
    offset_counts = torch.zeros(b, h, q + k - 1, dtype=torch.long, device=w.device)
    offset_counts.scatter_add_(2, index, counted_h.expand(-1, h, -1).long())
    stats = SentenceStats(
        n_tokens=counted.sum(-1).cpu().numpy(),
        max_sum=max_sum.cpu().numpy(),
        entropy_sum=entropy_sum.cpu().numpy(),
        offset_counts=offset_counts.cpu().numpy(),
        first_offset=first_offset,
    )
    if frequencies is not None:
        _rare_words(site, frequencies, real, counted, w, stats)
    if site.causal:
        first = site.keys.real & site.keys.positions.eq(0)  # (B, K): the sequence's first real position
        on_first = (w * first[:, None, None, :].to(w.dtype)).sum(-1)  # (B, H, Q)
        after = counted & site.queries.positions.gt(0)  # (B, Q)
        stats.sink_sum = (on_first.double() * after[:, None, :]).sum(-1).cpu().numpy()
        stats.sink_queries = after.sum(-1).cpu().numpy()
    return stats


def _rare_words(site: SiteAttention, table: FrequencyTable, real: torch.Tensor, counted: torch.Tensor,
                w: torch.Tensor, stats: SentenceStats) -> None:
    words = site.keys.words
    count = table.lookup(site.keys.ids).masked_fill(~words, float("inf"))
    lowest = count.min(-1).values  # (B,)
    rarest = words & count.eq(lowest[:, None])  # (B, K)
    seen = real & counted[:, :, None]  # (B, Q, K): counted query q may attend to real key k
    eligible = counted.any(-1) & (lowest < table.floor)
    # Mean attention each key receives from the counted queries that may attend to it.
    received = torch.einsum("bhqk,bqk->bhk", w, seen.to(w.dtype)).double()  # (B, H, K)
    viewers = seen.sum(1)  # (B, K)
    mean = (received / viewers.clamp(min=1)[:, None]).masked_fill(viewers.eq(0)[:, None], -1.0)
    pointed = mean.argmax(-1)  # (B, H): the first of equal maxima
    hits = rarest.gather(1, pointed) & eligible[:, None]
    chance = rarest.sum(-1).double() / site.keys.real.sum(-1).clamp(min=1).double()
    stats.rare_eligible = eligible.cpu().numpy()
    stats.rare_hits = hits.cpu().numpy()
    stats.rare_chance = torch.where(eligible, chance, torch.zeros_like(chance)).cpu().numpy()


@dataclass
class RoleTotals:
    """Summed sentence statistics of one site; the corpus values are ratios of these sums."""

    num_heads: int
    n_sentences: int = 0
    n_tokens: int = 0
    max_sum: np.ndarray | None = None
    entropy_sum: np.ndarray | None = None
    offsets: dict[int, np.ndarray] = field(default_factory=dict)
    rare: bool = False  # whether a frequency table applied (the rare_* sums mean something)
    rare_sentences: int = 0
    rare_hits: np.ndarray | None = None
    rare_chance_sum: float = 0.0
    sink: bool = False  # whether the site is causal (the sink sums mean something)
    sink_sum: np.ndarray | None = None
    sink_queries: int = 0

    def __post_init__(self) -> None:
        zeros = np.zeros(self.num_heads)
        self.max_sum = zeros.copy() if self.max_sum is None else self.max_sum
        self.entropy_sum = zeros.copy() if self.entropy_sum is None else self.entropy_sum
        self.rare_hits = np.zeros(self.num_heads, dtype=np.int64) if self.rare_hits is None else self.rare_hits
        self.sink_sum = np.zeros(self.num_heads) if self.sink_sum is None else self.sink_sum

    def add(self, stats: SentenceStats, rows: Sequence[int] | np.ndarray | None = None) -> RoleTotals:
        """Add the sentences ``rows`` of ``stats`` (default: all of them)."""
        pick = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
        self.n_sentences += len(stats.n_tokens[pick])
        self.n_tokens += int(stats.n_tokens[pick].sum())
        self.max_sum = self.max_sum + stats.max_sum[pick].sum(0)
        self.entropy_sum = self.entropy_sum + stats.entropy_sum[pick].sum(0)
        per_offset = stats.offset_counts[pick].sum(0)  # (H, n_offsets)
        for i in np.flatnonzero(per_offset.sum(0)):
            offset = stats.first_offset + int(i)
            self.offsets[offset] = self.offsets.get(offset, np.zeros(self.num_heads, dtype=np.int64)) + per_offset[:, i]
        if stats.rare_eligible is not None:
            self.rare = True
            self.rare_sentences += int(stats.rare_eligible[pick].sum())
            self.rare_hits = self.rare_hits + stats.rare_hits[pick].sum(0)
            self.rare_chance_sum += float(stats.rare_chance[pick].sum())
        if stats.sink_sum is not None and stats.sink_queries is not None:
            self.sink = True
            self.sink_sum = self.sink_sum + stats.sink_sum[pick].sum(0)
            self.sink_queries += int(stats.sink_queries[pick].sum())
        return self

    def heads(self, attention: str, layer: int, settings: Any) -> list[HeadRole]:
        """The corpus values and roles of each head of the site; ``settings``: the ``roles`` config section (its
        ``offsets``, ``positional_threshold``, ``rare_threshold``, ``rare_min_sentences`` and ``sink_threshold``)."""
        return [self.head(attention, layer, h, settings) for h in range(self.num_heads)]

    def head(self, attention: str, layer: int, h: int, settings: Any) -> HeadRole:
        n = self.n_tokens
        counts = {offset: int(c[h]) for offset, c in self.offsets.items() if c[h]}
        top = min(counts, key=lambda o: (-counts[o], abs(o), o)) if counts else None
        shares = {o: counts.get(o, 0) / n for o in settings.offsets} if n else {}
        rare_share = rare_chance = None
        if self.rare and self.rare_sentences:
            rare_share = float(self.rare_hits[h]) / self.rare_sentences
            rare_chance = self.rare_chance_sum / self.rare_sentences
        roles = []
        if any(s >= settings.positional_threshold for s in shares.values()):
            roles.append(POSITIONAL)
        if (rare_share is not None and rare_share >= settings.rare_threshold
                and self.rare_sentences >= settings.rare_min_sentences):
            roles.append(RARE_WORDS)
        sink_share = float(self.sink_sum[h]) / self.sink_queries if self.sink and self.sink_queries else None
        if sink_share is not None and sink_share >= getattr(settings, "sink_threshold", 0.5):
            roles.append(ATTENTION_SINK)
        return HeadRole(
            attention=attention, layer=layer, head=h, n_tokens=n,
            confidence=float(self.max_sum[h]) / n if n else None,
            entropy=float(self.entropy_sum[h]) / n if n else None,
            top_offset=top, top_offset_share=counts[top] / n if top is not None else None,
            rare_share=rare_share, rare_sentences=self.rare_sentences if self.rare else None,
            rare_chance=rare_chance, roles=roles, sink_share=sink_share,
        )
