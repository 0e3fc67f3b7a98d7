"""``python -m gepo_plugin.main_ppo algorithm.loss=gepo <usual verl overrides>``.

Exactly verl's ``main_ppo`` (same Hydra overrides, same V1 trainer, same Ray start-up), with
the plugin's config (``gepo_trainer.yaml``: verl's ``ppo_trainer`` plus ``algorithm.loss`` and
the loss options) and four steps before verl's own start-up: the ``algorithm.loss`` preset is
applied (never over a key you set yourself), ``hetero.enable=true`` selects the HeteroRL
sampler and trainer, ``trainer.device=cpu`` switches to the CPU
debugging backend, and the plugin's settings are validated.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gepo_plugin.verl_glue.hetero_wiring import apply_hetero
from gepo_plugin.verl_glue.presets import apply_loss_preset, explicit_override_keys
from gepo_plugin.verl_glue.validation import validate_plugin_config


def prepare_config(config: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply the loss preset and validate; shared by the CLI and the tests (Hydra compose)."""
    import gepo_plugin.verl_glue.plugin  # noqa: F401  (registrations in this process)
    from gepo_plugin.cpu_backend.activate import prepare_cpu_run

    explicit = explicit_override_keys(overrides)
    apply_loss_preset(config, explicit)
    apply_hetero(config, explicit)
    prepare_cpu_run(config, explicit)
    validate_plugin_config(config)
    return config


@hydra.main(config_path="config", config_name="gepo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    prepare_config(config, list(HydraConfig.get().overrides.task))
    from verl.trainer.main_ppo import main as verl_main

    # Hydra's decorated main runs the task function directly when given a config.
    verl_main(config)


if __name__ == "__main__":
    main()
