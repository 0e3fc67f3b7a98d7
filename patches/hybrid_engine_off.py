"""verl 0.9.1 ``separate_async`` with ``actor_rollout_ref.hybrid_engine=False`` crashes at set-up.

``PPOTrainerSeparateAsync._setup`` logs the "hybrid replicas disabled" message with
``logger.info(..., flush=True)``; the standard ``logging.Logger`` rejects ``flush`` (TypeError),
and the module logger is at INFO by default, so every run with samplers only (the HeteroRL layout
where the learner's GPUs never generate) dies before training. The fix gives that module a logger
adapter that drops the ``flush`` keyword and forwards everything else unchanged.
"""

from __future__ import annotations

import logging

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam


class _FlushTolerantLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _apply() -> None:
    name = "verl.trainer.ppo.v1.trainer_separate_async.logger"
    current = seam.resolve(name)
    if not isinstance(current, _FlushTolerantLogger):
        seam.replace(name, _FlushTolerantLogger(current, {}))


PATCH = Patch(
    name="hybrid_engine_off",
    versions={"verl": "==0.9.1"},
    reason="separate_async with hybrid_engine=False calls logger.info(..., flush=True), a TypeError",
    apply=_apply,
    feature="hybrid_engine_off",
    check_contacts=seam.require,
)
