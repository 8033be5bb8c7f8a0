"""The sections of a sweep config as dataclasses, and the whole :class:`Config`.

A config is a tree of dataclasses, read by ``headsweep.sweep.configuration.reader``. Each section checks its own
values (``check()``); checks that need several sections or the experiment kinds of the run live in
``headsweep.sweep.configuration.config`` and in the kinds (``headsweep.sweep.experiments``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.reader import settings_changed

IMPORTANCE_METHODS = ("gradient", "ablation", "lrp")
DEFAULT_LEVELS = [round(0.1 * i, 1) for i in range(11)]
TESTS = ("paired_bootstrap", "paired_ttest", "mcnemar_exact")
CORRECTIONS = ("bh", "holm", "bonferroni", "none")
SWEEP_ORDERS = ("planned", "importance")
BUDGETS = ("evaluations", "minutes")
# How a session runs, not what it computes: left out of the config hash, so a run resumes whatever they are
# (a budgeted run is finished by the same command, or by one without the budget).
SESSION_ONLY = {"sweep": ("budget", "order")}


@dataclass
class SweepSection:
    """What to evaluate and how to spread it over workers."""

    experiments: list[str] = field(default_factory=lambda: ["baseline", "single_head", "all_but_one"])
    attention: list[str] | None = None
    masks: list[list[str]] = field(default_factory=list)
    workers: int = 1
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    device: str = "auto"
    threads_per_worker: int = 0
    batch_size: int | None = None  # examples per batch; null: 32 (translation: the token budget instead)
    max_tokens: int | None = None  # translation: token budget per batch; null: 6000, or batch_size when set
    masks_per_batch: int = 0
    reuse: bool = True
    loss: bool = False  # translation: the teacher-forced pass that fills examples.loss (else null)
    fused_attention: bool = True  # translation: fairseq's fused/beamable attention where no gate needs it off
    flush_every: int = 64
    flush_seconds: float = 10.0
    max_retries: int = 2
    worker_restarts: int = 3
    placement_timeout_s: float = 600.0
    wait_for_resources: bool = False
    order: str = "planned"  # or "importance": masks of the most important heads first (importance runs first)
    budget: dict | None = None  # {"evaluations": N} or {"minutes": M}: stop cleanly, run marked partial
    # {} (futility rule) or {"equivalence": E}: single-head masks screened on a subset first (sweep/run/screening.py)
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
        """Worker counts, resources and devices that cannot work."""
        if self.workers < 1:
            raise HeadsweepError(f"sweep.workers must be at least 1, got {self.workers}")
        if self.batch_size is not None and self.batch_size < 1:
            raise HeadsweepError(f"sweep.batch_size must be at least 1, got {self.batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise HeadsweepError(f"sweep.max_tokens must be at least 1, got {self.max_tokens}")
        if self.batch_size is not None and self.max_tokens is not None:
            raise HeadsweepError(
                "sweep.batch_size and sweep.max_tokens are both set: translation batches either by sentences "
                "(batch_size) or by a token budget (max_tokens); set one"
            )
        if self.num_cpus_per_worker <= 0:
            raise HeadsweepError(f"sweep.num_cpus_per_worker must be positive, got {self.num_cpus_per_worker}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise HeadsweepError(f"sweep.device must be auto, cpu or cuda, got {self.device!r}")
        if self.num_gpus_per_worker < 0:
            raise HeadsweepError(f"sweep.num_gpus_per_worker must not be negative, got {self.num_gpus_per_worker}")
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
        if self.max_retries < 0 or self.worker_restarts < 0:
            raise HeadsweepError("sweep.max_retries and sweep.worker_restarts must not be negative")
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
        from headsweep.sweep.run.screening import check_screen  # numpy and the tests: only when the section is checked

        check_screen(self.screen)


@dataclass
class SignificanceSection:
    """Config section ``significance``."""

    enabled: bool = True
    tests: list[str] | None = None
    n_resamples: int = 1000
    seed: int = 12345
    alpha: float = 0.01
    correction: str = "bh"

    def check(self) -> None:
        for test in self.tests or []:
            if test not in TESTS:
                raise HeadsweepError(f"unknown test {test!r} in significance.tests (known: {', '.join(TESTS)})")
        if self.correction not in CORRECTIONS:
            raise HeadsweepError(
                f"unknown significance.correction {self.correction!r} (known: {', '.join(CORRECTIONS)})"
            )
        if not 0 < self.alpha < 1:
            raise HeadsweepError(f"significance.alpha must be in (0, 1), got {self.alpha}")
        if self.n_resamples < 1:
            raise HeadsweepError(f"significance.n_resamples must be at least 1, got {self.n_resamples}")


@dataclass
class ImportanceSection:
    """Head importance (Michel et al. sec. 4.1): how it is estimated, and on which data.

    ``data`` has the same keys as the top-level ``data`` section of the model kind and must
    not be the evaluation set: importance estimated on the data it is judged on flatters it.
    """

    method: str = "gradient"
    data: dict | None = None
    per_token: bool = True
    normalize: bool = True
    allow_eval_data: bool = False
    from_run: str | None = None

    def check(self) -> None:
        if self.method not in IMPORTANCE_METHODS:
            raise HeadsweepError(
                f"unknown importance.method {self.method!r} (known: {', '.join(IMPORTANCE_METHODS)})"
            )


@dataclass
class PruneSection:
    """Pruning levels (Michel et al. sec. 4.2): mask the ceil(p * N) least important heads."""

    levels: list[float] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    attention: list[str] | None = None
    min_heads_per_layer: int = 0
    reestimate: bool = False

    def check(self) -> None:
        for p in self.levels:
            if not 0.0 <= p <= 1.0:
                raise HeadsweepError(f"prune.levels must lie in [0, 1], got {p}")
        if self.min_heads_per_layer < 0:
            raise HeadsweepError(f"prune.min_heads_per_layer must be >= 0, got {self.min_heads_per_layer}")


@dataclass
class EfficiencySection:
    """The ``efficiency`` experiment: the full and the physically pruned model, timed side by side.

    The mask is ``mask`` (head names), or the ``prune_level`` evaluation at ``level`` or the
    evaluation ``eval_id`` of run ``from_run`` (of this run when ``from_run`` is null).
    """

    mask: list[str] | None = None
    from_run: str | None = None
    level: float | None = None
    eval_id: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    warmup: int = 3
    repeats: int = 10

    def check(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise HeadsweepError(f"efficiency.batch_sizes must be positive integers, got {self.batch_sizes}")
        if self.warmup < 0 or self.repeats < 1:
            raise HeadsweepError(
                f"efficiency needs warmup >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}"
            )


@dataclass
class RolesSection:
    """The ``roles`` experiment (Voita et al. 2019): what each head attends to (``headsweep.workers.head_roles``).

    ``data`` has the keys of the model kind's ``data`` section (default: the evaluation set).
    ``frequencies``: ``dictionary`` (a fairseq model's dictionary counts, the default for fairseq), a
    corpus file (one sentence a line), or null (other families: no rare-word statistics).
    ``parses``: a CoNLL-U file, one parse per evaluation example (syntactic heads); else ``parser: spacy``
    parses with the installed pipeline ``spacy_model``. ``relations`` give ``syntactic:<relation>`` roles when
    a head's accuracy beats the most-frequent-offset baseline by ``syntactic_margin`` over at least
    ``syntactic_min_instances`` instances.
    """

    data: dict | None = None
    frequencies: str | None = None
    offsets: list[int] = field(default_factory=lambda: [-1, 1])
    positional_threshold: float = 0.9
    rare_top: int = 500
    rare_threshold: float = 0.5
    rare_min_sentences: int = 10
    # Syntactic heads (headsweep.workers.syntax): a CoNLL-U file aligned with the evaluation text, or parser: spacy.
    parses: str | None = None
    parser: str | None = None
    spacy_model: str = "en_core_web_sm"
    relations: list[str] = field(default_factory=lambda: ["nsubj", "obj", "amod", "advmod"])
    syntactic_margin: float = 0.1
    syntactic_min_instances: int = 10

    def check(self) -> None:
        from headsweep.workers.syntax import ALIASES, RELATIONS

        if self.parser not in (None, "spacy"):
            raise HeadsweepError(f"roles.parser must be spacy (or unset), got {self.parser!r}")
        unknown = [r for r in self.relations if ALIASES.get(r, r) not in RELATIONS]
        if unknown or not self.relations:
            raise HeadsweepError(f"roles.relations: unknown relation {unknown[0] if unknown else '(none given)'!r}"
                                 f" (known: {', '.join(RELATIONS)}; dobj counts as obj)")
        self.relations = list(dict.fromkeys(ALIASES.get(r, r) for r in self.relations))
        if not 0 < self.syntactic_margin <= 1:
            raise HeadsweepError(f"roles.syntactic_margin must be a share in (0, 1], got {self.syntactic_margin}")
        if self.syntactic_min_instances < 1:
            raise HeadsweepError(f"roles.syntactic_min_instances must be at least 1, got "
                                 f"{self.syntactic_min_instances}")
        if not self.offsets:
            raise HeadsweepError("roles.offsets must name at least one relative offset (e.g. [-1, 1])")
        if 0 in self.offsets or len(set(self.offsets)) != len(self.offsets):
            raise HeadsweepError(f"roles.offsets must be distinct non-zero relative offsets (e.g. [-1, 1]: the "
                                 f"previous and the next token), got {self.offsets}")
        for key in ("positional_threshold", "rare_threshold"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise HeadsweepError(f"roles.{key} must be a share in (0, 1], got {value}")
        if self.rare_top < 1:
            raise HeadsweepError(f"roles.rare_top must be at least 1, got {self.rare_top}")
        if self.rare_min_sentences < 1:
            raise HeadsweepError(f"roles.rare_min_sentences must be at least 1, got {self.rare_min_sentences}")


PAIR_SELECTS = ("all", "importance", "single_head", "list")
PAIR_SCOPES = ("all", "layer")


@dataclass
class PairsSection:
    """The ``pairs`` experiment: pairwise head interactions (``headsweep.sweep.experiments.pairs``).

    ``select`` picks the heads: ``all`` (every head of ``sweep.attention``), the ``top_k`` heads ranked
    by ``importance`` (the run's importance scores) or by ``single_head`` |delta| (of this run, or of
    ``from_run``), or ``list`` (``heads``, head names). ``scope``: ``all`` pairs among them, or only
    pairs within one ``layer``. More than ``max_pairs`` pairs is refused before anything runs.
    """

    select: str = "all"
    top_k: int = 10
    scope: str = "all"
    heads: list[str] | None = None
    from_run: str | None = None
    max_pairs: int = 500

    def check(self) -> None:
        if self.select not in PAIR_SELECTS:
            raise HeadsweepError(f"unknown pairs.select {self.select!r} (known: {', '.join(PAIR_SELECTS)})")
        if self.scope not in PAIR_SCOPES:
            raise HeadsweepError(f"unknown pairs.scope {self.scope!r} (known: {', '.join(PAIR_SCOPES)})")
        if self.top_k < 2:
            raise HeadsweepError(f"pairs.top_k must be at least 2 (a pair needs two heads), got {self.top_k}")
        if self.max_pairs < 1:
            raise HeadsweepError(f"pairs.max_pairs must be at least 1, got {self.max_pairs}")
        if self.select == "list" and len(set(self.heads or [])) < 2:
            raise HeadsweepError("pairs.select list needs pairs.heads: at least two head names (attention:layer:head)")
        if self.select != "list" and self.heads:
            raise HeadsweepError(f"pairs.heads is read with pairs.select list, not {self.select}")
        if self.from_run and self.select not in ("importance", "single_head"):
            raise HeadsweepError(f"pairs.from_run ranks heads for pairs.select importance or single_head, "
                                 f"not {self.select}")


@dataclass
class L0Section:
    """The ``l0`` experiment (Voita et al. 2019 sec. 6): Hard Concrete head gates trained per penalty weight.

    One Ray Tune trial per ``lambdas`` entry trains the gates (``train: gates``, model frozen; or ``all``)
    for ``steps`` Adam updates at ``lr`` on ``data`` (keys of the model kind's ``data`` section; training
    data, never the evaluation set or a test split), starting from the converged model with every
    ``log_alpha`` at ``init_log_alpha``. ``beta`` is the temperature (0.33 as Voita et al.'s code; the paper
    says 2/3). ``closing``: ``test_gate`` (closed when the test-time gate is 0) or ``larger_probability``
    (Voita: P(g=0) > P(g=1)). ``attention``: the attention types that get gates (null: all).
    ``label_smoothing`` (translation) null: the value the checkpoint was trained with (else fairseq's 0.1).
    """

    lambdas: list[float] = field(default_factory=lambda: [0.0, 0.01, 0.05, 0.1])
    data: dict | None = None
    steps: int = 500
    lr: float = 0.05
    model_lr: float | None = None  # train: all, the model's own weights (null: lr); a converged model wants less
    train: str = "gates"
    beta: float = 0.33
    init_log_alpha: float = 3.0
    seed: int = 0
    closing: str = "test_gate"
    attention: list[str] | None = None
    label_smoothing: float | None = None
    checkpoint_every: int = 100
    allow_eval_data: bool = False

    def check(self) -> None:
        if not self.lambdas:
            raise HeadsweepError("l0.lambdas must list at least one penalty weight")
        for lam in self.lambdas:
            if not lam >= 0:
                raise HeadsweepError(f"l0.lambdas: a penalty weight must be >= 0, got lambda={lam}")
        if len(set(self.lambdas)) != len(self.lambdas):
            raise HeadsweepError(f"l0.lambdas lists a penalty weight twice: {self.lambdas}")
        if self.steps < 1:
            raise HeadsweepError(f"l0.steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise HeadsweepError(f"l0.lr must be positive, got {self.lr}")
        if self.model_lr is not None and not self.model_lr > 0:
            raise HeadsweepError(f"l0.model_lr must be positive, got {self.model_lr}")
        if self.model_lr is not None and self.train != "all":
            raise HeadsweepError("l0.model_lr is the learning rate of the model's weights under l0.train: all; "
                                 "with l0.train: gates the model is frozen: remove it or set l0.train: all")
        if self.train not in ("gates", "all"):
            raise HeadsweepError(f"l0.train must be gates or all, got {self.train!r}")
        if not self.beta > 0:
            raise HeadsweepError(f"l0.beta must be positive, got {self.beta}")
        if self.closing not in ("test_gate", "larger_probability"):
            raise HeadsweepError(f"l0.closing must be test_gate or larger_probability, got {self.closing!r}")
        if self.checkpoint_every < 0:
            raise HeadsweepError(f"l0.checkpoint_every must be >= 0 (0: at the end only), got {self.checkpoint_every}")


@dataclass
class Config:
    """A whole sweep. ``model`` and ``data`` are the dataclasses of ``model.kind``."""

    model: Any
    data: Any
    name: str = "sweep"
    seed: int = 0
    sweep: SweepSection = field(default_factory=SweepSection)
    significance: SignificanceSection = field(default_factory=SignificanceSection)
    importance: ImportanceSection = field(default_factory=ImportanceSection)
    prune: PruneSection = field(default_factory=PruneSection)
    efficiency: EfficiencySection = field(default_factory=EfficiencySection)
    roles: RolesSection = field(default_factory=RolesSection)
    pairs: PairsSection = field(default_factory=PairsSection)
    l0: L0Section = field(default_factory=L0Section)
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
