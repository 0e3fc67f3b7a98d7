"""``python -m gepo_plugin.main_ppo algorithm.loss=gepo <usual verl overrides>``.

verl's ``main_ppo`` (same Hydra overrides, same V1 trainer, same Ray start-up) with the plugin's config
(``gepo_trainer.yaml``: verl's ``ppo_trainer`` plus ``algorithm.loss``, GEPO's options and ``hetero``). Before
verl starts, the launcher settles the config (:mod:`gepo_plugin.launch`): the ``algorithm.loss`` preset, the
HeteroRL wiring and the CPU backend's settings become ordinary Hydra overrides, every start-up check runs, and
only then does Hydra compose, so ``--cfg job`` shows exactly what runs and a bad config exits non-zero before
anything is printed or started.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import gepo_plugin.config  # noqa: F401  (registers the option nodes the yaml's defaults list names)
from gepo_plugin.config_keys import HETERO_ENABLE, HETERO_LEARNER_RESOURCE
from gepo_plugin.cpu_backend.activate import select_cpu_platform
from gepo_plugin.cpu_backend.vllm.weight_buckets import buckets_released_around_run
from gepo_plugin.launch import CommandLine, changed_keys, check_before_start, explicit_keys, plan_launch, settle
from gepo_plugin.options import OptionsError
from gepo_plugin.patching import PatchVersionError
from gepo_plugin.verl_glue.hetero.placement import place_task_runner
from gepo_plugin.verl_glue.seam import SeamError
from gepo_plugin.verl_glue.vllm_rollout import uses_vllm_rollout

logger = logging.getLogger("gepo_plugin")

PROG = "python -m gepo_plugin.main_ppo"
#: Exit status of a configuration error (as argparse uses for usage errors).
CONFIG_ERROR_EXIT = 2

_COMPOSED: list[DictConfig] = []


@hydra.main(config_path="config", config_name="gepo_trainer", version_base=None)
def _compose(config: DictConfig) -> None:
    """Pass 1: Hydra composes the user's command line exactly as it will for the run; nothing else happens."""
    _COMPOSED.append(config)


@hydra.main(config_path="config", config_name="gepo_trainer", version_base=None)
def _run(config: DictConfig) -> None:
    """Pass 2: the settled config; a no-op settle confirms it, then verl's own ``main`` runs it."""
    settled, _, _ = settle(config, explicit_keys(HydraConfig.get().overrides.task))
    drift = changed_keys(config, settled)
    if drift:  # the first pass's overrides should have settled everything
        raise RuntimeError(f"gepo-plugin: the launcher left settings unsettled (a bug, please report): {drift}")
    if config.trainer.device == "cpu":
        select_cpu_platform()
        logger.warning("trainer.device=cpu: verl on the CPU backend (a debugging/CI backend, not for training)")
    resource = OmegaConf.select(config, HETERO_LEARNER_RESOURCE) if OmegaConf.select(config, HETERO_ENABLE) else None
    if resource:
        place_task_runner(resource)
    from verl.trainer.main_ppo import main as verl_main  # lazy: verl's trainer stack, once the config is settled

    with _releasing_weight_buckets(config):
        try:
            verl_main(config)  # Hydra's decorated main runs the task function directly when given a config
        except Exception as error:
            # the cause, once, in this process's log: the trainer's own lines come through Ray's log monitor, which
            # may not forward the last of them before this process exits
            logger.error("gepo-plugin: the run stopped: %s", _root_cause(error))
            raise


def _root_cause(error: BaseException) -> str:
    """``Type: first line`` of the error a Ray task raised (not Ray's wrapper with the remote traceback)."""
    cause = getattr(error, "cause", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _releasing_weight_buckets(config: DictConfig) -> contextlib.AbstractContextManager:
    """A CPU vLLM run releases the weight buckets a stopped run leaves in /dev/shm (see ``weight_buckets``)."""
    if config.trainer.device != "cpu" or not uses_vllm_rollout(config):
        return contextlib.nullcontext()
    return buckets_released_around_run(lambda line: logger.warning("gepo-plugin: %s", line))


def _sets_group(command: CommandLine, group: str) -> bool:
    return any(override.lstrip("+~").startswith(f"hydra/{group}=") for override in command.overrides)


def _compose_user_config(command: CommandLine) -> DictConfig:
    run_dir = tempfile.mkdtemp(prefix="gepo_launch_")
    # This pass only composes: no output folder, and no logging set-up (Hydra's logs to stdout, which must stay
    # for what the user asked to print, e.g. the YAML of --cfg job); pass 2 sets both up as usual.
    quiet = [f"hydra/{group}=none" for group in ("job_logging", "hydra_logging") if not _sets_group(command, group)]
    try:
        sys.argv = [
            PROG,
            *command.flag_args(keep_print_flags=False),
            *command.overrides,
            "hydra.output_subdir=null",
            f"hydra.run.dir={run_dir}",
            *quiet,
        ]
        _COMPOSED.clear()
        _compose()
    finally:
        GlobalHydra.instance().clear()
        shutil.rmtree(run_dir, ignore_errors=True)
    if not _COMPOSED:
        raise SystemExit(1)  # Hydra printed its own error
    return _COMPOSED[0]


def _config_error(message: str) -> None:
    print(f"gepo-plugin: configuration error: {message}", file=sys.stderr)
    raise SystemExit(CONFIG_ERROR_EXIT)


def main(argv: list[str] | None = None) -> None:
    """Settle the command line's config, check it, then let Hydra compose and run (or print) exactly that."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = CommandLine.parse(argv)
    if command.passthrough:
        sys.argv = [PROG, *argv]
        _run()
        return
    if command.multirun:
        print(f"{PROG}: --multirun is not supported (verl starts one Ray job per run); run each config separately")
        raise SystemExit(CONFIG_ERROR_EXIT)
    config = _compose_user_config(command)
    try:
        plan = plan_launch(config, command.overrides)
    except OptionsError as error:
        _config_error(str(error))
    if plan.config.trainer.device == "cpu":
        select_cpu_platform()
    try:
        inspect_warnings = check_before_start(plan.config, plan.hetero, inspecting=command.inspecting)
    except (SeamError, PatchVersionError) as error:  # an internal or a patch the configured features need
        _config_error(str(error))
    except Exception as error:  # verl's validate_config raises assertions, ValueErrors and Hydra errors
        _config_error(f"verl's config check failed: {type(error).__name__}: {error}")
    for warning in [*plan.warnings, *inspect_warnings]:
        logger.warning("gepo-plugin: %s", warning)
    sys.argv = [PROG, *command.flag_args(), *plan.overrides]
    _run()


if __name__ == "__main__":
    main()
