"""Start-up checks of the plugin's settings: each mistake stops before Ray starts, naming the key and the fix.

:func:`validate_plugin_config` runs in the launcher on the config that will run (after the preset, HeteroRL and
CPU settings were filled in), before anything is printed (``--cfg job``) or started. It imports no part of
verl's trainer stack, so a mistake is reported within seconds. Warnings (legal but probably unintended
settings) are returned for the launcher to print.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
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
#: Advantage estimators that compare the responses of one prompt (a group of one has no baseline but itself).
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "bnpo", "delta_l")
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
#: Devices of verl's own platforms (AMD GPUs are ``cuda`` too) plus the plugin's CPU backend.
KNOWN_DEVICES = ("cuda", "npu", "cpu")
#: Booleans the plugin reads or relies on (verl's own, plus ``hetero.*`` which its model checks).
BOOLEAN_KEYS = (
    BYPASS_KEY,
    "algorithm.norm_adv_by_std_in_grpo",
    f"{ROLLOUT}.calculate_log_probs",
    f"{ROLLOUT}.full_determinism",
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


def _check_separate_async(config: DictConfig) -> None:
    """What verl's separate_async trainer asserts in its constructor, checked before Ray starts instead."""
    if not str(_select(config, TRAINER_MODE_KEY)).endswith("separate_async"):
        return
    batch = _select(config, "data.train_batch_size")
    mini = _select(config, f"{ACTOR}.ppo_mini_batch_size")
    sync_step = _select(config, "trainer.v1.separate_async.parameter_sync_step")
    if all(isinstance(v, int) for v in (batch, mini, sync_step)) and batch != sync_step * mini:
        raise PluginConfigError(
            f"separate_async needs data.train_batch_size == trainer.v1.separate_async.parameter_sync_step x "
            f"{ACTOR}.ppo_mini_batch_size, got {batch} != {sync_step} x {mini}: change one of them"
        )
    if _select(config, f"{ROLLOUT}.checkpoint_engine.backend") == "naive":
        raise PluginConfigError(
            f"{ROLLOUT}.checkpoint_engine.backend=naive works only when rollout and learner share processes; "
            "separate_async needs nccl, nixl, mooncake (GPU) or ray_mailbox (the CPU backend)"
        )


def _check_hetero_layout(config: DictConfig) -> None:
    """``hetero.sampler_groups`` / ``group_delays`` must fit the rollout replicas verl will start (checked on the
    settled config: the CPU backend sets the rollout's parallel size)."""
    from gepo_plugin.hetero.settings import parse_hetero, rollout_replica_count

    settings = parse_hetero(_select(config, "hetero"))
    if settings.enable:
        settings.group_sizes(*rollout_replica_count(config.actor_rollout_ref.rollout))


#: Option blocks that only one setting reads: a value given there while that setting is off would do nothing.
OWNED_BLOCKS = (
    ("hetero.", "hetero.enable", True),
    (f"{BNPO_OPTIONS_KEY}.", "algorithm.adv_estimator", "bnpo"),
    (f"{DELTA_L_OPTIONS_KEY}.", "algorithm.adv_estimator", "delta_l"),
    *((f"{GEPO_OPTIONS_KEY}.{name}", f"{ACTOR}.policy_loss.loss_mode", "gepo") for name in GEPOOptions.model_fields),
)


def check_nothing_ignored(config: DictConfig, explicit: set[str]) -> None:
    """A setting given on the command line that nothing will read is a mistake (e.g. hetero.* without
    hetero.enable=true): refuse it instead of ignoring it silently."""
    for prefix, switch, needed in OWNED_BLOCKS:
        given = sorted(key for key in explicit if key.startswith(prefix) and key != switch)
        value = _select(config, switch)
        if given and value != needed:
            raise PluginConfigError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set, but {switch}={value}, so nothing "
                f"would read {'it' if len(given) == 1 else 'them'}: set {switch}={str(needed).lower()} or remove "
                f"{'it' if len(given) == 1 else 'them'}"
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

        from gepo_plugin.verl_glue.trainers import ResponseTermsMixin

        cls = TRAINER_REGISTRY.get(mode)
        if cls is None or not issubclass(cls, ResponseTermsMixin):
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


def validate_plugin_config(config: DictConfig, explicit: set[str] | None = None) -> list[str]:
    """Raise :class:`PluginConfigError` for settings that cannot work; return warnings for odd but legal ones.

    ``explicit``: the keys the user set on the command line (settings nothing would read are refused).
    """
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
    _check_separate_async(config)
    check_nothing_ignored(config, explicit or set())
    _check_hetero_layout(config)
    if _select(config, BYPASS_KEY, False) and _select(config, f"{ROLLOUT}.calculate_log_probs") is False:
        raise PluginConfigError(
            f"{BYPASS_KEY}=true uses the sampler's log-probs as the old policy, but {ROLLOUT}.calculate_log_probs="
            f"false means the sampler returns none: set {ROLLOUT}.calculate_log_probs=true (GEPO needs them), or "
            f"{BYPASS_KEY}=false"
        )
    if _select(config, f"{ACTOR}.policy_loss.loss_mode", "vanilla") == "gepo":
        _check_gepo(config, warnings)
    estimator = _select(config, "algorithm.adv_estimator")
    if estimator in GROUP_ESTIMATORS:
        n = _group_size(config)
        if n < 2:
            raise PluginConfigError(
                f"algorithm.adv_estimator={estimator} compares the responses to one prompt, so it needs {ROLLOUT}.n "
                f">= 2 (got {n}: every advantage would be 0)"
            )
    for model, key in ((BNPOOptions, BNPO_OPTIONS_KEY), (DeltaLOptions, DELTA_L_OPTIONS_KEY)):
        block = _select(config, key)
        parse_options(model, OmegaConf.to_container(block) if block is not None else None, key, PluginConfigError)
    return warnings


#: Files the run reads: a missing one fails only after Ray and the workers started.
DATA_FILE_KEYS = ("data.train_files", "data.val_files")
MODEL_PATH_KEY = "actor_rollout_ref.model.path"
REWARD_FUNCTION = "reward.custom_reward_function"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith(("file://", "pkg://"))


def check_paths(config: DictConfig) -> None:
    """The model, the data files and the reward function exist (remote URLs and Hub ids are not checked)."""
    model = _select(config, MODEL_PATH_KEY)
    if isinstance(model, str) and not _is_remote(model):
        local = os.path.expanduser(model)
        if not os.path.exists(local) and (
            os.path.isabs(local) or model.startswith((".", "~")) or not _HUB_ID.match(model)
        ):
            raise PluginConfigError(
                f"{MODEL_PATH_KEY}={model!r} is neither a local folder nor a Hugging Face Hub id (org/name)"
            )
    for key in DATA_FILE_KEYS:
        value = _select(config, key)
        paths = [value] if isinstance(value, str) else list(value or [])
        for path in paths:
            if isinstance(path, str) and not _is_remote(path) and not os.path.exists(os.path.expanduser(path)):
                raise PluginConfigError(f"{key}: {path!r} does not exist (give the parquet files of your data set)")
    path, name = _select(config, f"{REWARD_FUNCTION}.path"), _select(config, f"{REWARD_FUNCTION}.name")
    if not path:
        return
    if str(path).startswith("pkg://"):
        module = str(path)[len("pkg://") :]
        if importlib.util.find_spec(module) is None:
            raise PluginConfigError(f"{REWARD_FUNCTION}.path={path!r}: no module {module!r} is installed")
        return
    file = os.path.expanduser(str(path))
    if not os.path.isfile(file):
        raise PluginConfigError(f"{REWARD_FUNCTION}.path={path!r} does not exist")
    tree = ast.parse(Path(file).read_text(encoding="utf-8"), filename=file)
    defined = {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    } | {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    defined |= {
        alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    if name and name not in defined:
        close = difflib.get_close_matches(str(name), sorted(defined), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PluginConfigError(f"{REWARD_FUNCTION}.name={name!r} is not defined in {path}{hint}")


def check_registered_names(config: DictConfig) -> None:
    """The policy loss and the advantage estimator are registered with verl (verl looks them up only in the
    workers, at the first update)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator

    checks = (
        (f"{ACTOR}.policy_loss.loss_mode", set(POLICY_LOSS_REGISTRY)),
        ("algorithm.adv_estimator", set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator}),
    )
    for key, known in checks:
        value = _select(config, key)
        if value is not None and value not in known:
            close = difflib.get_close_matches(str(value), sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginConfigError(
                f"{key}={value!r} is not registered with verl{hint}; valid: {', '.join(sorted(known))}"
            )
