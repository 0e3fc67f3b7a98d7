"""algorithm.loss presets through Hydra compose, the plugin's validation and verl's validate_config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from gepo_plugin.launch import explicit_keys, settled_config
from gepo_plugin.verl_glue.presets import PRESETS, UnknownLossError
from gepo_plugin.verl_glue.validation import PluginConfigError

MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=4",
]


def composed(*overrides):
    return settled_config([*MICRO, *overrides])


def verl_validate(config):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_family_member_composes_and_passes_verls_validation(name):
    config = composed(f"algorithm.loss={name}")
    preset = PRESETS[name]
    for key, value in preset.settings.items():
        assert OmegaConf.select(config, key) == value, key
    verl_validate(config)
    # the actor config still converts to verl's dataclasses (policy_loss subclass included)
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == preset.settings["actor_rollout_ref.actor.policy_loss.loss_mode"]


def test_gepo_preset_selects_the_group_term_trainer_for_each_mode():
    standalone = [
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
    ]
    for mode in ("sync", "colocate_async", "separate_async"):
        config = composed("algorithm.loss=gepo", f"trainer.v1.trainer_mode={mode}", *standalone)
        assert config.trainer.v1.trainer_mode == f"gepo_{mode}"
    assert composed("algorithm.loss=gspo").trainer.v1.trainer_mode == "sync"


def test_paper_settings_of_the_gepo_preset():
    config = composed("algorithm.loss=gepo")
    actor = config.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "gepo"
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2)
    assert config.algorithm.norm_adv_by_std_in_grpo is False
    assert config.algorithm.rollout_correction.bypass_mode is True


def test_user_overrides_win_over_the_preset():
    config = composed(
        "algorithm.loss=gepo",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.005",
    )
    actor = config.actor_rollout_ref.actor
    assert actor.clip_ratio_high == 0.28 and actor.clip_ratio_low == 0.2
    assert actor.loss_agg_mode == "token-mean"
    assert actor.policy_loss.sampler_kl_coef == 0.005


def test_gmpo_uses_the_original_log_ratio_clip():
    actor = composed("algorithm.loss=gmpo").actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "geo_mean"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.4, 0.4)


def test_unknown_loss_lists_the_valid_names():
    with pytest.raises(UnknownLossError) as error:
        composed("algorithm.loss=gepoo")
    for name in PRESETS:
        assert name in str(error.value)


def test_gepo_without_the_group_term_trainer_fails_at_start_up():
    with pytest.raises(PluginConfigError, match="trainer_mode=gepo_sync"):
        composed("actor_rollout_ref.actor.policy_loss.loss_mode=gepo")
    # the documented alternatives pass
    composed("actor_rollout_ref.actor.policy_loss.loss_mode=gepo", "trainer.v1.trainer_mode=gepo_sync")
    composed(
        "actor_rollout_ref.actor.policy_loss.loss_mode=gepo", "actor_rollout_ref.actor.policy_loss.group_scope=batch"
    )


M2PO_SWITCH = "ray_kwargs.ray_init.runtime_env.env_vars.GEPO_M2PO_MINI_BATCH"


def test_m2po_over_mini_batches_gets_the_trainer_and_the_switch_it_needs():
    config = composed("algorithm.loss=m2po")
    assert config.trainer.v1.trainer_mode == "gepo_sync"
    assert OmegaConf.select(config, M2PO_SWITCH) == "1"
    assert config.actor_rollout_ref.actor.policy_loss.m2_scope == "mini_batch"
    assert config.algorithm.rollout_correction.bypass_mode is True
    # the authors' scope needs neither the measuring pass nor its switch
    assert (
        OmegaConf.select(
            composed("algorithm.loss=m2po", "actor_rollout_ref.actor.policy_loss.m2_scope=micro_batch"), M2PO_SWITCH
        )
        is None
    )
    # GEPO runs get no switch, unless they read M2PO's cap over mini-batches (M2PO's mask on GEPO's weights)
    assert OmegaConf.select(composed("algorithm.loss=gepo"), M2PO_SWITCH) is None
    masked = composed("algorithm.loss=gepo", "actor_rollout_ref.actor.policy_loss.m2_mask=true")
    assert OmegaConf.select(masked, M2PO_SWITCH) == "1"
    budget = "actor_rollout_ref.actor.policy_loss.m2_budget=0.1"
    assert composed("algorithm.loss=gepo_plus", "actor_rollout_ref.actor.policy_loss.m2_mask=true", budget)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["actor_rollout_ref.actor.policy_loss.loss_mode=m2po"], "m2_scope=mini_batch .*=sync does not install"),
        (["algorithm.loss=m2po", f"+{M2PO_SWITCH}='0'"], "GEPO_M2PO_MINI_BATCH='0'"),
        (["algorithm.loss=m2po", "actor_rollout_ref.actor.policy_loss.m2_budget=-1"], "m2_budget"),
        (["algorithm.loss=m2po", "actor_rollout_ref.actor.policy_loss.m2_scope=step"], "m2_scope"),
        (["algorithm.loss=gepo", "actor_rollout_ref.actor.policy_loss.m2_budget=0.1"], "m2_mask=false"),
        (["algorithm.loss=m2po", "actor_rollout_ref.actor.policy_loss.m2_mask=true"], "loss_mode=gepo"),
        (["algorithm.loss=gepo", "actor_rollout_ref.actor.policy_loss.m2_mask=yes"], "m2_mask"),
        (["algorithm.loss=m2po", "actor_rollout_ref.actor.policy_loss.group_scope=batch"], "loss_mode=gepo"),
    ],
)
def test_impossible_m2po_settings_are_refused_naming_the_key(overrides, match):
    with pytest.raises(PluginConfigError, match=match):
        composed(*overrides)


def test_m2po_over_mini_batches_refuses_megatron_pipeline_stages():
    stages = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"
    with pytest.raises(PluginConfigError, match="pipeline_model_parallel_size=2"):
        composed("algorithm.loss=m2po", "model_engine=megatron", stages)
    composed(
        "algorithm.loss=m2po",
        "model_engine=megatron",
        stages,
        "actor_rollout_ref.actor.policy_loss.m2_scope=micro_batch",
    )


@pytest.mark.parametrize(
    "override,match",
    [
        ("actor_rollout_ref.rollout.n=1", "rollout.n >= 2"),
        ("actor_rollout_ref.actor.clip_ratio_low=-0.1", "clip_ratio_low=-0.1: must be >= 0"),
        ("actor_rollout_ref.actor.clip_ratio_low=1.5", "must be < 1"),
        ("actor_rollout_ref.actor.policy_loss.sampler_kl_coef=-1", "sampler_kl_coef"),
        ("actor_rollout_ref.actor.policy_loss.group_scope=group", "group_scope"),
    ],
)
def test_impossible_gepo_settings_are_rejected(override, match):
    with pytest.raises(PluginConfigError, match=match):
        composed("algorithm.loss=gepo", override)


def test_a_group_estimator_needs_several_responses_by_the_same_rule_as_gepo():
    with pytest.raises(PluginConfigError, match=r"rollout\.n=1: algorithm\.adv_estimator=grpo compares the responses"):
        composed("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1")
    with pytest.raises(PluginConfigError, match=r"rollout\.n=1: GEPO's group expectation"):
        composed("algorithm.loss=gepo", "actor_rollout_ref.rollout.n=1")


def test_the_clip_range_is_one_rule_at_start_up_and_in_the_loss():
    from gepo_plugin.maths.gepo import GEPOInputError, check_clip_range

    with pytest.raises(PluginConfigError, match=r"actor_rollout_ref\.actor\.clip_ratio_low=1\.5: must be < 1"):
        composed("algorithm.loss=gepo", "actor_rollout_ref.actor.clip_ratio_low=1.5")
    with pytest.raises(GEPOInputError, match=r"^clip_ratio_low=1\.5: must be < 1"):
        check_clip_range(1.5, 0.2)
    check_clip_range(None, None)  # not set: nothing to check


def test_did_you_mean_names_the_nearest_choice_or_nothing():
    from gepo_plugin.options import did_you_mean

    assert did_you_mean("cpuu", ("cuda", "npu", "cpu")) == " (did you mean 'cpu'?)"
    assert did_you_mean("gepoo", {"gepo", "gspo"}, before="; ", after="") == "; did you mean 'gepo'?"
    assert did_you_mean("zzz", ("cuda",)) == ""


def test_bad_bnpo_and_delta_l_options_are_rejected():
    with pytest.raises(PluginConfigError, match="reward_max"):
        composed("algorithm.loss=bnpo", "algorithm.bnpo.reward_max=0")
    with pytest.raises(PluginConfigError, match="alpha"):
        composed("algorithm.loss=delta_l", "algorithm.delta_l.alpha=-1")


def test_policy_loss_dataclass_rejects_a_bad_group_scope_too():
    """Users of verl's own main_ppo skip the launcher: the dataclass still refuses nonsense."""
    from verl.utils.config import omega_conf_to_dataclass

    config = composed("algorithm.loss=gspo")
    config.actor_rollout_ref.actor.policy_loss.group_scope = "everything"
    with pytest.raises(Exception, match="group_scope"):
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def test_explicit_keys():
    keys = explicit_keys(["a.b=1", "+c.d=2", "++e=3", "~f.g", "hydra.run.dir=x"])
    assert keys == {"a.b", "c.d", "e", "f.g"}
