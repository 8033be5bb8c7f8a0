"""``efficiency``: the full model and the model with a mask's heads physically removed, timed side by side.

The mask is ``efficiency.mask`` (head names) or a stored evaluation's (``efficiency.level`` or
``efficiency.eval_id``, of this run or of ``efficiency.from_run``: ``headsweep.sweep.pruning.masks``).
The timing runs in a worker (``headsweep.workers.analyses.efficiency.efficiency_on_worker``) and lands
in the ``efficiency`` table, one row per model and batch size.

Where the mask has a stock architecture (a uniform level of a Llama-style LM: ``headsweep export`` writes it as the
model's own architecture), the model as served is timed too (``efficiency.stock``, default ``auto``): the stock
export, loaded by ``from_pretrained``, against the full model, prefill tokens/s at ``efficiency.prefill_batch_sizes``,
decode tokens/s with the KV cache at ``efficiency.decode_batch_sizes`` and the KV-cache bytes per token, beside the
speed-ups the removed FLOPs and bytes predict (``headsweep.workers.analyses.stock_serving``); one row per model,
phase and batch size in the ``serving`` table. A mask without a stock architecture writes no serving rows (and says
why in a warning where the run's own levels are ``prune.uniform``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from headsweep.errors import HeadsweepError
from headsweep.results.schema import Table
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.experiments.base import Experiment
from headsweep.sweep.output.progress import step
from headsweep.sweep.pruning.masks import efficiency_mask, explicit_mask
from headsweep.workers.core.heads import Head
from headsweep.workers.core.setting_ranges import check_ranges, ranged
from headsweep.workers.core.shared_calls import SHARED_ATTENTION, shared_refusal

if TYPE_CHECKING:
    from headsweep.sweep.run.context import Context


@dataclass
class EfficiencySection:
    """The ``efficiency`` experiment: the full and the physically pruned model, timed side by side.

    The mask is ``mask`` (head names), or the ``prune_level`` evaluation at ``level`` or the
    evaluation ``eval_id`` of run ``from_run`` (of this run when ``from_run`` is null).
    """

    mask: list[str] | None = None
    from_run: str | None = None
    level: float | None = ranged(None, at_least=0, at_most=1)
    eval_id: str | None = None
    batch_sizes: list[int] = ranged(default_factory=lambda: [1, 4, 16, 64], at_least=1)
    warmup: int = ranged(3, at_least=0)
    repeats: int = ranged(10, at_least=1)
    stock: str = "auto"
    prefill_batch_sizes: list[int] = ranged(default_factory=lambda: [1, 16], at_least=1)
    decode_batch_sizes: list[int] = ranged(default_factory=lambda: [1], at_least=1)
    prompt_tokens: int = ranged(128, at_least=1)
    # decoding speed is timed past the first new token
    new_tokens: int = ranged(32, at_least=2, why=" (decoding is timed past the first new token)")

    def check(self) -> None:
        if self.stock not in ("auto", "off"):
            raise HeadsweepError(f"efficiency.stock must be auto or off, got {self.stock!r}")
        check_ranges(self, "efficiency")
        for key in ("batch_sizes", "prefill_batch_sizes", "decode_batch_sizes"):
            if not getattr(self, key):
                raise HeadsweepError(f"efficiency.{key} is empty: list at least one batch size (e.g. [1, 16])")


# The mask a row measures (both tables start with it).
MASK_COLUMNS = [
    ("mask_source", pa.string()),
    ("source_run", pa.string()),
    ("level", pa.float64()),
    ("heads_masked", pa.list_(pa.string())),
    ("n_masked", pa.int32()),
    ("heads_removed", pa.float64()),
    ("checkpoint", pa.string()),
]

# One row per model variant (full / pruned) and batch size.
EFFICIENCY_TABLE = Table("efficiency", pa.schema([
    *MASK_COLUMNS,
    ("variant", pa.string()),
    ("batch_size", pa.int32()),
    ("device", pa.string()),
    ("n_params", pa.int64()),
    ("n_heads", pa.int32()),
    ("peak_memory_mb", pa.float64()),
    ("examples", pa.int64()),
    ("tokens", pa.int64()),
    ("warmup", pa.int32()),
    ("repeats", pa.int32()),
    ("seconds_median", pa.float64()),
    ("seconds_min", pa.float64()),
    ("seconds_max", pa.float64()),
    ("examples_per_s", pa.float64()),
    ("examples_per_s_iqr", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("tokens_per_s_iqr", pa.float64()),
    ("speedup", pa.float64()),
    ("finished_at", pa.timestamp("us", tz="UTC")),
]))


# The model as served (a stock export against the full model): one row per model variant, phase and batch size.
SERVING_TABLE = Table("serving", pa.schema([
    *MASK_COLUMNS,
    ("variant", pa.string()),  # full / stock
    ("phase", pa.string()),  # prefill / decode
    ("batch_size", pa.int32()),
    ("prompt_tokens", pa.int32()),
    ("new_tokens", pa.int32()),
    ("device", pa.string()),
    ("n_params", pa.int64()),
    ("n_heads", pa.int32()),
    ("kv_bytes_per_token", pa.int64()),
    ("tokens_per_s", pa.float64()),
    ("speedup", pa.float64()),
    ("predicted_speedup", pa.float64()),
    ("finished_at", pa.timestamp("us", tz="UTC")),
]))

logger = logging.getLogger(__name__)  # headsweep's logger: its warnings reach the terminal


class Efficiency(Experiment):
    """Speed and memory gained by removing the heads of one mask."""

    name = "efficiency"
    pruned_copy = True  # the worker that times the pruned model holds it beside the run's model
    section = "efficiency"
    settings = EfficiencySection
    table = "efficiency"
    tables = (EFFICIENCY_TABLE, SERVING_TABLE)

    def needs(self, cfg: Config) -> tuple[str, ...]:
        # A mask named by level or eval id may be one of this run's evaluations: every kind of the
        # run that evaluates masks goes first (the run lists them, so none is added).
        e = cfg.efficiency
        if e.mask is not None or e.from_run:
            return ()
        return tuple(name for name in dict.fromkeys(cfg.sweep.experiments) if name != self.name)

    def check_config(self, cfg: Config) -> None:
        e = cfg.efficiency
        named = [k for k in ("mask", "level", "eval_id") if getattr(e, k) is not None]
        if len(named) != 1:
            raise HeadsweepError(
                "experiment 'efficiency' needs exactly one of efficiency.mask (head names), efficiency.level "
                f"(a pruning level) or efficiency.eval_id (an evaluation), got {', '.join(named) or 'none'}"
            )
        if e.mask is not None:
            for name in e.mask:
                Head.parse(name)  # a misspelt name fails now; heads out of range fail once the model is loaded
        if e.mask is not None and e.from_run:
            raise HeadsweepError(
                "efficiency.from_run goes with efficiency.level or efficiency.eval_id, not with a mask"
            )
        if e.level is not None and not e.from_run and "prune_level" not in cfg.sweep.experiments:
            raise HeadsweepError("efficiency.level needs prune_level in sweep.experiments, or efficiency.from_run")

    def validate(self, ctx: Context) -> None:
        shared = ctx.info.facts.get(SHARED_ATTENTION)
        if shared:
            raise HeadsweepError(f"{shared_refusal('physical removal (experiment efficiency)', shared)}; drop "
                                 "efficiency from sweep.experiments")
        if ctx.cfg.efficiency.mask:
            explicit_mask(ctx.cfg.efficiency.mask, ctx.inventory)

    def run(self, ctx: Context) -> None:
        from headsweep.workers.analyses.efficiency import efficiency_on_worker  # torch: only when a run times models

        choice = efficiency_mask(ctx.cfg.efficiency, ctx.store, ctx.run_id, ctx.inventory, ctx.prefix, ctx.checkpoint)
        with step("efficiency timing", enabled=ctx.show_progress, detail=ctx.pool.status_line):
            timed = ctx.pool.call(efficiency_on_worker, choice.heads, ctx.cfg.efficiency)
        rows = [{**choice.columns(ctx.inventory), **row, "checkpoint": ctx.checkpoint, "finished_at": datetime.now(UTC)}
                for row in timed]
        ctx.write("efficiency", rows, name="efficiency")
        if ctx.cfg.efficiency.stock == "off":
            return
        from headsweep.workers.analyses.stock_serving import serving_on_worker

        with step("efficiency serving", enabled=ctx.show_progress, detail=ctx.pool.status_line):
            served, reason = ctx.pool.call(serving_on_worker, choice.heads, ctx.cfg.efficiency)
        if reason:
            # A warning where the run's own levels are uniform (the mask was meant to be stock); else most masks
            # have no stock architecture, and saying so every time would be noise.
            log = logger.warning if ctx.cfg.prune.uniform else logger.info
            log("efficiency: no serving timing for this mask: %s", reason)
            return
        ctx.write("serving", [{**choice.columns(ctx.inventory), **row, "checkpoint": ctx.checkpoint,
                               "finished_at": datetime.now(UTC)} for row in served], name="serving")


EFFICIENCY = Efficiency()
