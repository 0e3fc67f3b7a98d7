"""Names the plugin registers with verl (kept free of imports so probes can read them cheaply)."""

#: The GEPO losses; each reads the per-prompt group term the plugin's trainers compute.
GEPO_LOSSES = ("gepo", "gepo_plus")
#: M2PO's loss (arXiv 2510.01161): PPO's clip with bounds from the harmful tokens' second moment.
M2PO_LOSS = "m2po"
#: Every policy loss the plugin registers.
POLICY_LOSSES = (*GEPO_LOSSES, M2PO_LOSS)
ADVANTAGE_ESTIMATORS = ("bnpo", "delta_l")
#: verl's V1 trainer modes (``trainer.v1.trainer_mode``).
VERL_TRAINER_MODES = ("sync", "colocate_async", "separate_async")
#: verl trainer mode -> the plugin's trainer of that mode that ships GEPO's per-prompt group term.
GEPO_TRAINER_FOR_MODE: dict[str, str] = {mode: f"gepo_{mode}" for mode in VERL_TRAINER_MODES}
#: HeteroRL's trainer for losses other than GEPO (``hetero.enable=true``; GEPO uses ``gepo_separate_async``).
HETERO_TRAINER = "hetero_separate_async"
TRAINERS = (*GEPO_TRAINER_FOR_MODE.values(), HETERO_TRAINER)
SUPPORTED_VERL = (">=0.9.1", "<0.10")
ENTRY_POINT_MODULE = "gepo_plugin.entry_point"
#: The weight relay's checkpoint engine (``checkpoint_engine.backend``) and the module that registers it, which
#: verl imports in every process that builds an engine (``checkpoint_engine.custom_backend_module``).
RELAY_CHECKPOINT_ENGINE = "relay"
RELAY_ENGINE_MODULE = "gepo_plugin.verl_glue.hetero.relay_engine"
#: ``actor_rollout_ref.rollout.name`` of verl's vLLM rollout.
VLLM_ROLLOUT = "vllm"
#: The CPU backend's verl platform (``trainer.device=cpu``, ``VERL_PLATFORM=cpu``) and its transformers rollout's name
#: (named here, below the glue and the backend, which both read them).
CPU_PLATFORM = "cpu"
CPU_ROLLOUT = "hf"


def verl_version_supported(version: str) -> bool:
    """Is ``version`` inside the verl range this plugin was written and tested for?"""
    from packaging.specifiers import SpecifierSet  # lazy: keeps import verl cheap

    return version in SpecifierSet(",".join(SUPPORTED_VERL))


def registered_names() -> dict[str, list[str]]:
    """Which of the plugin's names verl's registries of *this* process hold (imports verl lazily)."""
    # lazy: verl's trainer stack, which import verl must not load
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
