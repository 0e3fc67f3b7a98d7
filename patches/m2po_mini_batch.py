"""verl's engines train a mini-batch micro-batch by micro-batch: a loss never sees the whole mini-batch.

M2PO's cap is a statistic of the whole set of harmful tokens under the current policy, so over whole mini-batches
(``policy_loss.m2_scope=mini_batch``, the plugin's default) it must be known before the first micro-batch's loss.
``BaseEngine.train_batch`` (every engine's: FSDP's and Megatron's inherit it) is wrapped: when the loss it is handed
is bound to M2PO in that scope, the mini-batch is first measured
(:func:`gepo_plugin.verl_glue.m2po_mini_batch.attach_mini_batch_cap`), then trained as verl trains it. Any other
loss passes straight through.

Applied in the processes of the runs the plugin's launcher starts with M2PO in that scope
(``GEPO_M2PO_MINI_BATCH=1`` in the Ray runtime env, shown by ``--cfg job``), once verl's engine base module is
imported.
"""

from __future__ import annotations

import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import m2po_mini_batch, seam

_TRAIN_BATCH = "verl.workers.engine.base.BaseEngine.train_batch"


def _measuring(train_batch):
    @functools.wraps(train_batch)
    def wrapper(self, data, loss_function):
        budget = m2po_mini_batch.requested_budget(loss_function)
        if budget is not None:
            m2po_mini_batch.attach_mini_batch_cap(self, data, budget)
        return train_batch(self, data, loss_function)

    return wrapper


def _apply() -> None:
    seam.replace(_TRAIN_BATCH, _measuring(seam.resolve(_TRAIN_BATCH)))


PATCH = Patch(
    name=m2po_mini_batch.PATCH_NAME,
    versions={"verl": "==0.9.1"},
    reason="verl's engines hand a policy loss one micro-batch at a time, so M2PO's cap over the whole mini-batch "
    "(the scope that does not depend on verl's split) must be measured before the engine trains the mini-batch",
    apply=_apply,
    feature=m2po_mini_batch.FEATURE,
    check_contacts=seam.require,
)
