"""Register the transformers rollout and the Ray-mailbox checkpoint engine with verl, in this process.

verl looks a rollout's replica up in the driver/TaskRunner (public ``RolloutReplicaRegistry``), its adapter in
every training and checkpoint-engine worker (``_ROLLOUT_REGISTRY``, a private dict of class paths, reached through
:mod:`gepo_plugin.verl_glue.seam`), and a checkpoint engine by backend name (public ``CheckpointEngineRegistry``).
:func:`install` registers each one as soon as verl imports the registry, without importing the rollout itself.

The CPU backend installs this in every ``VERL_PLATFORM=cpu`` process. Importing the module installs it too, so
verl's own per-worker import hooks can name it (``rollout.checkpoint_engine.custom_backend_module`` or
``model.external_lib``) where the entry point is not active.
"""

from __future__ import annotations

from gepo_plugin.cpu_backend import ROLLOUT_NAME
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.registration import install_hooks

#: ``(name, mode)`` -> class path, as verl's ``_ROLLOUT_REGISTRY`` holds rollout adapters.
ADAPTER_PATH = "gepo_plugin.cpu_backend.rollout.adapter.HFServerAdapter"

_INSTALLED: list[bool] = []


def load_hf_replica() -> type:
    """Loader for ``RolloutReplicaRegistry`` (imports the transformers rollout only when verl builds replicas)."""
    from gepo_plugin.cpu_backend.rollout.replica import HFReplica  # lazy: when verl builds replicas

    return HFReplica


# The post-import hooks (HOOKS) import what they register only once verl imports the module they wait for.


def _register_replica() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    current = seam.resolve("verl.workers.rollout.replica.RolloutReplicaRegistry._registry").get(ROLLOUT_NAME)
    if current is not None and current is not load_hf_replica:
        raise ValueError(f"rollout name {ROLLOUT_NAME!r} is already registered to another backend ({current})")
    RolloutReplicaRegistry.register(ROLLOUT_NAME, load_hf_replica)


def _register_adapter() -> None:
    registry = seam.resolve("verl.workers.rollout.base._ROLLOUT_REGISTRY")
    key = (ROLLOUT_NAME, "async")
    if registry.get(key) not in (None, ADAPTER_PATH):
        raise ValueError(f"rollout name {ROLLOUT_NAME!r} is already registered to {registry[key]}")
    registry[key] = ADAPTER_PATH


def _register_checkpoint_engine() -> None:
    from gepo_plugin.cpu_backend.ray_mailbox_engine import register_ray_mailbox_engine

    register_ray_mailbox_engine()


#: verl module -> (what it registers, the step's name for errors).
HOOKS = (
    ("verl.workers.rollout.replica", _register_replica, "register the transformers rollout replica"),
    ("verl.workers.rollout.base", _register_adapter, "register the transformers rollout adapter"),
    ("verl.checkpoint_engine.base", _register_checkpoint_engine, "register the ray_mailbox checkpoint engine"),
)


def install() -> None:
    """Register each part once verl imports its registry (idempotent)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    install_hooks(HOOKS)


install()
