"""``roles`` (Voita et al. 2019, secs. 4, 5.1, 5.2, 5.3): what each head attends to, written to ``head_roles``.

A worker reads every head's attention maps of the unmasked model on the evaluation set (or on
``roles.data``) and computes its confidence, entropy, offsets and rare-word share (the worker step,
``worker.roles_on_worker``; the definitions are in ``headsweep.workers.attention.head_roles``).
One row per checkpoint and head; the ``roles`` view puts each row beside the head's single-head delta,
test and importance. Where token frequencies come from is recorded in ``runs.facts["roles"]``, and with
``roles.parses`` (a CoNLL-U file) or ``roles.parser: spacy`` the parses' source, how many sentences aligned
with the model's pieces and how many did not (``runs.facts["roles"]["syntax"]``; the statistics are in
``headsweep.workers.attention.syntax``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import typed_data
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.experiments.roles.settings import RolesSection
from headsweep.sweep.experiments.roles.tables import HEAD_ROLES, ROLES_VIEW
from headsweep.sweep.output.progress import step
from headsweep.workers.families.registry import syntax_families

if TYPE_CHECKING:
    from headsweep.sweep.report_parts.page import ReportPart
    from headsweep.sweep.run.context import Context

FACT = "roles"
DICTIONARY = "dictionary"
FAIRSEQ = "fairseq_translation"


def roles_data(cfg: Config) -> Any:
    """``roles.data`` typed as the model family's data section (None: the evaluation set)."""
    if cfg.roles.data is None:
        return None
    return typed_data(cfg, cfg.roles.data, "roles.data")


def settings_fact(cfg: Config) -> dict:
    """What ``runs.facts["roles"]`` records of the config: the data, the frequency source and the thresholds."""
    r = cfg.roles
    return {"data": "roles.data" if r.data is not None else "the evaluation set",
            "frequencies": r.frequencies or (DICTIONARY if cfg.model.kind == FAIRSEQ else None),
            "offsets": list(r.offsets), "positional_threshold": r.positional_threshold, "rare_top": r.rare_top,
            "rare_threshold": r.rare_threshold, "rare_min_sentences": r.rare_min_sentences,
            "parses": r.parses, "parser": None if r.parses else r.parser}


class Roles(Experiment):
    """Head statistics and roles, once per model (a resumed run keeps the rows it stored)."""

    name = "roles"
    reads_attention = True  # head statistics and roles: no fill changes them
    section = "roles"
    settings = RolesSection
    table = "head_roles"
    tables = (HEAD_ROLES,)
    views = (ROLES_VIEW,)

    def check_config(self, cfg: Config) -> None:
        roles = cfg.roles
        roles_data(cfg)  # a misspelt key fails here, not on a worker
        frequencies = roles.frequencies
        kind = cfg.model.kind
        if frequencies == DICTIONARY:
            if kind != FAIRSEQ and ":" not in kind:
                raise HeadsweepError(f"roles.frequencies: dictionary needs a fairseq model (its dictionaries' counts); "
                                     f"for model.kind {kind} give a corpus file (one sentence a line)")
        elif frequencies is not None and not Path(frequencies).is_file():
            raise HeadsweepError(f"roles.frequencies: file not found: {frequencies} (a corpus, one sentence a line"
                                 f"{', or dictionary' if kind == FAIRSEQ else ''})")
        if roles.parses is not None and not Path(roles.parses).is_file():
            raise HeadsweepError(f"roles.parses: file not found: {roles.parses} (a CoNLL-U file, one parse per "
                                 "evaluation example)")
        syntactic = syntax_families()
        if (roles.parses or roles.parser) and kind not in syntactic and ":" not in kind:
            raise HeadsweepError(f"roles.parses / roles.parser: syntactic heads need sentences of a parsed text "
                                 f"(model.kind {' or '.join(syntactic)}), not model.kind {kind}")

    def validate(self, ctx: Context) -> None:
        from headsweep.sweep.experiments.roles.worker import roles_problem_on_worker  # torch: on the workers

        # Also reads the parses and checks them against the evaluation text: a mismatch stops the run here.
        problem = ctx.pool.call(roles_problem_on_worker, roles_data(ctx.cfg), ctx.cfg.roles)
        if problem:
            raise HeadsweepError(problem)
        # Recorded with the run (runs.facts, written after validation); the worker's step adds what it counted.
        ctx.info.facts[FACT] = settings_fact(ctx.cfg)

    def run(self, ctx: Context) -> None:
        from headsweep.sweep.experiments.roles.worker import roles_on_worker  # torch: on the workers

        if ctx.done and any(r["checkpoint"] == ctx.checkpoint for r in ctx.store.read("head_roles", ctx.run_id,
                                                                                       ).to_pylist()):
            return  # a resumed run keeps the rows it stored for this model
        with step("head roles", enabled=ctx.show_progress, detail=ctx.pool.status_line):
            result = ctx.pool.call(roles_on_worker, roles_data(ctx.cfg), ctx.cfg.roles)
        ctx.info.facts[FACT] = {**settings_fact(ctx.cfg), "frequency_source": result.frequencies,
                                "sentences": result.n_sentences}
        if result.syntax is not None:
            ctx.info.facts[FACT]["syntax"] = result.syntax
        rows = [{"checkpoint": ctx.checkpoint, "attention": h.attention, "layer": h.layer, "head": h.head,
                 "n_tokens": h.n_tokens, "confidence": h.confidence, "entropy": h.entropy, "top_offset": h.top_offset,
                 "top_offset_share": h.top_offset_share, "rare_share": h.rare_share,
                 "rare_sentences": h.rare_sentences, "rare_chance": h.rare_chance, "roles": h.roles,
                 "sink_share": h.sink_share, **h.syntax}
                for h in result.heads]
        ctx.write("head_roles", rows, name="roles")

    def report(self, part: ReportPart) -> None:
        from headsweep.sweep.experiments.roles.report import roles_part  # matplotlib and scipy: in the report only

        roles_part(part)


ROLES = Roles()
