"""verl plugin entry point (group ``verl.plugins``): registers everything on ``import verl``.

verl imports this module in every process that imports verl (the launcher, the TaskRunner
actor, every worker actor) and swallows any exception at DEBUG level. So the registration
checks itself and logs a WARNING that names what failed, instead of failing silently.
"""

from __future__ import annotations

import logging

from gepo_plugin.names import SUPPORTED_VERL, expected_names, registered_names, verl_version_supported

logger = logging.getLogger("gepo_plugin")

#: What registration found, for ``python -m gepo_plugin doctor``.
STATUS: dict[str, object] = {"registered": False, "error": None, "cpu_backend": False, "cpu_error": None}


def _activate_cpu_backend_loudly() -> None:
    """CPU backend (only under VERL_PLATFORM=cpu); a failure is logged as an ERROR, never swallowed."""
    try:
        from gepo_plugin.cpu_backend.activate import activate_cpu_backend

        STATUS["cpu_backend"] = activate_cpu_backend()
    except Exception as error:
        STATUS["cpu_error"] = f"{type(error).__name__}: {error}"
        logger.error("gepo-plugin: the CPU backend failed to activate: %s", STATUS["cpu_error"])


def _apply_server_identity_if_hetero() -> None:
    """HeteroRL runs set GEPO_HETERO_SERVER_ID=1 in every Ray process: tag rollouts with their server."""
    import os

    if os.environ.get("GEPO_HETERO_SERVER_ID") != "1":
        return
    from gepo_plugin.patching import apply_optional

    apply_optional("server_identity", "per-sampler-group throughput metrics are unavailable", logger)


def register() -> bool:
    """Import the modules whose decorators register with verl, then verify. Never raises."""
    try:
        import verl

        # First, before anything resolves verl's platform: the inert cpu platform (selected only by
        # VERL_PLATFORM=cpu), then, if selected, the CPU backend's registrations and patches.
        _activate_cpu_backend_loudly()
        _apply_server_identity_if_hetero()
        if not verl_version_supported(verl.__version__):
            logger.warning(
                "gepo-plugin supports verl %s but verl %s is installed; registering anyway",
                ",".join(SUPPORTED_VERL),
                verl.__version__,
            )
        import gepo_plugin.verl_glue.advantages
        import gepo_plugin.verl_glue.losses
        import gepo_plugin.verl_glue.trainers  # noqa: F401

        found = registered_names()
        missing = [name for kind, names in expected_names().items() for name in names if name not in found[kind]]
        if missing:
            raise RuntimeError(f"not registered after import: {missing}")
    except Exception as error:  # verl would swallow it at DEBUG level: say it loudly
        STATUS.update(registered=False, error=f"{type(error).__name__}: {error}")
        logger.warning(
            "gepo-plugin failed to register with verl (%s: %s); algorithm.loss=gepo and loss_mode=gepo will not "
            "work in this process. Run `python -m gepo_plugin doctor` for details.",
            type(error).__name__,
            error,
        )
        return False
    STATUS.update(registered=True, error=None)
    return True


register()
