"""Anytime-valid sequential tests over audits: a sampler is quarantined only when a test martingale reaches 1/alpha.

Why martingales. The auditor looks after every audit, for as long as the run lasts; a fixed-sample test repeated at
every look would quarantine an honest sampler sooner or later. A *test martingale* does not: a nonnegative process
``M_n`` with ``M_0 = 1`` and ``E[M_n | past] <= M_{n-1}`` under the null hypothesis (the sampler is honest) obeys
Ville's inequality, ``P(sup_n M_n >= 1/alpha) <= alpha``: the probability that an honest sampler is *ever*
quarantined is at most ``alpha``, however many audits it passes and however often the auditor looks. Each test here
is the average of ``K`` betting products ``prod_i (1 + b_k(X_i))`` whose bets ``b_k`` have mean at most 0 under the
null and stay above -1; an average of test martingales is one, so the mixture keeps the guarantee and loses at most
a factor ``K`` against its best product. A single observation moves a product by at most ``1 + max b``, below
``1/alpha`` for every test here: no sampler is quarantined on one token or one trajectory.

**Uniformity** (:class:`UniformityTest`): the randomised PITs of audited tokens
(:mod:`~gepo_plugin.hetero.audit.pit`) are independent U(0, 1) for an honest sampler. Bets ``lambda g(u)`` with
``g1(u) = 1 - 2u`` (tokens too likely: U piled toward 0; too unlikely: toward 1) and ``g2(u) = 1 - 4|u - 1/2|``
(U too central or too extreme), both of mean 0 under U(0, 1) and within [-1, 1], and stakes
``lambda in {+-1/4, +-1/2}``: ``K = 8`` products, each factor within [1/2, 3/2]. *Power*: against PITs of density
``f`` the product with stake ``lambda`` on bet ``g`` grows at the rate ``r = E_f[log(1 + lambda g(U))]`` per token,
and the mixture reaches ``1/alpha`` after about ``log(K / alpha) / r`` tokens (Wald's approximation for the best
product at the level ``K/alpha``, overshoot ignored: :func:`expected_delay`). Greedy decoding whose top token has
probability 1/2 gives ``U ~ U(0, 1/2)``, ``g1(U) ~ U(0, 1)``, and with ``lambda = 1/2``
``r = int_0^1 log(1 + x/2) dx = 3 log(3/2) - 1 = 0.216``: about 42 tokens at ``alpha = 1e-3``, within one audited
trajectory of a typical length. *Robustness*: a product's rate is ``r ~ lambda E_f[g] - lambda^2 E_f[g^2] / 2``
and ``E[g^2] = 1/3`` for both bets under U(0, 1), so a deviation whose mean bet ``E_f[g]`` stays below
``lambda / 6`` (1/24 for the smallest stake) makes every product shrink: small miscalibrations of the recomputed
distribution (bf16 rounding of probabilities, which moves each ``U`` by about the rounding of ``F``) are never
taken for lies, however long the run.

**Disagreement rate** (:class:`RateTest`): each audited trajectory gives ``X = 1`` when its log-probs disagree with
the recomputed ones beyond the threshold (:mod:`~gepo_plugin.hetero.audit.thresholds`), whose definition makes
``P(X = 1) <= p0`` for an honest sampler. Bets ``lambda (X - p0)`` with ``lambda = c / p0``,
``c in {0.01, 0.04, 0.16, 0.64}``: under the null ``E[1 + lambda (X - p0)] <= 1`` and every factor is at least
``1 - c > 0``. *Power*: a sampler whose every audit disagrees is quarantined after exactly the smallest ``n`` with
``mean_k (1 + c_k (1 - p0) / p0)^n >= 1/alpha`` (:func:`audits_to_quarantine_a_constant_liar`; 2 audits at
``p0 = 0.01``, ``alpha = 1e-3``); one whose audits disagree at a rate ``p1`` after about ``log(K / alpha) / r`` with
``r = max_k [p1 log(1 + lambda_k (1 - p0)) + (1 - p1) log(1 - lambda_k p0)]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: The uniformity test's bets: each maps PITs to values of mean 0 under U(0, 1), within [-1, 1].
UNIFORMITY_BETS: tuple[Callable[[np.ndarray], np.ndarray], ...] = (
    lambda u: 1.0 - 2.0 * u,
    lambda u: 1.0 - 4.0 * np.abs(u - 0.5),
)
#: The uniformity test's stakes (each bet with each stake).
UNIFORMITY_STAKES = (-0.5, -0.25, 0.25, 0.5)
#: The rate test's stakes, as fractions of ``1 / p0``.
RATE_STAKES = (0.01, 0.04, 0.16, 0.64)


@dataclass
class Mixture:
    """The average of ``K`` betting products, kept in log space (see the module docstring)."""

    alpha: float
    log_products: np.ndarray
    observations: int = 0
    #: set once the mixture reached ``1/alpha`` (a verdict is final: later observations do not undo it)
    rejected: bool = False

    @property
    def log_threshold(self) -> float:
        return math.log(1.0 / self.alpha)

    @property
    def log_e_value(self) -> float:
        """``log`` of the mixture's current value (the evidence against the sampler's honesty)."""
        top = float(self.log_products.max())
        return top + math.log(float(np.exp(self.log_products - top).mean()))

    def add(self, bets: np.ndarray) -> bool:
        """Multiply each product by ``1 + bet`` for a batch of observations (``bets``: ``(n, K)``); True once
        rejected."""
        if bets.size:
            self.log_products = self.log_products + np.log1p(bets).sum(axis=0)
            self.observations += bets.shape[0]
        self.rejected = self.rejected or self.log_e_value >= self.log_threshold
        return self.rejected

    def state(self) -> dict:
        """What a checkpoint keeps (:meth:`restore` takes it back)."""
        return {
            "alpha": self.alpha,
            "log_products": self.log_products.tolist(),
            "observations": self.observations,
            "rejected": self.rejected,
        }

    def restore(self, state: dict) -> None:
        if len(state["log_products"]) != len(self.log_products):
            raise ValueError("a saved audit test with other bets: it cannot be continued")
        self.alpha = state["alpha"]
        self.log_products = np.asarray(state["log_products"], dtype=np.float64)
        self.observations, self.rejected = state["observations"], state["rejected"]


@dataclass
class UniformityTest:
    """Are a sampler's audited tokens draws from the claimed distribution? (PITs uniform: see the module docstring)"""

    alpha: float
    mixture: Mixture = field(init=False)

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        self.mixture = Mixture(self.alpha, np.zeros(len(UNIFORMITY_BETS) * len(UNIFORMITY_STAKES)))

    def bets(self, pits: np.ndarray) -> np.ndarray:
        u = np.asarray(pits, dtype=np.float64).reshape(-1, 1)
        return np.concatenate([bet(u) * np.asarray(UNIFORMITY_STAKES) for bet in UNIFORMITY_BETS], axis=1)

    def add(self, pits: np.ndarray) -> bool:
        return self.mixture.add(self.bets(pits))


@dataclass
class RateTest:
    """Do a sampler's log-probs disagree with the recomputed ones more often than an honest sampler's may?"""

    alpha: float
    p0: float
    mixture: Mixture = field(init=False)

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        if not 0.0 < self.p0 < 1.0:
            raise ValueError(f"p0={self.p0}: the honest disagreement rate must be in (0, 1)")
        self.mixture = Mixture(self.alpha, np.zeros(len(RATE_STAKES)))

    @property
    def stakes(self) -> np.ndarray:
        return np.asarray(RATE_STAKES) / self.p0

    def add(self, disagreed: np.ndarray) -> bool:
        x = np.asarray(disagreed, dtype=np.float64).reshape(-1, 1)
        return self.mixture.add(self.stakes * (x - self.p0))


def expected_delay(growth_rate: float, products: int, alpha: float) -> float:
    """Wald's approximation of the observations a mixture of ``products`` needs to reach ``1/alpha`` when its best
    product grows at ``growth_rate`` per observation (overshoot ignored)."""
    return math.log(products / alpha) / growth_rate


def uniformity_growth_rate(pit_density: Callable[[np.ndarray], np.ndarray], points: int = 200_001) -> float:
    """The best growth rate ``max_k E_f[log(1 + b_k(U))]`` of the uniformity test's products against PITs of density
    ``f`` on [0, 1] (the midpoint rule on ``points`` points)."""
    u = (np.arange(points) + 0.5) / points
    weights = pit_density(u) / points
    bets = UniformityTest(0.5).bets(u)
    return float((np.log1p(bets) * weights[:, None]).sum(axis=0).max())


def rate_growth_rate(p1: float, p0: float) -> float:
    """The best growth rate of the rate test's products against a sampler whose audits disagree at rate ``p1``."""
    stakes = np.asarray(RATE_STAKES) / p0
    rates = p1 * np.log1p(stakes * (1 - p0)) + (1 - p1) * np.log1p(-stakes * p0)
    return float(rates.max())


def audits_to_quarantine_a_constant_liar(p0: float, alpha: float) -> int:
    """The audits after which the rate test quarantines a sampler whose every audit disagrees (exact)."""
    factors = 1.0 + np.asarray(RATE_STAKES) * (1 - p0) / p0
    n = 1
    while np.log(np.mean(factors**n)) < math.log(1 / alpha):
        n += 1
    return n


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha}: the false-positive rate must be in (0, 1)")
