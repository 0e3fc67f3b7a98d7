"""Trusted trajectories for the audit's bf16 threshold: the batch's in-cluster rollouts, handed to the auditor.

A remote sampler in bf16 differs from the auditor's float32 recomputation by bf16 rounding, which depends on the
model and the kernels: its threshold is calibrated on rollouts the learner trusts, those of the run's in-cluster
samplers (same engine, dtype ``actor_rollout_ref.rollout.dtype``), recomputed by the auditor exactly as an audit
would (:meth:`~gepo_plugin.verl_glue.hetero.remote.auditor.RemoteAuditor.calibrate`). The trainer reads the fields
below with its one TransferQueue read after the advantage step and passes each step's trusted rows until the
calibration has :func:`~gepo_plugin.hetero.audit.thresholds.trusted_needed` of them; then it reads nothing more.
Rows are single-version (a trajectory an install cut spans two versions) and of the batch's most common version
(the auditor keeps few versions), fully generated (no tool tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gepo_plugin.verl_glue.hetero.server_identity import server_of

#: The fields a calibrating trainer reads.
CALIBRATION_FIELDS = frozenset({"prompts", "responses", "rollout_log_probs", "response_mask", "extra_fields"})


@dataclass
class CalibrationFeed:
    """What the trainer still owes the calibration of ``dtype``, and the sampling settings its rollouts used."""

    dtype: str
    temperature: float
    top_k: int
    top_p: float
    #: trusted trajectories still to hand over (0: done, nothing more is read)
    remaining: int
    #: rollout server addresses that are not trusted (the remote samplers' proxies)
    untrusted_prefix: str

    def take(self, tags: list[dict], data: Any) -> list[dict[str, Any]]:
        """Up to :attr:`remaining` trusted trajectories of this batch (``tags``: the batch's TransferQueue tags;
        ``data``: the padded fields read), as the auditor reads a request and its result."""
        if self.remaining <= 0:
            return []
        lo = np.asarray([tag.get("min_global_steps", -1) for tag in tags], dtype=np.int64)
        hi = np.asarray([tag.get("max_global_steps", -2) for tag in tags], dtype=np.int64)
        padding = np.asarray([bool(tag.get("is_padding", False)) for tag in tags])
        servers = [server_of(extra) or "" for extra in data["extra_fields"]]
        trusted = np.asarray([bool(server) and not server.startswith(self.untrusted_prefix) for server in servers])
        lengths = np.asarray([int(tag.get("response_len", 0)) for tag in tags])
        mask = data["response_mask"].bool().numpy()
        generated = mask.sum(1) == np.minimum(lengths, mask.shape[1])  # every response token sampled
        rows = ~padding & trusted & (lo == hi) & (lengths > 0) & generated
        if not rows.any():
            return []
        versions, counts = np.unique(lo[rows], return_counts=True)
        version = int(versions[counts.argmax()])
        chosen = np.flatnonzero(rows & (lo == version))[: self.remaining]
        self.remaining -= len(chosen)
        prompts, responses = data["prompts"], data["responses"]
        log_probs = data["rollout_log_probs"].double()
        out = []
        for i in chosen.tolist():  # at most ``remaining`` rows, only while the calibration lasts
            prompt_len, response_len = int(tags[i]["prompt_len"]), int(lengths[i])
            out.append(
                {
                    "request_id": f"trusted-{version}-{i}",
                    "prompt_ids": prompts[i, :prompt_len].tolist(),
                    "token_ids": responses[i, :response_len].tolist(),
                    "log_probs": log_probs[i, :response_len].tolist(),
                    "version": version,
                    "temperature": self.temperature,
                    "top_k": self.top_k,
                    "top_p": self.top_p,
                }
            )
        return out
