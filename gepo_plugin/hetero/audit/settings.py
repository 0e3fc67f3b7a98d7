"""The audit's options (``hetero.audit.*``): one typed model, its defaults written once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt

from gepo_plugin.options import STRICT_BLOCK

#: Audited trajectories are held until their verdict, or trained and flagged afterwards.
HOLD, FLAG = "hold", "flag"


class AuditConfig(BaseModel):
    """``hetero.audit.*``: auditing what remote samplers send (off by default)."""

    model_config = STRICT_BLOCK

    enable: StrictBool = Field(
        False,
        description="true: recompute a share of every remote sampler's trajectories under the claimed version and "
        "quarantine a sampler whose log-probs or sampling a sequential test rejects",
    )
    fraction: float = Field(
        0.1,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="the share of each remote sampler's trajectories audited (chosen with a key the samplers never "
        "see)",
    )
    alpha: float = Field(
        1e-3,
        gt=0,
        lt=0.5,
        allow_inf_nan=False,
        description="the probability that an honest sampler is ever quarantined, over the whole run (each test)",
    )
    p0: float = Field(
        0.01,
        gt=0,
        lt=0.5,
        allow_inf_nan=False,
        description="the share of an honest sampler's audits whose log-probs may exceed the threshold",
    )
    tau: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="the largest |claimed - recomputed| log-prob of an honest audit; null = from the dtype each "
        "sampler reports (float32: 1e-4) or, in bf16, calibrated",
    )
    mode: Literal["hold", "flag"] = Field(
        HOLD,
        description="hold: an audited trajectory reaches training only after its audit passed (a liar's evidence "
        "is never trained; its group waits one forward pass); flag: it is trained at once and audited afterwards",
    )
    cache_versions: StrictInt = Field(
        2, ge=1, description="weight versions the auditor keeps in memory (a version claimed again is not pulled again)"
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="GPUs the auditor's Ray actor asks for (it recomputes on the GPU when it has one; 0 = one CPU "
        "thread on the learner's node, enough for small models)",
    )
    calibration_confidence: float = Field(
        0.99,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="bf16: the confidence that the calibrated threshold is exceeded by an honest audit at most at "
        "rate p0",
    )
    calibration_margin: float = Field(
        2.0,
        ge=1,
        allow_inf_nan=False,
        description="bf16: the calibrated threshold is this times the largest trusted gap",
    )
