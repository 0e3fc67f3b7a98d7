"""CPU backend for running verl's real trainer without a GPU (a debugging/CI backend).

Modules are imported on demand: ``hf_rollout`` (a transformers rollout server behind verl's rollout
interface), ``ray_mailbox_engine`` (a checkpoint engine for standalone rollout replicas),
``platform`` and ``activate``. Nothing heavy is imported here, so ``import gepo_plugin`` stays cheap
on GPU hosts.
"""
