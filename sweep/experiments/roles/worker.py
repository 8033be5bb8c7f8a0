"""The ``roles`` worker step: every head's statistics and roles from its attention maps on the evaluation data.

Worker-side code of the ``roles`` kind (run in an ``EvalWorker`` through ``ctx.pool.call``): it imports only
``headsweep.workers``, and takes the ``roles`` config section (``settings.RolesSection``) as the driver read it.

The statistics are family-independent (:mod:`headsweep.workers.attention.head_roles`,
:mod:`headsweep.workers.attention.syntax`);
what is per family comes from the family (``ModelFamily.attention_reader``: an
:class:`~headsweep.workers.attention.reader.AttentionReader` that runs the adapter's evaluation batches through the
unmasked model, handing each site's maps on as its module returns them, so one layer's maps are held at a time).
Token frequencies and parses are :mod:`headsweep.workers.analyses.role_inputs`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.workers.analyses.role_inputs import add_syntax, frequency_tables, syntax_inputs
from headsweep.workers.attention.head_roles import HeadRole, RoleTotals, SiteAttention, sentence_statistics
from headsweep.workers.attention.reader import Sink
from headsweep.workers.attention.syntax import SyntaxSettings, SyntaxTotals
from headsweep.workers.core.family import ModelFamily
from headsweep.workers.core.heads import SiteKey
from headsweep.workers.families.registry import model_family

AttentionBatch = dict[SiteKey, SiteAttention]


def _family(family: str | ModelFamily) -> ModelFamily:
    return family if isinstance(family, ModelFamily) else model_family(family)


def read_attention(adapter: Any, family: str | ModelFamily, sink: Sink) -> Iterator[None]:
    """Run ``adapter``'s unmasked model on its batches, handing every site's maps to ``sink`` as its module
    returns them (as the model family ``family`` reads its adapter); yields per batch."""
    return _family(family).attention_reader(adapter).read(sink)


def attention_maps(adapter: Any, family: str | ModelFamily) -> Iterator[AttentionBatch]:
    """Each batch's maps of every site, together (holds all layers' maps of a batch: for inspection and tests)."""
    batch: AttentionBatch = {}
    for _ in read_attention(adapter, family, batch.__setitem__):
        yield dict(batch)
        batch.clear()


@dataclass
class RolesResult:
    """Every head's statistics and roles, with what they were computed on."""

    heads: list[HeadRole]
    frequencies: str
    n_sentences: int
    syntax: dict | None = None  # what runs.facts records of the parses (None: no syntax asked for)


def head_roles(adapter: Any, family: str | ModelFamily, settings: Any) -> RolesResult:
    """Statistics and roles of every head of ``adapter``'s unmasked model on its evaluation data; ``settings`` is
    the ``roles`` section (``RolesSection``)."""
    family = _family(family)
    reader = family.attention_reader(adapter)
    tables, described = frequency_tables(reader, settings.frequencies, settings.rare_top)
    syntax = syntax_inputs(adapter, family, settings)
    totals: dict[SiteKey, RoleTotals] = {}
    syntax_totals: dict[SiteKey, SyntaxTotals] = {}

    def add(key: SiteKey, site: SiteAttention) -> None:
        stats = sentence_statistics(site, tables.get(site.keys.vocab))
        totals.setdefault(key, RoleTotals(site.weights.shape[1])).add(stats)
        if syntax is not None and key[0] == syntax.attention:
            add_syntax(site, syntax, syntax_totals.setdefault(key, SyntaxTotals(site.weights.shape[1])))

    for _ in reader.read(add):
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


def roles_on_worker(worker: Any, data_cfg: Any, settings: Any) -> RolesResult:
    """Worker-side step of the ``roles`` experiment (``EvalWorker.run``) on ``data_cfg`` (None: the evaluation set)."""
    return head_roles(worker.adapter(data_cfg), worker.kind, settings)


def roles_problem_on_worker(worker: Any, data_cfg: Any, settings: Any = None) -> str | None:
    """Why roles cannot read this worker's model or align its parses (None when it can), asked before anything
    is written."""
    adapter = worker.adapter(data_cfg)
    family = model_family(worker.kind)
    try:
        if settings is not None and settings.syntax:
            syntax_inputs(adapter, family, settings)
        family.attention_reader(adapter)
    except HeadsweepError as exc:
        return str(exc)
    return None
