"""Start-up checks of the plugin's settings: each mistake stops before Ray starts, naming the key and the fix.

:func:`validate_plugin_config` runs in the launcher on the config that will run (after the preset, HeteroRL and
CPU settings were filled in), before anything is printed (``--cfg job``) or started. It imports verl's trainer
stack only to look up a trainer that neither verl nor the plugin ships (a user's own ``trainer.v1.trainer_mode``,
:func:`_trainer_registry`), so a mistake is reported within seconds. Warnings (legal but probably unintended
settings) are returned for the launcher to print. :func:`check_paths` and :func:`check_registered_names` (which
imports verl's algorithm registries) run later, with the launcher's checks that need verl
(:func:`gepo_plugin.launch.check_before_start`).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from gepo_plugin.config_keys import (
    ACTOR,
    ACTOR_PIPELINE_PARALLEL,
    ACTOR_STRATEGY,
    ADV_ESTIMATOR,
    BNPO_OPTIONS,
    BYPASS_MODE,
    CALCULATE_LOG_PROBS,
    CHECKPOINT_ENGINE_BACKEND,
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    DELTA_L_OPTIONS,
    DEVICE,
    FULL_DETERMINISM,
    HETERO,
    HETERO_ENABLE,
    HYBRID_ENGINE,
    LOSS_MODE,
    MODEL_PATH,
    NORM_ADV_BY_STD,
    PARAMETER_SYNC_STEP,
    POLICY_LOSS,
    PPO_MINI_BATCH_SIZE,
    REWARD_FUNCTION,
    ROLLOUT_GPUS_PER_NODE,
    ROLLOUT_N,
    ROLLOUT_NNODES,
    TRAIN_BATCH_SIZE,
    TRAIN_FILES,
    TRAINER_MODE,
    USE_V1,
    VAL_FILES,
)
from gepo_plugin.config_tree import NO_USER_KEYS, UserKeys, leaves
from gepo_plugin.hetero.settings import HeteroSettings, rollout_replica_count
from gepo_plugin.maths.gepo import check_clip_range
from gepo_plugin.maths.options import GEPO_PLUS_FIELDS, M2PO_FIELDS, BNPOOptions, DeltaLOptions, PolicyLossOptions
from gepo_plugin.names import GEPO_LOSSES, GEPO_TRAINER_FOR_MODE, M2PO_LOSS, TRAINERS, VERL_TRAINER_MODES
from gepo_plugin.options import did_you_mean, parse_options
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_plugin.verl_glue.m2po_mini_batch import check_switch
from gepo_plugin.verl_glue.rollout_checks import check_rollout
from gepo_plugin.verl_glue.rollout_correction import check_rollout_correction

__all__ = ["PluginConfigError", "validate_plugin_config"]


#: Advantage estimators that compare the responses of one prompt (a group of one has no baseline but itself).
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "bnpo", "delta_l")
#: Devices of verl's own platforms (AMD GPUs are ``cuda`` too) plus the plugin's CPU backend.
KNOWN_DEVICES = ("cuda", "npu", "cpu")
#: Booleans the plugin reads or relies on (verl's own, plus ``hetero.*`` which its model checks).
BOOLEAN_KEYS = (BYPASS_MODE, NORM_ADV_BY_STD, CALCULATE_LOG_PROBS, FULL_DETERMINISM, HYBRID_ENGINE, USE_V1)


def _select(config: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default)


def _plain(node: Any) -> Any:
    """A config node as plain data (None stays None)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _is_ratio_or_coefficient(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return "clip_ratio" in last or "coef" in last


def check_numbers(config: DictConfig) -> None:
    """NaN is refused everywhere; infinity in clip ratios and coefficients (nothing of verl's or ours means it)."""
    container = OmegaConf.to_container(config, resolve=False)
    for key, value in leaves(container, into_lists=True):
        nonfinite = isinstance(value, float) and not math.isfinite(value)
        if nonfinite and (math.isnan(value) or _is_ratio_or_coefficient(key)):
            raise PluginConfigError(f"{key}={value}: must be a finite number")


def check_booleans(config: DictConfig) -> None:
    """A string such as ``no`` or ``off`` is refused, never read as true."""
    for key in BOOLEAN_KEYS:
        value = _select(config, key)
        if value is not None and not isinstance(value, bool):
            raise PluginConfigError(f"{key}={value!r}: must be true or false (write {key}=true or {key}=false)")


#: Trainer modes that verl or the plugin ships: known without importing verl's trainer stack.
SHIPPED_TRAINERS = frozenset((*VERL_TRAINER_MODES, *TRAINERS))


def _trainer_registry() -> dict[str, type]:
    """verl's registry of trainers, for a mode that neither verl nor the plugin ships (a user's own trainer): the only
    import of verl's trainer stack in :func:`validate_plugin_config`."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY  # lazy: verl's trainer stack (see the docstring)

    return TRAINER_REGISTRY


def check_names(config: DictConfig) -> None:
    """``trainer.device`` is one of verl's devices (``cuda`` also on AMD, ``npu``) or the plugin's ``cpu`` backend, and
    ``trainer.v1.trainer_mode`` names a registered trainer (verl's registry is imported only for a user's own mode);
    a wrong name is refused with the nearest right one."""
    device = _select(config, DEVICE, "cuda")
    mode = _select(config, TRAINER_MODE)
    if device not in KNOWN_DEVICES:
        given, known, framing = device, KNOWN_DEVICES, (" (", ")")
        message = f"{DEVICE}={device!r}: use one of {', '.join(KNOWN_DEVICES)}{{hint}}"
    elif mode not in SHIPPED_TRAINERS and mode not in (registered := SHIPPED_TRAINERS | set(_trainer_registry())):
        given, known, framing = mode, registered, ("; ", "")
        message = f"{TRAINER_MODE}={mode!r} is not a registered trainer{{hint}} Valid: {', '.join(sorted(registered))}"
    else:
        return
    raise PluginConfigError(message.format(hint=did_you_mean(given, known, *framing)))


def _check_clip_range(config: DictConfig) -> None:
    """The clip range, by the rule the loss itself applies (:func:`~gepo_plugin.maths.gepo.check_clip_range`)."""
    check_clip_range(_select(config, CLIP_RATIO_LOW), _select(config, CLIP_RATIO_HIGH), f"{ACTOR}.", PluginConfigError)


def _check_standalone_rollout(config: DictConfig) -> None:
    """separate_async generates on standalone replicas only; verl asserts this only after Ray starts."""
    if not str(_select(config, TRAINER_MODE)).endswith("separate_async"):
        return
    nodes, gpus = _select(config, ROLLOUT_NNODES, 0), _select(config, ROLLOUT_GPUS_PER_NODE, 0)
    if not (isinstance(nodes, int) and isinstance(gpus, int) and nodes > 0 and gpus > 0):
        raise PluginConfigError(
            f"{TRAINER_MODE}={_select(config, TRAINER_MODE)} generates on standalone rollout replicas, but "
            f"{ROLLOUT_NNODES}={nodes} and {ROLLOUT_GPUS_PER_NODE}={gpus}: set both to the samplers' nodes and "
            "GPUs per node (e.g. 1 and 8)"
        )


def _check_separate_async(config: DictConfig) -> None:
    """What verl's separate_async trainer asserts in its constructor, checked before Ray starts instead."""
    if not str(_select(config, TRAINER_MODE)).endswith("separate_async"):
        return
    batch = _select(config, TRAIN_BATCH_SIZE)
    mini = _select(config, PPO_MINI_BATCH_SIZE)
    sync_step = _select(config, PARAMETER_SYNC_STEP)
    if all(isinstance(v, int) for v in (batch, mini, sync_step)) and batch != sync_step * mini:
        raise PluginConfigError(
            f"separate_async needs {TRAIN_BATCH_SIZE} == {PARAMETER_SYNC_STEP} x "
            f"{PPO_MINI_BATCH_SIZE}, got {batch} != {sync_step} x {mini}: change one of them"
        )
    if _select(config, CHECKPOINT_ENGINE_BACKEND) == "naive":
        raise PluginConfigError(
            f"{CHECKPOINT_ENGINE_BACKEND}=naive works only when rollout and learner share processes; "
            "separate_async needs nccl, nixl, mooncake (GPU) or ray_mailbox (the CPU backend)"
        )


def _check_guard_has_weights(config: DictConfig, hetero: HeteroSettings) -> None:
    """The guard reads the step's ESS/N of ``p_i / q_i`` (``actor/gepo/ess_step``); only GEPO's losses report it."""
    loss_mode = _select(config, LOSS_MODE)
    if hetero.enable and hetero.guard.enable and loss_mode not in GEPO_LOSSES:
        raise PluginConfigError(
            f"{HETERO}.guard.enable=true reads the ESS/N of the trained batch's sequence ratios p_i/q_i, which the "
            f"{' and '.join(GEPO_LOSSES)} losses report (actor/gepo/ess_step), but {LOSS_MODE}={loss_mode}: use "
            f"algorithm.loss={GEPO_LOSSES[0]} (or {GEPO_LOSSES[1]}), or set {HETERO}.guard.enable=false"
        )


def _check_hetero_layout(config: DictConfig, hetero: HeteroSettings) -> None:
    """``hetero.sampler_groups`` / ``group_delays`` must fit the rollout replicas verl will start (checked on the
    settled config: the CPU backend sets the rollout's parallel size)."""
    if hetero.enable:
        hetero.group_sizes(*rollout_replica_count(config.actor_rollout_ref.rollout))


def _loss_modes_reading(option: str) -> tuple[str, ...]:
    """The loss modes that read ``policy_loss.<option>``."""
    if option in GEPO_PLUS_FIELDS:
        return ("gepo_plus",)
    return (M2PO_LOSS, *GEPO_LOSSES) if option in M2PO_FIELDS else GEPO_LOSSES


#: Option blocks that only one setting reads: a value given there while that setting is off would do nothing.
OWNED_BLOCKS = (
    (f"{HETERO}.", HETERO_ENABLE, (True,)),
    (f"{BNPO_OPTIONS}.", ADV_ESTIMATOR, ("bnpo",)),
    (f"{DELTA_L_OPTIONS}.", ADV_ESTIMATOR, ("delta_l",)),
    *((f"{POLICY_LOSS}.{name}", LOSS_MODE, _loss_modes_reading(name)) for name in PolicyLossOptions.model_fields),
)


def check_nothing_ignored(config: DictConfig, explicit: UserKeys) -> None:
    """A setting given on the command line that nothing will read is a mistake (e.g. hetero.* without
    hetero.enable=true): refuse it instead of ignoring it silently."""
    for prefix, switch, needed in OWNED_BLOCKS:
        given = [key for key in explicit.under(prefix) if key != switch]
        value = _select(config, switch)
        if given and value not in needed:
            choices = " or ".join(str(option).lower() for option in needed)
            raise PluginConfigError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set, but {switch}={value}, so nothing "
                f"would read {'it' if len(given) == 1 else 'them'}: set {switch}={choices} or remove "
                f"{'it' if len(given) == 1 else 'them'}"
            )


def _check_several_responses(config: DictConfig, needs: str, note: str) -> None:
    """The one rule for ``rollout.n``: a whole number, at least 2 where something compares the responses to one
    prompt (``needs``: what does and why it needs several; ``note``: advice or what would go wrong)."""
    n = _select(config, ROLLOUT_N, 1)
    if isinstance(n, bool) or not isinstance(n, int):
        raise PluginConfigError(f"{ROLLOUT_N}={n!r}: must be a whole number of responses per prompt")
    if n < 2:
        raise PluginConfigError(f"{ROLLOUT_N}={n}: {needs}; set {ROLLOUT_N} >= 2 ({note})")


def _computes_group_term(mode: str) -> bool:
    """Does the trainer of ``mode`` compute GEPO's per-prompt group term? The plugin's GEPO trainers do, verl's and
    the HeteroRL trainer do not (:mod:`gepo_plugin.names`); a user's own trainer does if it has the mixin."""
    if mode in SHIPPED_TRAINERS:
        return mode in GEPO_TRAINER_FOR_MODE.values()
    from gepo_plugin.verl_glue.trainers import ResponseTermsMixin  # lazy, as in _trainer_registry

    cls = _trainer_registry().get(mode)
    return cls is not None and issubclass(cls, ResponseTermsMixin)


def _option_blocks(config: DictConfig) -> dict[str, BaseModel]:
    """Every option block of the plugin's losses and estimators, parsed (each refused with its key if it is wrong):
    GEPO's fields of ``policy_loss``, BNPO's and Delta-L's blocks."""
    policy_loss = {k: v for k, v in (_select(config, POLICY_LOSS) or {}).items() if k in PolicyLossOptions.model_fields}
    blocks = {
        POLICY_LOSS: (PolicyLossOptions, policy_loss),
        **{
            key: (model, _plain(_select(config, key)))
            for model, key in ((BNPOOptions, BNPO_OPTIONS), (DeltaLOptions, DELTA_L_OPTIONS))
        },
    }
    return {key: parse_options(model, block, key, PluginConfigError) for key, (model, block) in blocks.items()}


def _check_gepo(config: DictConfig, options: PolicyLossOptions, warnings: list[str]) -> None:
    mode, loss_mode = _select(config, TRAINER_MODE), _select(config, LOSS_MODE)
    if options.group_scope == "prompt" and not _computes_group_term(mode):
        suggestion = GEPO_TRAINER_FOR_MODE.get(mode)
        fix = (
            f"set {TRAINER_MODE}={suggestion} (or use algorithm.loss={loss_mode}, which does)"
            if suggestion
            else (f"use one of {', '.join(GEPO_TRAINER_FOR_MODE.values())}")
        )
        raise PluginConfigError(
            f"{LOSS_MODE}={loss_mode} needs the per-prompt group term, but {TRAINER_MODE}={mode} "
            f"does not compute it: {fix}, or set {POLICY_LOSS}.group_scope=batch to reproduce the "
            "reference code's micro-batch scope."
        )
    _check_several_responses(
        config, "GEPO's group expectation runs over several responses to one prompt", "the paper used 8"
    )
    if not _select(config, BYPASS_MODE, False):
        warnings.append(
            f"loss_mode={loss_mode} without {BYPASS_MODE}=true: q is the recomputed old policy, not the sampler's "
            "log-probs the paper's weight is defined with (in the lab's stale comparison, GEPO with verl's decoupled "
            "sequence-level truncated IS collapsed at max lags 64 and 256 in 20 of 20 seeds; see the Results page)"
        )


def _check_m2_options_read(options: PolicyLossOptions, explicit: UserKeys) -> None:
    """M2PO's cap options given to a GEPO loss without ``m2_mask=true`` would do nothing: refuse them."""
    given = [key for name in M2PO_FIELDS for key in explicit.under(f"{POLICY_LOSS}.{name}")]
    if given and not options.m2_mask:
        raise PluginConfigError(
            f"{', '.join(given)} set, but {POLICY_LOSS}.m2_mask=false, so the GEPO loss would not read it: set "
            f"{POLICY_LOSS}.m2_mask=true (M2PO's mask on GEPO's weights) or remove it"
        )


def _check_m2_cap(config: DictConfig, options: PolicyLossOptions) -> None:
    """Where a loss reads M2PO's cap over whole mini-batches, what hands it over must be there."""
    if options.m2_scope == "mini_batch":
        mode = _select(config, TRAINER_MODE)
        if not _computes_group_term(mode):
            suggestion = GEPO_TRAINER_FOR_MODE.get(mode)
            fix = (
                f"set {TRAINER_MODE}={suggestion} (or use algorithm.loss=m2po, which does)"
                if suggestion
                else (f"use one of {', '.join(GEPO_TRAINER_FOR_MODE.values())}")
            )
            raise PluginConfigError(
                f"{POLICY_LOSS}.m2_scope=mini_batch hands each micro-batch's loss the mini-batch's cap through the "
                f"plugin's loss wrapper, which {TRAINER_MODE}={mode} does not install: {fix}, or set "
                f"{POLICY_LOSS}.m2_scope=micro_batch (the authors' scope)"
            )
        pipeline = _select(config, ACTOR_PIPELINE_PARALLEL, 1)
        if _select(config, ACTOR_STRATEGY) == "megatron" and isinstance(pipeline, int) and pipeline > 1:
            raise PluginConfigError(
                f"{POLICY_LOSS}.m2_scope=mini_batch measures the mini-batch with every rank's log-probs, which "
                f"pipeline-parallel stages other than the last do not have ({ACTOR_PIPELINE_PARALLEL}={pipeline}): "
                f"set {POLICY_LOSS}.m2_scope=micro_batch or {ACTOR_PIPELINE_PARALLEL}=1"
            )
        check_switch(config)


def _check_m2po(config: DictConfig, options: PolicyLossOptions, warnings: list[str]) -> None:
    _check_m2_cap(config, options)
    if not _select(config, BYPASS_MODE, False):
        warnings.append(
            f"loss_mode={M2PO_LOSS} without {BYPASS_MODE}=true: the old log-probs are the learner's recomputed ones, "
            "not the behaviour policy's (the sampler's) that M2PO's ratio is defined with"
        )


def validate_plugin_config(config: DictConfig, hetero: HeteroSettings, explicit: UserKeys = NO_USER_KEYS) -> list[str]:
    """Raise :class:`PluginConfigError` for settings that cannot work; return warnings for odd but legal ones.

    ``hetero``: the ``hetero`` block as the launcher parsed it (once); ``explicit``: the keys the user set on the
    command line (settings nothing would read are refused).
    """
    warnings: list[str] = []
    check_booleans(config)
    check_numbers(config)
    check_names(config)
    check_rollout(config)
    _check_clip_range(config)
    _check_standalone_rollout(config)
    _check_separate_async(config)
    check_nothing_ignored(config, explicit)
    options = _option_blocks(config)
    _check_hetero_layout(config, hetero)
    _check_guard_has_weights(config, hetero)
    if _select(config, BYPASS_MODE, False) and _select(config, CALCULATE_LOG_PROBS) is False:
        raise PluginConfigError(
            f"{BYPASS_MODE}=true uses the sampler's log-probs as the old policy, but {CALCULATE_LOG_PROBS}="
            f"false means the sampler returns none: set {CALCULATE_LOG_PROBS}=true (GEPO needs them), or "
            f"{BYPASS_MODE}=false"
        )
    check_rollout_correction(config)
    if _select(config, LOSS_MODE, "vanilla") in GEPO_LOSSES:
        _check_gepo(config, options[POLICY_LOSS], warnings)
        _check_m2_options_read(options[POLICY_LOSS], explicit)
        if options[POLICY_LOSS].m2_mask:
            _check_m2_cap(config, options[POLICY_LOSS])
    if _select(config, LOSS_MODE) == M2PO_LOSS:
        _check_m2po(config, options[POLICY_LOSS], warnings)
    estimator = _select(config, ADV_ESTIMATOR)
    if estimator in GROUP_ESTIMATORS:
        needs = f"{ADV_ESTIMATOR}={estimator} compares the responses to one prompt"
        _check_several_responses(config, needs, "with one, every advantage is 0")
    return warnings


#: Files the run reads: a missing one fails only after Ray and the workers started.
DATA_FILE_KEYS = (TRAIN_FILES, VAL_FILES)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith(("file://", "pkg://"))


def missing_local_files(config: DictConfig) -> list[str]:
    """What the run would read from this machine and cannot find: the model, the data files, the reward file.

    Remote URLs and Hub ids are not checked. A list, not an error: inspecting a cluster's command on a laptop
    (``--cfg job``) reports them as warnings, a run refuses them (:func:`check_paths`).
    """
    missing = []
    model = _select(config, MODEL_PATH)
    if isinstance(model, str) and not _is_remote(model):
        local = os.path.expanduser(model)
        if not os.path.exists(local) and (
            os.path.isabs(local) or model.startswith((".", "~")) or not _HUB_ID.match(model)
        ):
            missing.append(f"{MODEL_PATH}={model!r} is neither a local folder nor a Hugging Face Hub id (org/name)")
    for key in DATA_FILE_KEYS:
        value = _select(config, key)
        paths = [value] if isinstance(value, str) else list(value or [])
        for path in paths:
            if isinstance(path, str) and not _is_remote(path) and not os.path.exists(os.path.expanduser(path)):
                missing.append(f"{key}: {path!r} does not exist (give the parquet files of your data set)")
    reward = _select(config, f"{REWARD_FUNCTION}.path")
    if reward and not str(reward).startswith("pkg://") and not os.path.isfile(os.path.expanduser(str(reward))):
        missing.append(f"{REWARD_FUNCTION}.path={reward!r} does not exist")
    return missing


def check_paths(config: DictConfig, inspecting: bool = False) -> list[str]:
    """The model, the data files and the reward function exist, and the reward function is defined in its file.

    ``inspecting`` (``--cfg``, ``--package``, ``--resolve``: the config is only printed): files missing on this
    machine are returned as warnings that say a run refuses them; otherwise they raise :class:`PluginConfigError`.
    """
    missing = missing_local_files(config)
    if missing and not inspecting:
        raise PluginConfigError("; ".join(missing))
    warnings = [f"{problem} on this machine: a run refuses it (only printing here)" for problem in missing]
    if not any(problem.startswith(f"{REWARD_FUNCTION}.path=") for problem in missing):
        _check_reward_function(config)
    return warnings


def _check_reward_function(config: DictConfig) -> None:
    path, name = _select(config, f"{REWARD_FUNCTION}.path"), _select(config, f"{REWARD_FUNCTION}.name")
    if not path:
        return
    if str(path).startswith("pkg://"):
        module = str(path)[len("pkg://") :]
        if importlib.util.find_spec(module) is None:
            raise PluginConfigError(f"{REWARD_FUNCTION}.path={path!r}: no module {module!r} is installed")
        return
    file = os.path.expanduser(str(path))  # exists (missing_local_files)
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
        hint = did_you_mean(name, defined)
        raise PluginConfigError(f"{REWARD_FUNCTION}.name={name!r} is not defined in {path}{hint}")


def check_registered_names(config: DictConfig) -> None:
    """The policy loss and the advantage estimator are registered with verl (verl looks them up only in the
    workers, at the first update)."""
    # lazy: verl's registries, with the launcher's later checks that need verl (see the docstring)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator

    checks = (
        (LOSS_MODE, set(POLICY_LOSS_REGISTRY)),
        (ADV_ESTIMATOR, set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator}),
    )
    for key, known in checks:
        value = _select(config, key)
        if value is not None and value not in known:
            hint = did_you_mean(value, known)
            raise PluginConfigError(
                f"{key}={value!r} is not registered with verl{hint}; valid: {', '.join(sorted(known))}"
            )
