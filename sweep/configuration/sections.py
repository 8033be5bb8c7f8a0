"""The sections of a sweep config as dataclasses, and the whole :class:`Config`.

A config is a tree of dataclasses, read by ``headsweep.sweep.configuration.reader``. Each section checks its own
values (``check()``); checks that need several sections or the experiment kinds of the run live in
``headsweep.sweep.configuration.config`` and in the kinds (``headsweep.sweep.experiments``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.ablation import AblationSection
from headsweep.sweep.configuration.reader import settings_changed
from headsweep.workers.core.setting_ranges import PROBABILITY, SEED, check_ranges, ranged

TESTS = ("paired_bootstrap", "paired_ttest", "mcnemar_exact")
CORRECTIONS = ("bh", "holm", "bonferroni", "none")
SWEEP_ORDERS = ("planned", "importance")
BUDGETS = ("evaluations", "minutes")
# Paired-bootstrap resamples: sacrebleu's default is 1000, papers use up to 10,000; a million already takes a million
# times the examples in int32 resample counts (sweep/run/memory.py checks that against the machine's memory).
MAX_RESAMPLES = 1_000_000
# How a session runs, not what it computes: left out of the config hash, so a run resumes whatever they are
# (a budgeted run is finished by the same command, or by one without the budget).
SESSION_ONLY = {"sweep": ("budget", "order", "memory_limit_gib")}


@dataclass
class SweepSection:
    """What to evaluate and how to spread it over workers."""

    experiments: list[str] = field(default_factory=lambda: ["baseline", "single_head", "all_but_one"])
    attention: list[str] | None = None
    masks: list[list[str]] = field(default_factory=list)
    workers: int = ranged(1, at_least=1)
    num_cpus_per_worker: float = ranged(1.0, above=0)
    num_gpus_per_worker: float = ranged(0.0, at_least=0)
    device: str = "auto"
    threads_per_worker: int = ranged(0, at_least=0)  # 0: the CPUs shared out; at most the machine's CPUs
    # GiB this run's workers may take on the machine (a share of a shared box); null: what it has available. The
    # driver refuses a run whose workers cannot hold the model in it (sweep/run/memory.py)
    memory_limit_gib: float | None = ranged(None, above=0, words="a positive number of GiB")
    # examples per batch; null: 32 (translation: the token budget instead)
    batch_size: int | None = ranged(None, at_least=1)
    # translation: token budget per batch; null: 6000, or batch_size when set
    max_tokens: int | None = ranged(None, at_least=1)
    masks_per_batch: int = ranged(0, at_least=0)
    reuse: bool = True
    context_cache: bool = False  # causal LMs, multiple-choice lm-eval tasks: choices continue from the context's cache
    loss: bool = False  # translation: the teacher-forced pass that fills examples.loss (else null)
    fused_attention: bool = True  # translation: fairseq's fused/beamable attention where no gate needs it off
    flush_every: int = ranged(64, at_least=1)
    flush_seconds: float = ranged(10.0, above=0)
    max_retries: int = ranged(2, at_least=0)
    worker_restarts: int = ranged(3, at_least=0)
    placement_timeout_s: float = ranged(600.0, above=0)
    wait_for_resources: bool = False
    # What a gated-off head leaves behind (zero, mean, resample, optimal, patch); its settings: the ablation
    # section (sweep/configuration/ablation.py)
    ablation: str = "zero"
    order: str = "planned"  # or "importance": masks of the most important heads first (importance runs first)
    budget: dict | None = None  # {"evaluations": N} or {"minutes": M}: stop cleanly, run marked partial
    # {} (futility rule) or {"equivalence": E}: single-head masks screened on a subset first; its keys are checked
    # by the screening policy (sweep/run/screening.py: Screening.check_config)
    screen: dict | None = None

    def batching(self) -> dict[str, int]:
        """``RuntimeOptions``' ``batch_size`` and ``max_tokens`` for what is set; the rest keep their defaults.

        A ``batch_size`` set alone batches translation by sentences too (``max_tokens`` 0).
        """
        out: dict[str, int] = {}
        if self.batch_size is not None:
            out.update(batch_size=self.batch_size, max_tokens=0)
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out

    def check(self) -> None:
        """Worker counts, resources and devices that cannot work (``screen``: ``Screening.check_config``)."""
        check_ranges(self, "sweep")
        if self.batch_size is not None and self.max_tokens is not None:
            raise HeadsweepError(
                "sweep.batch_size and sweep.max_tokens are both set: translation batches either by sentences "
                "(batch_size) or by a token budget (max_tokens); set one"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise HeadsweepError(f"sweep.device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and self.num_gpus_per_worker == 0:
            raise HeadsweepError(
                "sweep.device=cuda needs sweep.num_gpus_per_worker > 0 "
                "(Ray shows a GPU only to actors that ask for one)"
            )
        if self.device == "cpu" and self.num_gpus_per_worker > 0:
            raise HeadsweepError(
                f"sweep.device=cpu with sweep.num_gpus_per_worker={self.num_gpus_per_worker} would hold GPUs it never "
                "uses; set sweep.num_gpus_per_worker=0"
            )
        if self.order not in SWEEP_ORDERS:
            raise HeadsweepError(f"unknown sweep.order {self.order!r} (known: {', '.join(SWEEP_ORDERS)})")
        if self.budget is not None:
            if not isinstance(self.budget, dict) or len(self.budget) != 1 or next(iter(self.budget)) not in BUDGETS:
                raise HeadsweepError(f"sweep.budget takes one of {', '.join(BUDGETS)}, e.g. sweep.budget: "
                                     f"{{evaluations: 100}}; got {self.budget!r}")
            (key, value), = self.budget.items()
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise HeadsweepError(f"sweep.budget.{key} must be a positive number, got {value!r}")
            if key == "evaluations" and value != int(value):
                raise HeadsweepError(f"sweep.budget.evaluations must be a whole number, got {value!r}")


@dataclass
class SignificanceSection:
    """Config section ``significance``."""

    enabled: bool = True
    tests: list[str] | None = None
    n_resamples: int = ranged(1000, at_least=1, at_most=MAX_RESAMPLES)
    seed: int = ranged(12345, within=SEED)
    alpha: float = ranged(0.01, within=PROBABILITY)
    correction: str = "bh"

    def check(self) -> None:
        check_ranges(self, "significance")
        if self.enabled and self.tests == []:
            raise HeadsweepError("significance.tests is empty while significance is enabled, so no evaluation would "
                                 "be tested: leave it out (the metric's own tests), name tests (e.g. "
                                 "significance.tests=[paired_bootstrap]), or set significance.enabled=false")
        for test in self.tests or []:
            if test not in TESTS:
                raise HeadsweepError(f"unknown test {test!r} in significance.tests (known: {', '.join(TESTS)})")
        if self.correction not in CORRECTIONS:
            raise HeadsweepError(
                f"unknown significance.correction {self.correction!r} (known: {', '.join(CORRECTIONS)})"
            )


@dataclass
class Config:
    """A whole sweep: the sections every run has, and (in :func:`config_class`'s subclass) one per section an
    experiment kind declares (``importance``, ``prune``, ``efficiency``, ``roles``, ``pairs``, ``l0``).

    ``model`` and ``data`` are the dataclasses of ``model.kind``.
    """

    model: Any
    data: Any
    name: str = "sweep"
    seed: int = ranged(0, within=SEED)
    sweep: SweepSection = field(default_factory=SweepSection)
    significance: SignificanceSection = field(default_factory=SignificanceSection)
    ablation: AblationSection = field(default_factory=AblationSection)
    checkpoints: list[str] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        """Identity of what is computed: the canonical JSON of the settings that differ from their defaults.

        Defaults are left out so that a later version adding a key (with a default that keeps today's
        behaviour) does not change the identity of runs already in a store: they still resume.
        """
        changed = settings_changed(self)
        for section, keys in SESSION_ONLY.items():
            for key in keys:
                changed.get(section, {}).pop(key, None)
            if changed.get(section) == {"__type__": type(getattr(self, section)).__name__}:
                del changed[section]
        canonical = json.dumps(changed, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# The sections experiment kinds declare (``Experiment.settings``), by config key, in registration order.
SECTIONS: dict[str, type] = {}
_classes: dict[tuple[tuple[str, type], ...], type[Config]] = {}


def add_section(key: str, settings: type) -> None:
    """Make ``key`` a config section read as the dataclass ``settings`` (an experiment kind's). The same class
    again is a no-op; a key of the core sections, or one another class reads already, is refused."""
    if not dataclasses.is_dataclass(settings):
        raise HeadsweepError(f"config section {key!r}: {settings!r} is not a dataclass")
    if key in CORE_KEYS or SECTIONS.get(key, settings) is not settings:
        raise HeadsweepError(f"config section {key!r} is read by another part of headsweep already")
    SECTIONS[key] = settings


def config_class(keys: Sequence[str] | None = None) -> type[Config]:
    """:class:`Config` with a field per registered section named in ``keys`` (all registered sections when None),
    in registration order, each defaulting to its dataclass's defaults."""
    wanted = tuple((key, settings) for key, settings in SECTIONS.items() if keys is None or key in keys)
    if wanted not in _classes:
        fields = [(name, settings, field(default_factory=settings)) for name, settings in wanted]
        cls = dataclasses.make_dataclass("Config", fields, bases=(Config,))
        cls.__module__, cls.__doc__ = __name__, Config.__doc__
        _classes[wanted] = cls
    return _classes[wanted]


CORE_KEYS = tuple(f.name for f in dataclasses.fields(Config))
