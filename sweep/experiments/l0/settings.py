"""The ``l0`` config section (Voita et al. 2019 sec. 6): Hard Concrete head gates trained per penalty weight."""

from __future__ import annotations

from dataclasses import dataclass, field

from headsweep.errors import HeadsweepError
from headsweep.sweep.experiments.data_sections import DATA


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

    One definition: the config reader builds it, and each Tune trial trains with it as it is
    (``training.L0Trainer``, with the trial's lambda).
    """

    lambdas: list[float] = field(default_factory=lambda: [0.0, 0.01, 0.05, 0.1])
    data: dict | None = field(default=None, metadata={DATA: True})
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
