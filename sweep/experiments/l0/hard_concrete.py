"""Hard Concrete head gates (Louizos, Welling & Kingma 2018), as Voita et al. 2019 (sec. 6) prune heads.

Each head h has one parameter ``log_alpha_h``. A training sample of its gate is

    s = sigmoid((log u - log(1 - u) + log_alpha) / beta),   u ~ U(eps, 1 - eps)
    g = clamp(s * (zeta - gamma) + gamma, 0, 1)

with stretch limits ``gamma = -0.1``, ``zeta = 1.1``: the stretch puts probability mass on exactly 0
and exactly 1, so a head can be switched off for good while the gate stays differentiable in
``log_alpha``. ``beta`` is the temperature: **0.33 by default, the value in Voita et al.'s released
code** (lena-voita/the-story-of-heads); the paper's text says 2/3 (Louizos et al.'s value). Both are
a setting (``l0.beta``).

The relaxed L0 penalty is the expected number of open (non-zero) gates,

    sum_h P(g_h > 0) = sum_h sigmoid(log_alpha_h - beta * log(-gamma / zeta)),

and the training loss is ``task loss + lambda * penalty``.

At test time the gate is deterministic, ``clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)``
(as Louizos et al.; no temperature). A head is **closed** by one of two rules:

* ``test_gate`` (default): its test-time gate is exactly 0, i.e. ``sigmoid(log_alpha) <= -gamma / (zeta - gamma)``;
* ``larger_probability`` (Voita et al.'s binarisation): ``P(g = 0) > P(g = 1)``.

Closed forms (``L`` a standard logistic variable, ``log u - log(1-u)`` with u uniform on (0, 1)):
``P(s <= t) = sigmoid(beta * logit(t) - log_alpha)``, hence

    P(g = 0) = sigmoid(beta * log(-gamma / zeta) - log_alpha)
    P(g = 1) = sigmoid(log_alpha - beta * log((1 - gamma) / (zeta - 1)))
    P(g <= x) = sigmoid(beta * logit((x - gamma) / (zeta - gamma)) - log_alpha),  0 <= x < 1.

(With ``u`` drawn from ``U(eps, 1 - eps)`` rather than ``U(0, 1)`` these hold up to ``O(eps)``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GAMMA = -0.1
ZETA = 1.1
BETA = 0.33  # Voita et al.'s released code; the paper's text (and Louizos et al.) say 2/3
EPS = 1e-6
CLOSING_RULES = ("test_gate", "larger_probability")


@dataclass(frozen=True)
class HardConcrete:
    """The constants of a Hard Concrete gate: temperature ``beta``, stretch ``(gamma, zeta)``, noise margin ``eps``."""

    beta: float = BETA
    gamma: float = GAMMA
    zeta: float = ZETA
    eps: float = EPS

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"Hard Concrete temperature beta must be positive, got {self.beta}")
        if not (self.gamma < 0 and self.zeta > 1):
            raise ValueError(f"stretch limits must satisfy gamma < 0 < 1 < zeta, got ({self.gamma}, {self.zeta})")
        if not 0 < self.eps < 0.5:
            raise ValueError(f"eps must lie in (0, 0.5), got {self.eps}")

    # -- sampling --------------------------------------------------------------------------
    def noise(self, shape: torch.Size | tuple[int, ...], generator: torch.Generator | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """``u ~ U(eps, 1 - eps)`` of ``shape``, drawn on the CPU from ``generator`` (the same on any device)."""
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        return (self.eps + (1 - 2 * self.eps) * u).to(dtype=dtype, device=device)

    def sample_from_noise(self, log_alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gate sample for given noise ``u`` (differentiable in ``log_alpha``)."""
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / self.beta)
        return torch.clamp(s * (self.zeta - self.gamma) + self.gamma, 0.0, 1.0)

    def sample(self, log_alpha: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One training sample of every gate in ``log_alpha``."""
        u = self.noise(log_alpha.shape, generator, log_alpha.dtype, log_alpha.device)
        return self.sample_from_noise(log_alpha, u)

    def test_gate(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """The deterministic test-time gate ``clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)``."""
        return torch.clamp(torch.sigmoid(log_alpha) * (self.zeta - self.gamma) + self.gamma, 0.0, 1.0)

    # -- probabilities -----------------------------------------------------------------------
    def p_open(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """``P(g > 0)`` of each gate: the penalty's summands."""
        return torch.sigmoid(log_alpha - self.beta * math.log(-self.gamma / self.zeta))

    def penalty(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """The relaxed L0 penalty: the expected number of open gates, ``sum P(g > 0)``."""
        return self.p_open(log_alpha).sum()

    def p_closed(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """``P(g = 0)``."""
        return torch.sigmoid(self.beta * math.log(-self.gamma / self.zeta) - log_alpha)

    def p_one(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """``P(g = 1)``."""
        return torch.sigmoid(log_alpha - self.beta * math.log((1 - self.gamma) / (self.zeta - 1)))

    def cdf(self, x: torch.Tensor, log_alpha: float | torch.Tensor) -> torch.Tensor:
        """``P(g <= x)`` for a gate with ``log_alpha`` (0 below 0, 1 from 1 on; atoms at 0 and 1)."""
        x = torch.as_tensor(x, dtype=torch.float64)
        la = torch.as_tensor(log_alpha, dtype=torch.float64)
        t = ((x - self.gamma) / (self.zeta - self.gamma)).clamp(1e-300, 1 - 1e-16)
        inner = torch.sigmoid(self.beta * (torch.log(t) - torch.log1p(-t)) - la)
        return torch.where(x < 0, torch.zeros_like(inner), torch.where(x >= 1, torch.ones_like(inner), inner))

    def noise_threshold_closed(self, log_alpha: float) -> float:
        """The ``u`` below which the sample is exactly 0: ``sigmoid(beta * log(-gamma / zeta) - log_alpha)``."""
        return 1.0 / (1.0 + math.exp(-(self.beta * math.log(-self.gamma / self.zeta) - log_alpha)))

    # -- decisions ---------------------------------------------------------------------------
    def closed(self, log_alpha: torch.Tensor, rule: str = "test_gate") -> torch.Tensor:
        """Which gates are closed (boolean), by ``rule``: ``test_gate`` (the test-time gate is 0) or
        ``larger_probability`` (Voita et al.: ``P(g = 0) > P(g = 1)``)."""
        if rule == "test_gate":
            return self.test_gate(log_alpha) == 0
        if rule == "larger_probability":
            return self.p_closed(log_alpha) > self.p_one(log_alpha)
        raise ValueError(f"unknown closing rule {rule!r} (known: {', '.join(CLOSING_RULES)})")
