"""M2PO's cap as a loss reads it: in the configured scope (handed over by the mini-batch's pre-pass, or computed over
the micro-batch), and its metrics.

Why its own module: the ``m2po`` loss and the GEPO losses with ``policy_loss.m2_mask=true`` both read the cap, and
each registers with verl when ``verl.trainer.ppo.core_algos`` is imported; importing one loss module from the other
would let that import hook run while the first is half initialised and fail the second's registration. This module
imports nothing of verl.
"""

from __future__ import annotations

import torch

from gepo_plugin import metric_names
from gepo_plugin.maths.m2po import NO_CAP, M2Cap, m2_cap
from gepo_plugin.maths.options import PolicyLossOptions
from gepo_plugin.verl_glue.response_terms import M2PO_CAP_FIELDS, current_response_terms

CAP_MISSING = (
    "M2PO's mini-batch cap (fields " + ", ".join(M2PO_CAP_FIELDS) + ") did not reach the loss: with "
    "policy_loss.m2_scope=mini_batch the plugin measures the second moment over the whole mini-batch before verl's "
    "update, which needs the plugin's launcher (`python -m gepo_plugin.main_ppo algorithm.loss=m2po ...`). Or set "
    "`actor_rollout_ref.actor.policy_loss.m2_scope=micro_batch` to take it over each micro-batch, as the authors' "
    "code does."
)


class MiniBatchCapMissingError(RuntimeError):
    """The m2po loss ran with ``m2_scope=mini_batch`` but without the pre-pass's cap."""


def mini_batch_cap(rows: int) -> M2Cap:
    """The cap the mini-batch's pre-pass handed over for this micro-batch's ``rows`` (the same in every row)."""
    terms = current_response_terms()
    if not all(name in terms for name in M2PO_CAP_FIELDS):
        raise MiniBatchCapMissingError(CAP_MISSING)
    values = [terms[name] for name in M2PO_CAP_FIELDS]
    if any(value.shape != (rows,) for value in values):
        raise MiniBatchCapMissingError(
            f"M2PO's mini-batch cap has shapes {[tuple(v.shape) for v in values]}, not {rows}"
        )
    tau, m2, m2_after, harmful = (float(value[0]) for value in values)
    return M2Cap(None if tau == NO_CAP else tau, m2, m2_after, int(harmful))


def scoped_cap(
    options: PolicyLossOptions,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> M2Cap:
    """M2PO's cap in the configured ``m2_scope``: the mini-batch pre-pass's, or this micro-batch's own."""
    if options.m2_scope == "mini_batch":
        return mini_batch_cap(old_log_prob.shape[0])
    return m2_cap(log_prob, old_log_prob, advantages, response_mask, options.m2_budget)


def cap_metrics(cap: M2Cap) -> dict[str, float]:
    """The cap's metrics (``actor/m2po/*``), reported by every loss that reads it."""
    return {
        f"{metric_names.M2PO_LOSS}m2": cap.m2,
        f"{metric_names.M2PO_LOSS}m2_after": cap.m2_after,
        f"{metric_names.M2PO_LOSS}cap_binds": 0.0 if cap.tau is None else 1.0,
        f"{metric_names.M2PO_LOSS}harmful_tokens": float(cap.harmful_tokens),
    }
