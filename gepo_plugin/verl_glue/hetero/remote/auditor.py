"""The learner's auditor of remote samplers: audited trajectories recomputed under the claimed version's weights.

A Ray actor on the learner's side, beside the gateway. For each audited trajectory (chosen by the proxies with the
run's audit key, :class:`~gepo_plugin.hetero.audit.selection.AuditSelection`) it pulls the claimed version from the
relay like any sampler (manifests verified with the learner's public key, every tensor digest-checked; the last
``hetero.audit.cache_versions`` versions kept), runs the model once over prompt and response in float32 (the
log-probs verl's trainer computes, by teacher forcing), and hands the examination
(:func:`~gepo_plugin.hetero.audit.examine.examine`) to the sampler's book
(:class:`~gepo_plugin.hetero.audit.book.SamplerAudits`), whose sequential tests give the verdict.

For a sampler in a dtype whose threshold is not derived (bf16), the learner's trainer hands it trusted trajectories
of the in-cluster samplers (same run, dtype ``actor_rollout_ref.rollout.dtype``) to recompute the same way
(:meth:`RemoteAuditor.calibrate`); their largest gaps calibrate the threshold
(:func:`~gepo_plugin.hetero.audit.thresholds.calibrated_tau`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gepo_plugin.hetero.audit.book import SamplerAudits
from gepo_plugin.hetero.audit.examine import Examination, examine
from gepo_plugin.hetero.audit.selection import AuditSelection
from gepo_plugin.hetero.audit.settings import HOLD, AuditConfig
from gepo_plugin.hetero.audit.thresholds import calibrated_tau, canonical_dtype, derived_tau, trusted_needed
from gepo_sampler.relay.puller import Held, RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.signing import Verifier
from gepo_sampler.relay.store import open_store

logger = logging.getLogger(__name__)

#: The calibration's entry in the auditor's state (no sampler's name: the names' rule has no brackets).
TRUSTED = "[calibration]"


class VersionCache:
    """The last ``capacity`` versions the auditor recomputed with, pulled from the relay on first use."""

    def __init__(self, puller: RelayPuller, capacity: int) -> None:
        self.puller, self.capacity = puller, capacity
        self._held: OrderedDict[int, Held] = OrderedDict()
        self.pulls = 0

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._held:
            self.puller.refresh()
            start = max((v for v in self._held if v < version), default=None)  # a delta chain from below if cached
            result = self.puller.pull(self._held[start] if start is not None else None, target=version)
            self._held[version] = result.held if result is not None else self._held[start]
            self.pulls += 1
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)
        self._held.move_to_end(version)
        return self._held[version].weights.to_tensors()


class Recomputer:
    """The policy's model in float32, one version's weights loaded at a time (on the GPU where the process has one:
    ``hetero.audit.num_gpus``)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=True)
        self.model.to(self.device).eval()
        self.loaded: int | None = None

    def logits(self, version: int, weights: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]):
        """The logits at each response position (``(len(tokens), vocab)``), teacher-forced."""
        if self.loaded != version:
            self.model.load_state_dict(weights, strict=False)
            self.loaded = version
        ids = torch.tensor([prompt + tokens], device=self.device)
        with torch.no_grad():
            return self.model(ids).logits[0, len(prompt) - 1 : -1].double().cpu()


class RemoteAuditor:
    """The audits of every remote sampler (see the module docstring)."""

    def __init__(
        self,
        config: AuditConfig,
        relay: RelayConfig,
        model_path: str,
        secret: bytes,
        tau: float | None,
        samplers: list[str],
    ) -> None:
        torch.set_num_threads(1)  # one core of the learner's node: the audit is a small share of the work
        self.config = config
        self.selection = AuditSelection(config.fraction, secret)
        puller = RelayPuller(open_store(relay), relay.run_id, verifier=Verifier(relay.public_key))
        self.versions = VersionCache(puller, config.cache_versions)
        self.recomputer = Recomputer(model_path)
        self.tau = tau
        self.books = {name: SamplerAudits(name, config.alpha, config.p0) for name in samplers}
        #: dtype -> the largest gap of each trusted (in-cluster) trajectory recomputed for calibration
        self.trusted: dict[str, list[float]] = {}
        self.seconds = 0.0

    def tau_for(self, dtype: str | None) -> float | None:
        """The disagreement threshold for a sampler computing in ``dtype``: ``hetero.audit.tau`` if set, else derived
        from the dtype (float32), else calibrated on trusted trajectories of that dtype, else None (not known yet:
        the rate test waits, the PIT test runs)."""
        if self.tau is not None:
            return self.tau
        derived = derived_tau(dtype)
        if derived is not None:
            return derived
        config = self.config
        trusted = self.trusted.get(canonical_dtype(dtype), [])
        return calibrated_tau(trusted, config.p0, config.calibration_confidence, config.calibration_margin)

    def calibrating(self, dtype: str | None) -> int:
        """How many more trusted trajectories of ``dtype`` the calibration needs (0: none, or derived)."""
        if self.tau is not None or derived_tau(dtype) is not None:
            return 0
        needed = trusted_needed(self.config.p0, self.config.calibration_confidence)
        return max(0, needed - len(self.trusted.get(canonical_dtype(dtype), [])))

    def calibrate(self, dtype: str, trajectories: list[dict[str, Any]]) -> int:
        """Recompute trusted trajectories (an in-cluster sampler's, computing in ``dtype``; each a request's
        ``prompt_ids`` and sampling settings with a result's ``token_ids``, ``log_probs`` and ``version``) as an audit
        would, and keep their largest gaps; returns how many more are needed."""
        kept = self.trusted.setdefault(canonical_dtype(dtype), [])
        for trajectory in trajectories[: self.calibrating(dtype)]:
            started = time.perf_counter()
            kept.append(self._examine("calibration", trajectory, trajectory).max_gap)
            self.seconds += time.perf_counter() - started
        return self.calibrating(dtype)

    def _examine(self, sampler: str, request: dict[str, Any], result: dict[str, Any]) -> Examination:
        tokens, version = list(result["token_ids"]), int(result["version"])
        logits = self.recomputer.logits(version, self.versions.weights(version), list(request["prompt_ids"]), tokens)
        return examine(
            result["request_id"],
            version,
            logits,
            torch.tensor(tokens),
            torch.tensor(result["log_probs"], dtype=torch.float64),
            self.selection.uniforms(sampler, result["request_id"], len(tokens)),
            float(request["temperature"]),
            int(request["top_k"]),
            float(request["top_p"]),
        )

    async def audit(
        self, sampler: str, request: dict[str, Any], result: dict[str, Any], dtype: str | None = None
    ) -> dict[str, Any]:
        """Examine one audited trajectory (``dtype``: what the sampler reports its engine computes in):
        ``{"disagreed": its log-probs exceeded the threshold, "verdict": the sampler's verdict (a dict) once it is
        quarantined, else None}``."""
        book = self.books[sampler]
        if book.verdict is not None:
            return {"disagreed": False, "verdict": book.verdict.__dict__}
        if not result["token_ids"] or result.get("log_probs") is None:  # nothing to recompute against
            return {"disagreed": False, "verdict": None}
        started = time.perf_counter()
        seen = self._examine(sampler, request, result)
        tau = self.tau_for(dtype)
        verdict = book.record(seen, tau)
        self.seconds += time.perf_counter() - started
        if verdict is not None:
            logger.error("hetero: %s", verdict.message())
        disagreed = tau is not None and not seen.max_gap <= tau
        return {"disagreed": disagreed, "verdict": verdict.__dict__ if verdict is not None else None}

    def report(self) -> dict[str, Any]:
        return {
            "samplers": {name: book.metrics() for name, book in self.books.items()},
            "seconds": self.seconds,
            "version_pulls": self.versions.pulls,
            "calibration": {
                dtype: {"trusted": float(len(gaps)), "tau": self.tau_for(dtype)} for dtype, gaps in self.trusted.items()
            },
        }

    def state(self) -> dict[str, Any]:
        """The books by sampler, and the calibration's trusted gaps under ``TRUSTED`` (a resumed run keeps both)."""
        return {**{name: book.state() for name, book in self.books.items()}, TRUSTED: self.trusted}

    def restore(self, state: dict[str, Any]) -> None:
        self.trusted = {dtype: list(gaps) for dtype, gaps in state.get(TRUSTED, {}).items()}
        for name, saved in state.items():
            if name in self.books:
                self.books[name].restore(saved)


class SamplerQuarantined(RuntimeError):
    """The remote sampler was quarantined by the audit: nothing more of it is trained."""


class AuditFailed(RuntimeError):
    """This result's log-probs disagreed with the recomputed ones (``hold``: it is not trained)."""


@dataclass
class AuditClient:
    """A proxy's side of the audit: which of its results are audited, and what happens to them meanwhile.

    ``hold`` (the default): an audited result reaches verl only once its audit passed: one whose log-probs disagree
    is refused (``refused/audit_failed``) even before the sampler's verdict, and one that tips a verdict fails, so
    nothing of an audit that failed is trained; ``flag``: it reaches verl at once and is audited afterwards.
    """

    sampler: str
    selection: AuditSelection
    auditor: Any  # the RemoteAuditor actor's handle
    mode: str = HOLD
    #: the verdict's message once the sampler is quarantined
    quarantined: str | None = None
    counters: dict[str, float] = field(
        default_factory=lambda: {"audited": 0.0, "audit_errors": 0.0, "audit_failed": 0.0, "cut_by_quarantine": 0.0}
    )
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def review(
        self,
        request: dict,
        result: dict,
        release: Callable[[], None],
        refuse: Callable[[BaseException], None],
        dtype: str | None = None,
    ) -> bool:
        """Start the audit of ``result`` if it is selected; True when the audit now decides when it is released
        (``hold``), False when the caller releases it at once."""
        if not self.selection.audited(self.sampler, result["request_id"]) or not result["token_ids"]:
            return False
        self.counters["audited"] += 1
        hold = self.mode == HOLD
        task = asyncio.ensure_future(
            self._audit(request, result, dtype, release if hold else None, refuse if hold else None)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return hold

    async def _audit(self, request, result, dtype, release, refuse) -> None:
        try:
            outcome = await self._ask(request, result, dtype)
        except Exception as error:  # the auditor failed: counted and logged; the trajectory is not held for ever
            self.counters["audit_errors"] += 1
            logger.error("hetero: auditing remote sampler %r failed: %r; its result is released", self.sampler, error)
            outcome = {"disagreed": False, "verdict": None}
        verdict = outcome["verdict"]
        if verdict is not None and self.quarantined is None:
            self.quarantined = f"remote sampler {self.sampler!r} quarantined: test {verdict['test']!r}"
        if self.quarantined is not None:
            if refuse is not None:
                self.cut()
                refuse(SamplerQuarantined(self.quarantined))
        elif outcome["disagreed"]:
            self.counters["audit_failed"] += 1
            if refuse is not None:
                refuse(AuditFailed(f"remote sampler {self.sampler!r}: request {result['request_id']} failed its audit"))
            elif release is not None:
                release()
        elif release is not None:
            release()

    def cut(self) -> None:
        """A request of this sampler fails because it is quarantined (in flight at the verdict, or answered after
        it): never trained. verl marks its group ``failure`` without saying why, so it is counted here."""
        self.counters["cut_by_quarantine"] += 1

    def _ask(self, request: dict, result: dict, dtype: str | None) -> Awaitable[dict[str, Any]]:
        return self.auditor.audit.remote(self.sampler, request, result, dtype)
