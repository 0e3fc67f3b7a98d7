"""Every config key the plugin reads or writes, named once: a key renamed by verl is changed here and nowhere else.

Keys are dotted paths of verl's Hydra tree (``trainer.v1.trainer_mode``) as ``OmegaConf.select`` and the command
line spell them. The plugin's own blocks (``algorithm.loss``, ``hetero``, GEPO's options beside verl's policy-loss
keys) are here too. Plain strings, no imports: every layer may use them.
"""

from __future__ import annotations

# ---------------------------------------------------------------- subtrees
ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"
CRITIC = "critic"
POLICY_LOSS = f"{ACTOR}.policy_loss"
SAMPLER = "trainer.v1.sampler"
RAY_INIT = "ray_kwargs.ray_init"
#: Environment variables of every Ray process of a run.
RAY_ENV_VARS = f"{RAY_INIT}.runtime_env.env_vars"
RAY_NUM_CPUS = f"{RAY_INIT}.num_cpus"
RAY_NUM_GPUS = f"{RAY_INIT}.num_gpus"
TRANSFER_QUEUE_STORAGE_UNITS = "transfer_queue.backend.SimpleStorage.num_data_storage_units"
#: The roles that own a model engine (each has ``<role>.strategy`` and, under Megatron, ``<role>.megatron``).
ENGINE_ROLES = (ACTOR, REF, CRITIC)

# ---------------------------------------------------------------- the loss and its family
ALGORITHM_LOSS = "algorithm.loss"
LOSS_MODE = f"{POLICY_LOSS}.loss_mode"
GROUP_SCOPE = f"{POLICY_LOSS}.group_scope"
M2_SCOPE = f"{POLICY_LOSS}.m2_scope"
M2_MASK = f"{POLICY_LOSS}.m2_mask"
LOSS_AGG_MODE = f"{ACTOR}.loss_agg_mode"
CLIP_RATIO_LOW = f"{ACTOR}.clip_ratio_low"
CLIP_RATIO_HIGH = f"{ACTOR}.clip_ratio_high"
ACTOR_STRATEGY = f"{ACTOR}.strategy"
ACTOR_PIPELINE_PARALLEL = f"{ACTOR}.megatron.pipeline_model_parallel_size"
PPO_MINI_BATCH_SIZE = f"{ACTOR}.ppo_mini_batch_size"
ADV_ESTIMATOR = "algorithm.adv_estimator"
NORM_ADV_BY_STD = "algorithm.norm_adv_by_std_in_grpo"
ROLLOUT_CORRECTION = "algorithm.rollout_correction"
BYPASS_MODE = f"{ROLLOUT_CORRECTION}.bypass_mode"
BNPO_OPTIONS = "algorithm.bnpo"
DELTA_L_OPTIONS = "algorithm.delta_l"

# ---------------------------------------------------------------- the trainer
TRAINER_MODE = "trainer.v1.trainer_mode"
DEVICE = "trainer.device"
USE_V1 = "trainer.use_v1"
TRAINER_NNODES = "trainer.nnodes"
TRAINER_GPUS_PER_NODE = "trainer.n_gpus_per_node"
CHECKPOINT_DIR = "trainer.default_local_dir"
PARAMETER_SYNC_STEP = "trainer.v1.separate_async.parameter_sync_step"
HYBRID_ENGINE = "actor_rollout_ref.hybrid_engine"
CUSTOM_SAMPLER_PATH = f"{SAMPLER}.custom_sampler.path"
CUSTOM_SAMPLER_NAME = f"{SAMPLER}.custom_sampler.name"
SAMPLER_KWARGS = f"{SAMPLER}.sampler_kwargs"
MAX_OFF_POLICY_THRESHOLD = f"{SAMPLER}.max_off_policy_threshold"
MAX_OFF_POLICY_STRATEGY = f"{SAMPLER}.max_off_policy_strategy"

# ---------------------------------------------------------------- the rollout (samplers)
ROLLOUT_N = f"{ROLLOUT}.n"
ROLLOUT_NAME = f"{ROLLOUT}.name"
ROLLOUT_NNODES = f"{ROLLOUT}.nnodes"
ROLLOUT_GPUS_PER_NODE = f"{ROLLOUT}.n_gpus_per_node"
ROLLOUT_TENSOR_PARALLEL = f"{ROLLOUT}.tensor_model_parallel_size"
CALCULATE_LOG_PROBS = f"{ROLLOUT}.calculate_log_probs"
FULL_DETERMINISM = f"{ROLLOUT}.full_determinism"
CHECKPOINT_ENGINE_BACKEND = f"{ROLLOUT}.checkpoint_engine.backend"
#: A module verl imports in every process that builds a checkpoint engine (so a plugin's engine is registered).
CHECKPOINT_ENGINE_MODULE = f"{ROLLOUT}.checkpoint_engine.custom_backend_module"
CHECKPOINT_ENGINE_KWARGS = f"{ROLLOUT}.checkpoint_engine.engine_kwargs"
#: The CPU backend's transformers rollout options.
HF_ROLLOUT_OPTIONS = f"{ROLLOUT}.engine_kwargs.hf"
#: Its latency model (a modelled GPU's generation time).
HF_ROLLOUT_LATENCY = f"{HF_ROLLOUT_OPTIONS}.latency"

# ---------------------------------------------------------------- data, model, reward
TRAIN_BATCH_SIZE = "data.train_batch_size"
TRAIN_FILES = "data.train_files"
VAL_FILES = "data.val_files"
MODEL_PATH = f"{MODEL}.path"
MODEL_USE_REMOVE_PADDING = f"{MODEL}.use_remove_padding"
MODEL_ATTN_IMPLEMENTATION = f"{MODEL}.override_config.attn_implementation"
CRITIC_ATTN_IMPLEMENTATION = f"{CRITIC}.model.override_config.attn_implementation"
REWARD_FUNCTION = "reward.custom_reward_function"

# ---------------------------------------------------------------- HeteroRL
HETERO = "hetero"
HETERO_ENABLE = f"{HETERO}.enable"
HETERO_LEARNER_RESOURCE = f"{HETERO}.learner_resource"
HETERO_RELAY = f"{HETERO}.relay"
HETERO_RELAY_RUN_ID = f"{HETERO_RELAY}.run_id"
PROJECT_NAME = "trainer.project_name"
EXPERIMENT_NAME = "trainer.experiment_name"
