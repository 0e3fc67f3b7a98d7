"""Per-response terms computed by the trainer (or before verl's update) and handed to a registered policy loss.

Why this exists: verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) keeps only five fields of the
micro-batch before it calls a registered policy loss, and verl repartitions responses across ranks and
micro-batches. A per-prompt statistic such as GEPO's group expectation therefore has to be computed in the
trainer (where ``uid`` groups are whole), stored per response in the batch, and passed to the loss *beside*
verl's call.

:func:`ppo_loss_with_response_terms` is installed on the actor workers with verl's public ``set_loss_fn``. It
takes the per-response fields out of the micro-batch, exposes them through a context variable for the duration
of the call, and then runs verl's own ``ppo_loss`` unchanged (entropy, KL loss and metric aggregation stay
verl's).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from gepo_plugin.hetero.lag_buckets import BY_LAG_SEGMENTS
from gepo_plugin.maths.gepo_metrics import STEP_TOTALS
from gepo_plugin.verl_glue import seam

#: Field with ``log E_hat_q[q]`` of each response's prompt group (GEPO's denominator).
LOG_GROUP_EXPECTATION = "gepo_log_group_expectation"

#: Field with each response's staleness (learner version - oldest weight version of its group), HeteroRL only.
RESPONSE_LAG = "gepo_response_lag"
#: M2PO's cap over the mini-batch (``m2_scope=mini_batch``), the same in every row of it: tau (-1: none), the harmful
#: tokens' second moment before and after capping, and their count
#: (:mod:`gepo_plugin.verl_glue.m2po_mini_batch` writes them before verl splits the mini-batch).
M2PO_CAP_FIELDS: tuple[str, ...] = ("m2po_log_ratio_cap", "m2po_m2", "m2po_m2_after", "m2po_harmful_tokens")
#: All per-response fields the loss wrapper forwards.
RESPONSE_TERM_FIELDS: tuple[str, ...] = (LOG_GROUP_EXPECTATION, RESPONSE_LAG, *M2PO_CAP_FIELDS)

_CURRENT_TERMS: ContextVar[Mapping[str, torch.Tensor] | None] = ContextVar("gepo_response_terms", default=None)


@contextmanager
def provide_response_terms(terms: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Make ``terms`` visible to :func:`current_response_terms` inside the block."""
    token = _CURRENT_TERMS.set(dict(terms))
    try:
        yield
    finally:
        _CURRENT_TERMS.reset(token)


def current_response_terms() -> Mapping[str, torch.Tensor]:
    """The per-response terms of the micro-batch being processed ({} outside a wrapped call)."""
    return _CURRENT_TERMS.get() or {}


def extract_response_terms(data) -> dict[str, torch.Tensor]:
    """Pick the per-response term fields out of a verl micro-batch ``TensorDict``."""
    keys = set(data.keys())
    terms = {}
    for name in RESPONSE_TERM_FIELDS:
        if name in keys:
            value = data[name]
            if getattr(value, "is_nested", False):
                value = value.to_padded_tensor(0.0)
            terms[name] = value.reshape(value.shape[0], -1)[:, 0] if value.dim() > 1 else value
    return terms


def _rewrapped(metric, aggregation):
    """The same values under another aggregation (``Metric.values`` is a seam contact)."""
    from verl.utils.metric import Metric  # lazy: the lab imports this module without verl (gepo-lab's start-up)

    seam.require("metric_aggregation")
    out = Metric(aggregation)
    out.extend(list(metric.values))
    return out


def _fix_metric_aggregation(metrics: dict) -> dict:
    """verl wraps every policy-loss metric as a MEAN over micro-batches. A ``*_max`` / ``*_min`` statistic must
    aggregate as MAX / MIN instead, or it would report a mean of maxima; the by-lag totals
    (:mod:`gepo_plugin.hetero.lag_buckets`) and the step totals (:mod:`gepo_plugin.maths.gepo_metrics`) as SUM, so
    every mini-batch carries the same scale (1 / dp size)."""
    from verl.utils.metric import AggregationType, Metric  # lazy, as above

    for key, value in list(metrics.items()):
        if not key.startswith("actor/gepo/") or not isinstance(value, Metric):
            continue
        if any(segment in key for segment in (*BY_LAG_SEGMENTS, STEP_TOTALS)):
            metrics[key] = _rewrapped(value, AggregationType.SUM)
        elif key.endswith("_max"):
            metrics[key] = _rewrapped(value, AggregationType.MAX)
        elif key.endswith("_min"):
            metrics[key] = _rewrapped(value, AggregationType.MIN)
    return metrics


def ppo_loss_with_response_terms(config, model_output, data, dp_group=None):
    """verl's ``ppo_loss``, with the micro-batch's per-response terms made visible to the policy loss."""
    # lazy: a cycle through verl (its losses module imports the registry whose hook imports ours, which imports this)
    from verl.workers.utils.losses import ppo_loss

    with provide_response_terms(extract_response_terms(data)):
        loss, metrics = ppo_loss(config, model_output, data, dp_group)
    return loss, _fix_metric_aggregation(metrics)
