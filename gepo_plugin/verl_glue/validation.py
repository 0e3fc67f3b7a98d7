"""Start-up checks of the plugin's settings: each mistake stops before Ray starts, naming the key and the fix.

:func:`validate_plugin_config` runs in the launcher on the config that will run (after the preset, HeteroRL and
CPU settings were filled in), before anything is printed (``--cfg job``) or started. It imports no part of
verl's trainer stack, so a mistake is reported within seconds. Warnings (legal but probably unintended
settings) are returned for the launcher to print.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gepo_plugin.maths.options import (
    BNPO_OPTIONS_KEY,
    DELTA_L_OPTIONS_KEY,
    GEPO_OPTIONS_KEY,
    BNPOOptions,
    DeltaLOptions,
    GEPOOptions,
)
from gepo_plugin.names import GEPO_TRAINER_FOR_MODE, TRAINERS, VERL_TRAINER_MODES
from gepo_plugin.options import parse_options
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.presets import ACTOR, TRAINER_MODE_KEY, get_preset

__all__ = ["PluginConfigError", "validate_plugin_config"]


ROLLOUT = "actor_rollout_ref.rollout"
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
#: Devices of verl's own platforms (AMD GPUs are ``cuda`` too) plus the plugin's CPU backend.
KNOWN_DEVICES = ("cuda", "npu", "cpu")
#: Booleans the plugin reads or relies on (verl's own, plus ``hetero.*`` which its model checks).
BOOLEAN_KEYS = (
    BYPASS_KEY,
    "algorithm.norm_adv_by_std_in_grpo",
    f"{ROLLOUT}.calculate_log_probs",
    "actor_rollout_ref.hybrid_engine",
    "trainer.use_v1",
)


def _select(config: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default)


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{prefix}[{index}]")
    else:
        yield prefix, node


def _is_ratio_or_coefficient(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return "clip_ratio" in last or "coef" in last


def check_numbers(config: DictConfig) -> None:
    """NaN is refused everywhere; infinity in clip ratios and coefficients (nothing of verl's or ours means it)."""
    container = OmegaConf.to_container(config, resolve=False)
    for key, value in _leaves(container):
        nonfinite = isinstance(value, float) and not math.isfinite(value)
        if nonfinite and (math.isnan(value) or _is_ratio_or_coefficient(key)):
            raise PluginConfigError(f"{key}={value}: must be a finite number")


def check_booleans(config: DictConfig) -> None:
    """A string such as ``no`` or ``off`` is refused, never read as true."""
    for key in BOOLEAN_KEYS:
        value = _select(config, key)
        if value is not None and not isinstance(value, bool):
            raise PluginConfigError(f"{key}={value!r}: must be true or false (write {key}=true or {key}=false)")


def check_device(config: DictConfig) -> None:
    """``trainer.device``: verl's devices (``cuda`` also on AMD, ``npu``) or the plugin's ``cpu`` backend."""
    device = _select(config, "trainer.device", "cuda")
    if device not in KNOWN_DEVICES:
        close = difflib.get_close_matches(str(device), KNOWN_DEVICES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PluginConfigError(f"trainer.device={device!r}: use one of {', '.join(KNOWN_DEVICES)}{hint}")


def check_trainer_mode(config: DictConfig) -> None:
    """``trainer.v1.trainer_mode`` must name a registered trainer (verl's registry is imported only if needed)."""
    mode = _select(config, TRAINER_MODE_KEY)
    known = set(VERL_TRAINER_MODES) | set(TRAINERS)
    if mode in known:
        return
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY  # a user's own registered trainer

    known |= set(TRAINER_REGISTRY)
    if mode not in known:
        close = difflib.get_close_matches(str(mode), sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PluginConfigError(
            f"{TRAINER_MODE_KEY}={mode!r} is not a registered trainer{hint} Valid: {', '.join(sorted(known))}"
        )


def _check_clip_range(config: DictConfig) -> None:
    low, high = _select(config, f"{ACTOR}.clip_ratio_low"), _select(config, f"{ACTOR}.clip_ratio_high")
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if value is not None and not float(value) >= 0:
            raise PluginConfigError(f"{ACTOR}.{name}={value}: must be >= 0 (the clip range is 1-low .. 1+high)")
    if low is not None and float(low) >= 1:
        raise PluginConfigError(f"{ACTOR}.clip_ratio_low={low}: must be < 1 (the lower bound is 1 - low)")


def _check_standalone_rollout(config: DictConfig) -> None:
    """separate_async generates on standalone replicas only; verl asserts this only after Ray starts."""
    if not str(_select(config, TRAINER_MODE_KEY)).endswith("separate_async"):
        return
    nodes, gpus = _select(config, f"{ROLLOUT}.nnodes", 0), _select(config, f"{ROLLOUT}.n_gpus_per_node", 0)
    if not (isinstance(nodes, int) and isinstance(gpus, int) and nodes > 0 and gpus > 0):
        raise PluginConfigError(
            f"{TRAINER_MODE_KEY}={_select(config, TRAINER_MODE_KEY)} generates on standalone rollout replicas, but "
            f"{ROLLOUT}.nnodes={nodes} and {ROLLOUT}.n_gpus_per_node={gpus}: set both to the samplers' nodes and "
            "GPUs per node (e.g. 1 and 8)"
        )


def _group_size(config: DictConfig) -> int:
    value = _select(config, f"{ROLLOUT}.n", 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PluginConfigError(f"{ROLLOUT}.n={value!r}: must be a whole number of responses per prompt")
    return value


def _check_gepo(config: DictConfig, warnings: list[str]) -> None:
    options = parse_options(
        GEPOOptions,
        {k: v for k, v in (_select(config, f"{ACTOR}.policy_loss") or {}).items() if k in GEPOOptions.model_fields},
        GEPO_OPTIONS_KEY,
        PluginConfigError,
    )
    mode = _select(config, TRAINER_MODE_KEY)
    if options.group_scope == "prompt" and mode not in GEPO_TRAINER_FOR_MODE.values():
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        from gepo_plugin.verl_glue.trainers import SampleTermsMixin

        cls = TRAINER_REGISTRY.get(mode)
        if cls is None or not issubclass(cls, SampleTermsMixin):
            suggestion = GEPO_TRAINER_FOR_MODE.get(mode)
            fix = (
                f"set {TRAINER_MODE_KEY}={suggestion} (or use algorithm.loss=gepo, which does)"
                if suggestion
                else (f"use one of {', '.join(GEPO_TRAINER_FOR_MODE.values())}")
            )
            raise PluginConfigError(
                f"{ACTOR}.policy_loss.loss_mode=gepo needs the per-prompt group term, but {TRAINER_MODE_KEY}={mode} "
                f"does not compute it: {fix}, or set {GEPO_OPTIONS_KEY}.group_scope=batch to reproduce the "
                "reference code's micro-batch scope."
            )
    n = _group_size(config)
    if n < 2:
        raise PluginConfigError(
            f"{ROLLOUT}.n={n}: GEPO's group expectation runs over several responses to one prompt; set "
            f"{ROLLOUT}.n >= 2 (the paper used 8)"
        )
    if not _select(config, BYPASS_KEY, False):
        warnings.append(
            f"loss_mode=gepo without {BYPASS_KEY}=true: q is the recomputed old policy, not the sampler's "
            "log-probs the paper's weight is defined with"
        )


def validate_plugin_config(config: DictConfig) -> list[str]:
    """Raise :class:`PluginConfigError` for settings that cannot work; return warnings for odd but legal ones."""
    warnings: list[str] = []
    loss = _select(config, "algorithm.loss")
    if loss is not None:
        get_preset(str(loss))
    check_booleans(config)
    check_numbers(config)
    check_device(config)
    check_trainer_mode(config)
    _check_clip_range(config)
    _check_standalone_rollout(config)
    if _select(config, BYPASS_KEY, False) and _select(config, f"{ROLLOUT}.calculate_log_probs") is False:
        raise PluginConfigError(
            f"{BYPASS_KEY}=true uses the sampler's log-probs as the old policy, but {ROLLOUT}.calculate_log_probs="
            f"false means the sampler returns none: set {ROLLOUT}.calculate_log_probs=true (GEPO needs them), or "
            f"{BYPASS_KEY}=false"
        )
    if _select(config, f"{ACTOR}.policy_loss.loss_mode", "vanilla") == "gepo":
        _check_gepo(config, warnings)
    estimator = _select(config, "algorithm.adv_estimator")
    if estimator in ("bnpo", "delta_l"):
        n = _group_size(config)
        if n < 2:
            raise PluginConfigError(f"algorithm.adv_estimator={estimator} needs {ROLLOUT}.n >= 2, got {n}")
    for model, key in ((BNPOOptions, BNPO_OPTIONS_KEY), (DeltaLOptions, DELTA_L_OPTIONS_KEY)):
        block = _select(config, key)
        parse_options(model, OmegaConf.to_container(block) if block is not None else None, key, PluginConfigError)
    return warnings
