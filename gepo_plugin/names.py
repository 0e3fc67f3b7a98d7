"""Names the plugin registers with verl (kept free of imports so probes can read them cheaply)."""

POLICY_LOSSES = ("gepo",)
ADVANTAGE_ESTIMATORS = ("bnpo", "delta_l")
TRAINERS = ("gepo_sync", "gepo_colocate_async", "gepo_separate_async")
SUPPORTED_VERL = (">=0.9.1", "<0.10")
ENTRY_POINT_MODULE = "gepo_plugin.verl_glue.plugin"


def verl_version_supported(version: str) -> bool:
    """Is ``version`` inside the verl range this plugin was written and tested for?"""
    from packaging.specifiers import SpecifierSet

    return version in SpecifierSet(",".join(SUPPORTED_VERL))


def registered_names() -> dict[str, list[str]]:
    """Which of the plugin's names verl's registries of *this* process hold (imports verl lazily)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return {
        "policy_losses": [n for n in POLICY_LOSSES if n in POLICY_LOSS_REGISTRY],
        "advantage_estimators": [n for n in ADVANTAGE_ESTIMATORS if n in ADV_ESTIMATOR_REGISTRY],
        "trainers": [n for n in TRAINERS if n in TRAINER_REGISTRY],
    }


def expected_names() -> dict[str, list[str]]:
    return {
        "policy_losses": list(POLICY_LOSSES),
        "advantage_estimators": list(ADVANTAGE_ESTIMATORS),
        "trainers": list(TRAINERS),
    }
