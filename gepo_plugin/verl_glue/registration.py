"""Lazy, import-order-proof registration of the plugin's names with verl.

verl imports every ``verl.plugins`` entry point on ``import verl``, in every process. Importing the plugin's
loss, estimators and trainers right then would cost every process verl's trainer stack (seconds, and a dozen
warnings about engines that are not installed), and it re-enters verl while verl is still initialising: an
import cycle whenever a user imports a plugin module first.

So registration waits for the registry itself: when verl's module that holds a registry finishes importing, a
post-import hook (``wrapt.register_post_import_hook``) imports the plugin module whose decorators register with
it. A lookup can only happen after that module is imported, so it always finds the plugin's names; a process
that never trains (a rollout server, a reward worker) never pays for them.

If the plugin module is already being imported (a user imported it first, and it imported verl), the hook leaves
it alone: its decorators run when its own import finishes. Errors are recorded in :data:`ERRORS` and logged as a
WARNING naming the module, because verl swallows plugin errors at DEBUG level. One kind is raised as well: a patch
the process needs that refuses its installed versions (:func:`gepo_plugin.patching.stops_the_process`), so that the
process stops with the patch's message rather than with whatever verl does unpatched.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable

import wrapt

from gepo_plugin.names import expected_names, registered_names
from gepo_plugin.verl_glue.hetero.server_identity import ENV

#: The environment switch of patches/learner_placement.py (:data:`gepo_plugin.verl_glue.hetero.placement.ENV`; named
#: here too so that ``import verl`` need not import the placement module to read it).
PLACEMENT_ENV = "GEPO_LEARNER_RESOURCE"
#: The switch of patches/replay_buffer_poll.py (:data:`gepo_plugin.verl_glue.replay_wait.PACED_POLL_ENV`), set to
#: ``1`` by the launcher in every run's Ray runtime env.
PACED_POLL_ENV = "GEPO_PACED_REPLAY_POLL"
#: The switch of patches/m2po_mini_batch.py (:data:`gepo_plugin.verl_glue.m2po_mini_batch.SWITCH_KEY`), set to ``1``
#: by the launcher in the runs that train M2PO over whole mini-batches.
M2PO_MINI_BATCH_ENV = "GEPO_M2PO_MINI_BATCH"

logger = logging.getLogger("gepo_plugin")

#: verl module (that defines a registry) -> the plugin modules that register with it when imported.
REGISTRATIONS: dict[str, tuple[str, ...]] = {
    "verl.trainer.ppo.core_algos": (
        "gepo_plugin.verl_glue.losses",
        "gepo_plugin.verl_glue.m2po_loss",
        "gepo_plugin.verl_glue.advantages",
    ),
    "verl.trainer.ppo.v1": ("gepo_plugin.verl_glue.trainers",),
}

#: registration step -> the error that stopped it in this process (for the doctor).
ERRORS: dict[str, str] = {}


def run_recorded(step: str, action: Callable[[], object]) -> None:
    """Run one registration step; record and log a failure instead of raising.

    Raising here would fail the import of verl's own module (a broken plugin would break verl), and verl
    would swallow it at DEBUG level anyway; a WARNING that names the step is what the user needs.

    Except a patch's version refusal (:func:`gepo_plugin.patching.stops_the_process`): the step applies a patch this
    process needs (the gloo process group on the CPU backend, vLLM-CPU's weight path), and going on unpatched ends
    in an unrelated error later (torch's ``Duplicate device type cpu`` without ``gloo_process_group``). It is
    recorded and logged, then raised: the import of verl's module that triggered the step fails with the patch's
    message and fix. The launcher refuses such a run before Ray starts; this is for a process whose installed
    versions differ from the launcher's.
    """
    try:
        action()
    except Exception as error:
        ERRORS[step] = f"{type(error).__name__}: {error}"
        logger.warning(
            "gepo-plugin: could not %s in this process (%s); run `python -m gepo_plugin doctor` for details",
            step,
            ERRORS[step],
        )
        from gepo_plugin.patching import stops_the_process  # lazy: keeps import verl cheap

        if stops_the_process(error):
            raise


def import_registering(modules: Iterable[str]) -> None:
    """Import the plugin modules whose decorators register with verl, unless already (being) imported."""
    for name in modules:
        if name not in sys.modules:
            run_recorded(f"register {name} with verl", lambda name=name: importlib.import_module(name))


def on_import(module: str, callback) -> None:
    """Run ``callback(module_object)`` once ``module`` is imported (at once if it already is)."""
    wrapt.register_post_import_hook(callback, module)


def _apply_server_identity() -> None:
    from gepo_plugin.patching import apply_optional  # lazy: keeps import verl cheap

    apply_optional("server_identity", "per-sampler-group throughput metrics are unavailable", logger)


def _apply_replay_buffer_poll() -> None:
    from gepo_plugin.patching import apply_optional  # lazy: keeps import verl cheap

    apply_optional("replay_buffer_poll", "verl's replay buffer keeps sleeping 2 s between polls", logger)


def _apply_learner_placement() -> None:
    from gepo_plugin.patching import apply_optional  # lazy: keeps import verl cheap

    apply_optional("learner_placement", "verl's own services may land on sampler nodes", logger)


def _apply_m2po_mini_batch() -> None:
    from gepo_plugin.patching import apply_named  # lazy: keeps import verl cheap

    apply_named("m2po_mini_batch")


def install_hooks(hooks) -> None:
    """``(verl module, action, step name)`` triples: run each action, recorded, once its module is imported."""
    for module, action, step in hooks:
        on_import(module, lambda _module, action=action, step=step: run_recorded(step, action))


def install() -> None:
    """Register the post-import hooks (idempotent enough: a second hook finds the modules imported).

    HeteroRL runs set ``GEPO_SERVER_IDENTITY=1`` in every Ray process (``hetero.enable=true``): there rollouts
    are tagged with the server that generated them once verl's rollout client is imported. They also name the
    learner nodes' resource (``GEPO_LEARNER_RESOURCE``): verl's services are kept there once verl's V1 trainer
    package (imported by the TaskRunner before it creates them) is imported. Every run the launcher starts sets
    ``GEPO_PACED_REPLAY_POLL=1``: verl's replay buffer is paced once that package is imported (before the trainer
    builds its buffer). Runs of M2PO over whole mini-batches set ``GEPO_M2PO_MINI_BATCH=1``: verl's engines measure
    each mini-batch before they train it, once verl's engine base module is imported.
    """
    for verl_module, plugin_modules in REGISTRATIONS.items():
        on_import(verl_module, lambda _module, mods=plugin_modules: import_registering(mods))
    if os.environ.get(ENV) == "1":
        on_import(
            "verl.workers.rollout.llm_server",
            lambda _module: run_recorded("tag rollouts with their server", _apply_server_identity),
        )
    if os.environ.get(PACED_POLL_ENV) == "1":
        on_import(
            "verl.trainer.ppo.v1",
            lambda _module: run_recorded("pace the replay buffer's polls", _apply_replay_buffer_poll),
        )
    if os.environ.get(M2PO_MINI_BATCH_ENV) == "1":
        on_import(
            "verl.workers.engine.base",
            lambda _module: run_recorded("measure M2PO's mini-batches", _apply_m2po_mini_batch),
        )
    if os.environ.get(PLACEMENT_ENV):
        on_import(
            "verl.trainer.ppo.v1",
            lambda _module: run_recorded("keep verl's services on the learner's nodes", _apply_learner_placement),
        )


def registration_status() -> dict[str, object]:
    """What verl's registries of THIS process hold (importing them, which completes any pending registration)."""
    found = registered_names()
    expected = expected_names()
    missing = [name for kind, names in expected.items() for name in names if name not in found[kind]]
    return {"registered": found, "missing": missing, "errors": dict(ERRORS), "ok": not missing and not ERRORS}
