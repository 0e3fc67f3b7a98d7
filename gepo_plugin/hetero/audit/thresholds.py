"""How far a sampler's log-probs may be from the auditor's before an audit counts as a disagreement.

An audit compares, token by token, the log-probs a sampler sent with the ones the auditor recomputes for the same
tokens under the claimed version's weights, and flags the trajectory when the largest absolute difference exceeds
``tau``. The rate test (:mod:`~gepo_plugin.hetero.audit.sequential`) needs ``P(flag) <= p0`` for an honest sampler,
so ``tau`` must cover the honest difference, which is rounding only:

* **float32 on both sides** (:data:`FLOAT32_TAU`): float32's unit roundoff is 6e-8; a log-prob is a difference of a
  logit and a log-sum-exp, each the end of chains of dot products, whose rounding errors add up to ~1e-6 on logits
  of size ~1 (measured through verl's trainer and vLLM's CPU build in this repository: 9.5e-7 at most over 49 steps,
  ``tests/test_remote_e2e.py``). ``tau = 1e-4`` leaves two orders of magnitude of margin, and one optimiser step moves
  log-probs by ~1e-2, two orders above it: stale or perturbed weights are flagged at every audit.
* **bf16 anywhere** (:func:`calibrated_tau`): bf16 rounding depends on the model, its size and the kernels, so
  ``tau`` is calibrated on the run's own trusted rollouts (in-cluster samplers, same engine and dtype): the largest
  honest difference among ``m`` trusted trajectories. For a new honest trajectory the probability of exceeding the
  largest of ``m`` is ``1 / (m + 1)`` on average, and exceeds ``p0`` with probability ``(1 - p0)^m``; ``m`` is chosen
  so that this is at most ``1 - confidence`` (:func:`trusted_needed`: 459 at ``p0 = 0.01``, 99%), and the largest is
  then widened by ``margin`` against drift within the run. Until enough are seen, the rate test waits (the PIT test
  runs from the start: it does not depend on ``tau``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: ``tau`` with float32 on both sides (see the module docstring).
FLOAT32_TAU = 1e-4
#: The dtypes whose ``tau`` is derived, not calibrated (canonical names, :func:`canonical_dtype`).
DERIVED = {"float32": FLOAT32_TAU}
#: Other spellings of a dtype (verl's configs, vLLM's ``--dtype``, torch's names).
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def canonical_dtype(dtype: str | None) -> str:
    """One name per dtype, whoever wrote it (``torch.bfloat16``, ``bf16`` and ``bfloat16`` are one)."""
    name = str(dtype or "").removeprefix("torch.").lower()
    return ALIASES.get(name, name)


def derived_tau(dtype: str | None) -> float | None:
    """``tau`` for a sampler computing in ``dtype`` (the auditor recomputes in float32); None where it must be
    calibrated."""
    return DERIVED.get(canonical_dtype(dtype))


def trusted_needed(p0: float, confidence: float) -> int:
    """Trusted trajectories needed so that their largest difference is exceeded by an honest one with probability at
    most ``p0``, with the given confidence: the smallest ``m`` with ``(1 - p0)^m <= 1 - confidence``."""
    if not (0 < p0 < 1 and 0 < confidence < 1):
        raise ValueError(f"p0={p0}, confidence={confidence}: both must be in (0, 1)")
    return math.ceil(math.log(1 - confidence) / math.log(1 - p0))


def calibrated_tau(trusted: Sequence[float], p0: float, confidence: float, margin: float) -> float | None:
    """``margin`` times the largest of the trusted differences, once there are :func:`trusted_needed` of them."""
    if len(trusted) < trusted_needed(p0, confidence):
        return None
    return margin * max(trusted)
