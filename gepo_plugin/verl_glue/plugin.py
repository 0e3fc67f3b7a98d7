"""verl plugin entry point (group ``verl.plugins``): registers everything on ``import verl``.

verl imports this module in every process that imports verl (the launcher, the TaskRunner
actor, every worker actor) and swallows any exception at DEBUG level. So the registration
checks itself and logs a WARNING that names what failed, instead of failing silently.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("gepo_plugin")

SUPPORTED_VERL = (">=0.9.1", "<0.10")
POLICY_LOSSES = ("gepo",)
ADVANTAGE_ESTIMATORS = ("bnpo", "delta_l")
TRAINERS = ("gepo_sync", "gepo_colocate_async", "gepo_separate_async")

#: What registration found, for ``python -m gepo_plugin doctor``.
STATUS: dict[str, object] = {"registered": False, "error": None}


def verl_version_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return version in SpecifierSet(",".join(SUPPORTED_VERL))


def registered_names() -> dict[str, list[str]]:
    """The plugin's names that are present in verl's registries of this process."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return {
        "policy_losses": [n for n in POLICY_LOSSES if n in POLICY_LOSS_REGISTRY],
        "advantage_estimators": [n for n in ADVANTAGE_ESTIMATORS if n in ADV_ESTIMATOR_REGISTRY],
        "trainers": [n for n in TRAINERS if n in TRAINER_REGISTRY],
    }


def register() -> bool:
    """Import the modules whose decorators register with verl, then verify. Never raises."""
    try:
        import verl

        if not verl_version_supported(verl.__version__):
            logger.warning(
                "gepo-plugin supports verl %s but verl %s is installed; registering anyway",
                ",".join(SUPPORTED_VERL),
                verl.__version__,
            )
        import gepo_plugin.verl_glue.advantages  # noqa: F401
        import gepo_plugin.verl_glue.losses  # noqa: F401
        import gepo_plugin.verl_glue.trainers  # noqa: F401

        found = registered_names()
        missing = [
            name
            for expected, got in zip((POLICY_LOSSES, ADVANTAGE_ESTIMATORS, TRAINERS), found.values(), strict=True)
            for name in expected
            if name not in got
        ]
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
