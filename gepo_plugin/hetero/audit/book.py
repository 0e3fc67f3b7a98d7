"""Each remote sampler's audits: its two sequential tests, its counters, and the verdict that quarantines it.

A verdict is final and carries its evidence (the test, the audited trajectory and version that tipped it, the
statistic and the threshold), so the log line, the metrics and the run's saved state say the same thing, and a
resumed run keeps a quarantined sampler out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gepo_plugin.hetero.audit.examine import Examination
from gepo_plugin.hetero.audit.sequential import RateTest, UniformityTest

#: The tests, by the name a verdict gives: the log-probs disagree too often; the tokens are not draws.
LOG_PROBS, SAMPLING = "log-probs", "sampling"


@dataclass(frozen=True)
class Verdict:
    """Why a sampler was quarantined."""

    sampler: str
    test: str
    version: int
    request_id: str
    log_e_value: float
    log_threshold: float
    audits: int

    def message(self) -> str:
        what = (
            "its log-probs disagree with the claimed version's"
            if self.test == LOG_PROBS
            else ("its tokens are not draws from the claimed distribution")
        )
        return (
            f"remote sampler {self.sampler!r} quarantined: {what} (test {self.test!r}: log e-value "
            f"{self.log_e_value:.2f} >= {self.log_threshold:.2f} after {self.audits} audits; the last: request "
            f"{self.request_id}, version {self.version})"
        )


class SamplerAudits:
    """One sampler's audits (see the module docstring)."""

    def __init__(self, name: str, alpha: float, p0: float) -> None:
        self.name = name
        self.sampling = UniformityTest(alpha)
        self.log_probs = RateTest(alpha, p0)
        self.audits = 0
        self.failures = 0
        self.largest_gap = 0.0
        self.verdict: Verdict | None = None

    def record(self, seen: Examination, tau: float | None) -> Verdict | None:
        """Add one examination (``tau``: the disagreement threshold, None while it is being calibrated)."""
        if self.verdict is not None:
            return self.verdict
        self.audits += 1
        self.largest_gap = max(self.largest_gap, seen.max_gap)
        self.sampling.add(seen.pits)
        if tau is not None:
            disagreed = not seen.max_gap <= tau  # inf and nan disagree
            self.failures += int(disagreed)
            self.log_probs.add(np.asarray([float(disagreed)]))
        for test, name in ((self.log_probs, LOG_PROBS), (self.sampling, SAMPLING)):
            if test.mixture.rejected:
                self.verdict = Verdict(
                    self.name, name, seen.version, seen.request_id, test.mixture.log_e_value,
                    test.mixture.log_threshold, self.audits,
                )  # fmt: skip
                break
        return self.verdict

    def metrics(self) -> dict[str, float]:
        return {
            "audits": float(self.audits),
            "audit_failures": float(self.failures),
            "largest_gap": self.largest_gap,
            "log_e/log_probs": self.log_probs.mixture.log_e_value,
            "log_e/sampling": self.sampling.mixture.log_e_value,
            "quarantined": float(self.verdict is not None),
        }

    def state(self) -> dict:
        return {
            "audits": self.audits,
            "failures": self.failures,
            "largest_gap": self.largest_gap,
            "sampling": self.sampling.mixture.state(),
            "log_probs": self.log_probs.mixture.state(),
            "verdict": asdict(self.verdict) if self.verdict is not None else None,
        }

    def restore(self, state: dict) -> None:
        self.audits, self.failures, self.largest_gap = state["audits"], state["failures"], state["largest_gap"]
        self.sampling.mixture.restore(state["sampling"])
        self.log_probs.mixture.restore(state["log_probs"])
        self.verdict = Verdict(**state["verdict"]) if state["verdict"] is not None else None
