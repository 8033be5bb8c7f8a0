"""The ``l0`` config section (Voita et al. 2019 sec. 6): Hard Concrete head gates trained per penalty weight."""

from __future__ import annotations

from dataclasses import dataclass, field

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import DATA
from headsweep.workers.core.setting_ranges import SEED, check_ranges, ranged


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

    lambdas: list[float] = ranged(default_factory=lambda: [0.0, 0.01, 0.05, 0.1], at_least=0)
    data: dict | None = field(default=None, metadata={DATA: True})
    steps: int = ranged(500, at_least=1)
    lr: float = ranged(0.05, above=0)
    # train: all, the model's own weights (null: lr); a converged model wants less
    model_lr: float | None = ranged(None, above=0)
    train: str = "gates"
    beta: float = ranged(0.33, above=0)
    init_log_alpha: float = ranged(3.0)  # a logit: any real number
    seed: int = ranged(0, within=SEED)
    closing: str = "test_gate"
    attention: list[str] | None = None
    label_smoothing: float | None = ranged(None, at_least=0, below=1)
    checkpoint_every: int = ranged(100, at_least=0, why=" (0: at the end only)")
    allow_eval_data: bool = False

    def check(self) -> None:
        if not self.lambdas:
            raise HeadsweepError("l0.lambdas must list at least one penalty weight")
        check_ranges(self, "l0")
        if len(set(self.lambdas)) != len(self.lambdas):
            raise HeadsweepError(f"l0.lambdas lists a penalty weight twice: {self.lambdas}")
        if self.model_lr is not None and self.train != "all":
            raise HeadsweepError("l0.model_lr is the learning rate of the model's weights under l0.train: all; "
                                 "with l0.train: gates the model is frozen: remove it or set l0.train: all")
        if self.train not in ("gates", "all"):
            raise HeadsweepError(f"l0.train must be gates or all, got {self.train!r}")
        if self.closing not in ("test_gate", "larger_probability"):
            raise HeadsweepError(f"l0.closing must be test_gate or larger_probability, got {self.closing!r}")
