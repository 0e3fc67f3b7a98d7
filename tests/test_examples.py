"""examples/: the launch scripts parse and their commands resolve with the plugin's real config; the data
preparation writes what verl's loader reads; verl loads the math-verify reward the launch scripts name (the
reward's own cases are in test_math_reward.py).

The GPU runs themselves cannot happen here (no GPUs): what is checked is that every script is valid bash,
that its printed ``python -m gepo_plugin.main_ppo`` command composes with Hydra (``--cfg job``, the real CLI)
and, through ``prepare_config`` and verl's ``validate_config``, into the settings the script intends. The lab's
sensitivity sweep runs for real in its quick form, and every script's header says which test runs it (the Slurm
job and the launch scripts it calls: tests/test_slurm_e2e.py) or why none does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import cfg_job
import pytest
import yaml
from omegaconf import OmegaConf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHELL_FILES = sorted([*EXAMPLES.rglob("*.sh"), *EXAMPLES.rglob("*.sbatch")])
REWARD_PATH = "pkg://gepo_plugin.rewards.math_verify_reward"
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
EXTRA_OVERRIDE = "trainer.total_training_steps=7"  # appended by the test: "$@" must come last and win

# script -> (extra environment, what the resolved config must hold)
LAUNCHES: dict[str, tuple[dict[str, str], dict]] = {
    "hetero/run_qwen3_1.7b_gepo_math.sh": (
        {"LEARNER_NODES": "2", "SAMPLER_NODES": "3"},
        {
            "mode": "separate_async",
            "learner": (2, 8),
            "samplers": (3, 8),
            "hetero": True,
            "sampler_groups": [8, 8, 8],
            "sampler_kl_coef": 0.005,
        },
    ),
    "hetero/run_qwen3_1.7b_gepo_math_1node_8gpu.sh": (
        {},
        {
            "mode": "separate_async",
            "learner": (1, 4),
            "samplers": (1, 4),
            "hetero": True,
            "sampler_groups": None,
            "sampler_kl_coef": 0.005,
        },
    ),
    "hetero/run_qwen3_1.7b_gepo_math_megatron.sh": (
        {"LEARNER_NODES": "2", "SAMPLER_NODES": "2", "MEGATRON_TP": "2"},
        {
            "mode": "separate_async",
            "learner": (2, 8),
            "samplers": (2, 8),
            "hetero": True,
            "sampler_groups": [8, 8],
            "sampler_kl_coef": 0.005,
            "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
        },
    ),
    "hetero/run_qwen3_1.7b_gepo_math_relay.sh": (
        {"LEARNER_NODES": "1", "SAMPLER_NODES": "2", "RELAY_URL": "s3://gepo-bucket/runs"},
        {
            "mode": "separate_async",
            "learner": (1, 8),
            "samplers": (2, 8),
            "hetero": True,
            "sampler_groups": [8, 8],
            "sampler_kl_coef": 0.005,
            "relay": "s3://gepo-bucket/runs",
        },
    ),
    "remote/run_qwen3_1.7b_gepo_math_remote.sh": (
        {
            "LEARNER_NODES": "1",
            "SAMPLER_NODES": "1",
            "RELAY_URL": "s3://gepo-bucket/runs",
            "REMOTE_SAMPLERS": "dc-west:GEPO_SAMPLER_DC_WEST,dc-east:GEPO_SAMPLER_DC_EAST",
            "RELAY_PUBLIC_KEY": "0f6b7be6c88e661934d40dbc6f4408449ca50e6bc9d86551cb16ed783de8cefb",
        },
        {
            "mode": "separate_async",
            "learner": (1, 8),
            "samplers": (1, 8),
            "hetero": True,
            "sampler_groups": [8],
            "sampler_kl_coef": 0.005,
            "relay": "s3://gepo-bucket/runs",
            "remote": ["dc-west", "dc-east"],
        },
    ),
    "sync/run_qwen3_1.7b_gepo_math_sync.sh": (
        {},
        {"mode": "sync", "learner": (1, 8), "hetero": False, "sampler_kl_coef": 0.0},
    ),
    "slurm/gepo_hetero.sbatch": (
        {"SLURM_JOB_NUM_NODES": "4", "LEARNER_NODES": "1"},
        {
            "mode": "separate_async",
            "learner": (1, 8),
            "samplers": (3, 8),
            "hetero": True,
            "sampler_groups": [8, 8, 8],
            "sampler_kl_coef": 0.005,
        },
    ),
}
# `python -m gepo_plugin.main_ppo <overrides> --cfg job` for these (tests/cfg_job.py: one interpreter, runpy)
CFG_JOB_SCRIPTS = [name for name in LAUNCHES if name.endswith(".sh")]


def script_env(tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    """A clean environment (no knobs inherited from the caller's shell) with dummy paths."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp),
        "PRINT_ONLY": "1",
        "PYTHON": "python",
        "DATA_DIR": str(tmp / "data"),
        **extra,
    }


def printed_overrides(name: str, tmp: Path) -> list[str]:
    env, _ = LAUNCHES[name]
    result = subprocess.run(
        ["bash", str(EXAMPLES / name), EXTRA_OVERRIDE],
        env=script_env(tmp, env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip().splitlines()[-1])
    assert "gepo_plugin.main_ppo" in words, result.stdout
    overrides = words[words.index("gepo_plugin.main_ppo") + 1 :]
    assert overrides[-1] == EXTRA_OVERRIDE
    return overrides


# session-scoped: xdist interleaves other modules' tests, which would tear a module fixture down and redo its work
@pytest.fixture(scope="session")
def overrides_by_script(tmp_path_factory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("launch")
    # the launcher checks that the data files exist before anything starts (prepare_math.py would write them)
    (tmp / "data").mkdir()
    for name in ("train.parquet", "test.parquet"):
        (tmp / "data" / name).touch()
    return {name: printed_overrides(name, tmp) for name in LAUNCHES}


@pytest.fixture(scope="session")
def cfg_jobs(overrides_by_script, tmp_path_factory):
    """Start resolving every launch command with the CLI's ``--cfg job`` (in the background, one process)."""
    jobs = [(name, overrides_by_script[name]) for name in CFG_JOB_SCRIPTS]
    process, collect = cfg_job.start(jobs, tmp_path_factory.mktemp("cfg_job"))
    yield collect
    cfg_job.stop(process)


# ---------------------------------------------------------------- scripts


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: str(path.relative_to(EXAMPLES)))
def test_every_example_script_is_valid_bash(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    text = path.read_text()
    if text.startswith("# Sourced by"):  # a fragment the scripts share: it runs inside their `set -euo pipefail`
        return
    assert "set -euo pipefail" in text
    assert "PRINT_ONLY" in text


def test_the_expected_scripts_exist():
    names = {str(path.relative_to(EXAMPLES)) for path in SHELL_FILES}
    assert set(LAUNCHES) | {"ray/start_head.sh", "ray/start_worker.sh"} <= names


def test_launch_scripts_print_their_command(overrides_by_script, cfg_jobs):
    # (requesting cfg_jobs starts the `--cfg job` subprocesses now, so they run while the other tests do)
    for name, overrides in overrides_by_script.items():
        keys = [override.split("=", 1)[0] for override in overrides]
        assert "algorithm.loss" in keys, name
        assert f"reward.custom_reward_function.path={REWARD_PATH}" in overrides, name


def test_ray_scripts_print_ray_start(tmp_path):
    head = subprocess.run(
        ["bash", str(EXAMPLES / "ray/start_head.sh")],
        env=script_env(tmp_path, {"NODE_IP": "10.0.0.1", "NUM_GPUS": "8", "RAY_PORT": "6380"}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert head.returncode == 0, head.stderr
    words = shlex.split(head.stdout)
    assert words[:3] == ["ray", "start", "--head"]
    assert {"--port=6380", "--num-gpus=8", "--node-ip-address=10.0.0.1", "--labels=gepo-role=learner"} <= set(words)
    assert '--resources={"gepo_learner": 1}' in words  # the learner's nodes keep verl's services

    worker_env = {"RAY_HEAD_ADDRESS": "10.0.0.1:6380", "NUM_GPUS": "8", "NODE_IP": "10.0.0.2", "RAY_BLOCK": "1"}
    worker = subprocess.run(
        ["bash", str(EXAMPLES / "ray/start_worker.sh")],
        env=script_env(tmp_path, worker_env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert worker.returncode == 0, worker.stderr
    words = shlex.split(worker.stdout)
    assert {"--address=10.0.0.1:6380", "--labels=gepo-role=sampler", "--block"} <= set(words)
    assert not any(word.startswith("--resources") for word in words)  # a sampler node hosts only samplers

    missing = subprocess.run(
        ["bash", str(EXAMPLES / "ray/start_worker.sh")],
        env=script_env(tmp_path, {}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode != 0 and "RAY_HEAD_ADDRESS" in missing.stderr


def test_delay_can_be_switched_off(tmp_path):
    env, _ = LAUNCHES["hetero/run_qwen3_1.7b_gepo_math.sh"]
    result = subprocess.run(
        ["bash", str(EXAMPLES / "hetero/run_qwen3_1.7b_gepo_math.sh"), "--print-command"],
        env={**script_env(tmp_path, env), "PRINT_ONLY": "0", "DELAY": "none", "MAX_LAG": "4"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip().splitlines()[-1])
    assert "hetero.delay.distribution=none" in words and "hetero.max_lag=4" in words
    assert not any(word.startswith("hetero.delay.low") for word in words)


def run_script(name: str, tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``examples/<name>`` in :func:`script_env` with ``env`` added."""
    return subprocess.run(
        ["bash", str(EXAMPLES / name)], env=script_env(tmp, env), capture_output=True, text=True, timeout=30
    )


def test_the_megatron_script_refuses_a_layout_that_does_not_divide_the_learner_gpus(tmp_path):
    result = run_script("hetero/run_qwen3_1.7b_gepo_math_megatron.sh", tmp_path, {"MEGATRON_TP": "3"})
    assert result.returncode == 2 and "must divide the learner GPUs (8)" in result.stderr
    unknown = run_script("hetero/run_qwen3_1.7b_gepo_math.sh", tmp_path, {"LEARNER_ENGINE": "deepspeed"})
    assert unknown.returncode == 2 and "use fsdp or megatron" in unknown.stderr


# ------------------------------------------------- resolution with the plugin's config


def compose_and_prepare(overrides: list[str]):
    from gepo_plugin.launch import settled_config

    return settled_config(overrides)


def check_intent(config, expect: dict, *, prepared: bool) -> None:
    """The settings every launch script must carry (``config``: a DictConfig, or the ``--cfg job`` dict)."""
    config = OmegaConf.create(config) if isinstance(config, dict) else config

    def get(key):
        return OmegaConf.select(config, key, throw_on_missing=False)

    mode = expect["mode"]
    assert get("algorithm.loss") == "gepo"
    # the launcher maps verl's mode to the plugin's trainer with GEPO's per-prompt group term
    assert get("trainer.v1.trainer_mode") == (f"gepo_{mode}" if prepared else mode)
    assert (get("trainer.nnodes"), get("trainer.n_gpus_per_node")) == expect["learner"]
    assert get("hetero.enable") is expect["hetero"]
    assert get("actor_rollout_ref.actor.policy_loss.sampler_kl_coef") == expect["sampler_kl_coef"]
    assert get("trainer.total_training_steps") == 7  # the extra override passed to the script
    assert list(get("trainer.logger")) == ["console", "wandb"]
    assert get("reward.custom_reward_function.path") == REWARD_PATH
    assert get("reward.custom_reward_function.name") == "compute_score"
    assert get("reward.reward_model.enable") is False
    # the paper's settings (arXiv 2508.17850)
    assert get("data.train_batch_size") == 32 and get("actor_rollout_ref.rollout.n") == 8
    assert (get("data.max_prompt_length"), get("data.max_response_length")) == (768, 2048)
    assert get("actor_rollout_ref.actor.optim.lr") == 1e-6
    assert get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") == 0.03
    schedule = "lr_decay_style" if expect.get("megatron") else "lr_scheduler_type"  # megatron's optimizer's name
    assert get(f"actor_rollout_ref.actor.optim.{schedule}") == "constant"
    assert (get("actor_rollout_ref.actor.clip_ratio_low"), get("actor_rollout_ref.actor.clip_ratio_high")) == (0.2, 0.2)
    assert get("actor_rollout_ref.actor.use_kl_loss") is False
    rollout = "actor_rollout_ref.rollout"
    assert (get(f"{rollout}.temperature"), get(f"{rollout}.top_p"), get(f"{rollout}.top_k")) == (0.6, 0.95, 20)
    assert get(f"{rollout}.name") == "vllm"
    assert (get(f"{rollout}.val_kwargs.n"), get(f"{rollout}.val_kwargs.temperature")) == (8, 0.6)
    assert get("trainer.test_freq") == 64
    if mode == "separate_async":
        assert (get(f"{rollout}.nnodes"), get(f"{rollout}.n_gpus_per_node")) == expect["samplers"]
        relay = expect.get("relay")
        assert get(f"{rollout}.checkpoint_engine.backend") == ("relay" if relay else "nccl")
        sync_step = get("trainer.v1.separate_async.parameter_sync_step")
        # verl's separate_async trainer asserts this in its constructor
        assert get("data.train_batch_size") == sync_step * get("actor_rollout_ref.actor.ppo_mini_batch_size")
        assert get("hetero.max_lag") == 64 and get("hetero.strategy") == "wait"
        if relay:  # the delay is real: the samplers' downloads from the store
            assert get("hetero.transport") == "relay" and get("hetero.relay.url") == relay
            assert get("hetero.delay.distribution") == "none"
            assert get("hetero.relay.run_id") == f"gepo_hetero/{get('trainer.experiment_name')}"
            assert get(f"{rollout}.checkpoint_engine.engine_kwargs.relay.url") == relay
        else:
            assert get("hetero.delay.distribution") == "lognormal"
            delay = (get("hetero.delay.low"), get("hetero.delay.high"), get("hetero.delay.confidence"))
            assert delay == (60, 1920, 0.995)
        remote = [entry["name"] for entry in (get("hetero.remote_samplers") or [])]
        assert remote == expect.get("remote", [])
        if remote:  # signed manifests: the samplers outside the cluster verify with the public key alone
            assert get("hetero.relay.signing_key_env") == "GEPO_RELAY_SIGNING_KEY" and get("hetero.relay.public_key")
        groups = get("hetero.sampler_groups")
        assert (None if groups is None else list(groups)) == expect["sampler_groups"]
        if groups is not None:  # one entry per sampler group; all standalone replicas are covered
            samplers, gpus = expect["samplers"]
            assert sum(groups) == samplers * gpus // get(f"{rollout}.tensor_model_parallel_size")
        assert get("actor_rollout_ref.hybrid_engine") is False
    megatron = expect.get("megatron")
    assert get("actor_rollout_ref.actor.strategy") == ("megatron" if megatron else "fsdp")
    for key, value in (megatron or {}).items():
        assert get(f"actor_rollout_ref.actor.megatron.{key}") == value, key
    if megatron:  # a GPU run keeps verl's GPU settings: the CPU backend's Megatron settings are not applied
        assert get("actor_rollout_ref.actor.megatron.use_distributed_optimizer") is True
        assert get("actor_rollout_ref.model.use_remove_padding") is True
        assert get("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend") != "local"
    if prepared:
        actor = "actor_rollout_ref.actor"
        assert get(f"{actor}.policy_loss.loss_mode") == "gepo"
        assert get(f"{actor}.policy_loss.group_scope") == "prompt"
        assert get(f"{actor}.loss_agg_mode") == "seq-mean-token-mean"
        assert get("algorithm.adv_estimator") == "grpo"
        assert get("algorithm.norm_adv_by_std_in_grpo") is False
        assert get("algorithm.rollout_correction.bypass_mode") is True


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_launch_config_passes_the_plugin_and_verl_checks(name, overrides_by_script):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config = compose_and_prepare(overrides_by_script[name])
    check_intent(config, LAUNCHES[name][1], prepared=True)
    assert not need_reference_policy(config) and not need_critic(config)
    validate_config(config, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "gepo"
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert rollout.n == 8
    backend = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine).backend
    assert backend in (("relay",) if LAUNCHES[name][1].get("relay") else ("nccl", "naive"))
    # the plugin's own parser of the hetero block (what its sampler runs at start-up)
    from gepo_plugin.hetero.settings import parse_hetero

    settings = parse_hetero(OmegaConf.to_container(config.hetero, resolve=True))
    assert settings.enable is LAUNCHES[name][1]["hetero"]
    if settings.enable:
        assert settings.policy.max_lag == 64
        assert settings.simulates_delay is not bool(LAUNCHES[name][1].get("relay"))
        replicas = rollout.nnodes * rollout.n_gpus_per_node // rollout.tensor_model_parallel_size
        sizes = settings.group_sizes(replicas)  # raises when sampler_groups does not cover the replicas
        assert sum(sizes) == replicas


# ---------------------------------------------------------------- data preparation


def load_prepare_math():
    spec = importlib.util.spec_from_file_location("prepare_math", EXAMPLES / "data/prepare_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_math_help_explains_every_option(capsys):
    module = load_prepare_math()
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--input", "--dataset", "--split", "--data-files", "--question-key", "--answer-key", "--output"):
        assert option in text
    for action in module.build_parser()._actions:
        assert action.help, action.option_strings


def test_prepare_math_on_a_local_jsonl(tmp_path):
    import pandas as pd
    import pyarrow.parquet as pq

    source = tmp_path / "tiny.jsonl"
    rows = [
        {"problem": "What is 1/2 + 0?", "solution": "\\frac{1}{2}", "level": 3},
        {"problem": "Compute 2+2.", "solution": "So the sum is \\boxed{4}.", "level": 1},
        {"problem": "Nested?", "solution": "\\boxed{\\frac{1}{\\sqrt{2}}}", "level": 5},
    ]
    source.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    output = tmp_path / "out" / "train.parquet"
    module = load_prepare_math()
    argv = ["--input", str(source), "--output", str(output), "--question-key", "problem", "--answer-key", "solution"]
    assert module.main([*argv, "--keep-keys", "level"]) == 0

    table = pq.read_table(output)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    frame = pd.read_parquet(output)
    assert len(frame) == 3
    assert list(frame["data_source"]) == ["tiny"] * 3
    assert list(frame["ability"]) == ["math"] * 3
    truths = [row["ground_truth"] for row in frame["reward_model"]]
    # the last \boxed{} of a solution becomes the ground truth; a bare answer is kept as it is
    assert truths == ["\\frac{1}{2}", "4", "\\frac{1}{\\sqrt{2}}"]
    assert all(row["style"] == "rule" for row in frame["reward_model"])
    assert [(row["split"], row["index"], row["level"]) for row in frame["extra_info"]] == [
        ("train", 0, 3),
        ("train", 1, 1),
        ("train", 2, 5),
    ]
    for messages, row in zip(frame["prompt"], rows, strict=True):
        assert len(messages) == 1 and messages[0]["role"] == "user"
        assert messages[0]["content"] == f"{row['problem']} {BOXED_INSTRUCTION}"

    # verl's own RL dataset reads it (chat template applied by a local tokenizer: nothing is downloaded)
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from gepo_plugin.tiny import build_tokenizer

    dataset = RLHFDataset(
        data_files=[str(output)],
        tokenizer=build_tokenizer(),
        config=OmegaConf.create({"max_prompt_length": 512, "cache_dir": str(tmp_path / "cache")}),
    )
    assert len(dataset) == 3
    item = dataset[1]
    assert item["reward_model"]["ground_truth"] == "4"
    assert item["data_source"] == "tiny" and item["extra_info"]["index"] == 1

    # a missing key is reported with the keys that exist
    with pytest.raises(SystemExit, match="question"):
        module.main(["--input", str(source), "--output", str(tmp_path / "bad.parquet")])


# ---------------------------------------------------------------- reward


def test_verl_loads_the_reward_from_the_launch_config(overrides_by_script):
    """The launch config's reward path resolves with verl's loader (the reward's own cases: test_math_reward.py)."""
    pytest.importorskip("math_verify")
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = compose_and_prepare(overrides_by_script["hetero/run_qwen3_1.7b_gepo_math.sh"])
    function = get_custom_reward_fn(config)
    assert function(data_source="math", solution_str="\\boxed{4}", ground_truth="4", extra_info={})["score"] == 1.0


# ------------------------------------------------- the real CLI: `main_ppo ... --cfg job`


@pytest.mark.parametrize("name", CFG_JOB_SCRIPTS)
def test_launch_command_resolves_with_the_cli(name, cfg_jobs, overrides_by_script):
    """``--cfg job`` prints the config that runs: the preset, the HeteroRL wiring and every check are settled
    before Hydra prints, so the printout carries the prepared settings and equals the launcher's settled config."""
    results = cfg_jobs()
    code, text = results[name]
    assert code == 0, results["stderr"][1][-4000:]
    printed = yaml.safe_load(text)
    check_intent(printed, LAUNCHES[name][1], prepared=True)
    settled = OmegaConf.to_container(compose_and_prepare(overrides_by_script[name]), resolve=False)
    assert printed == settled


#: a lab script asked to print its commands instead of running them (into a folder never written)
PRINT_ONLY_ENV = {"PRINT_ONLY": "1", "PYTHON": "python", "OUT": "/tmp/never-written"}


def _printed_lab_configs(script: str, env: dict[str, str]) -> dict[str, dict]:
    """A lab script's PRINT_ONLY commands, parsed by gepo-lab's own parser: output folder -> resolved config."""
    from gepo_plugin.lab import stability as st
    from gepo_plugin.lab.cli import build_parser

    env = {**os.environ, **PRINT_ONLY_ENV, **env}
    result = subprocess.run(["bash", str(EXAMPLES / script)], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    resolved = {}
    for line in result.stdout.splitlines():
        words = shlex.split(line)
        assert words[:4] == ["python", "-m", "gepo_plugin.lab", "stability"], words
        args = build_parser().parse_args(words[3:])
        resolved[str(args.out.relative_to(PRINT_ONLY_ENV["OUT"]))] = st.config_from_args(args).model_dump()
    return resolved


def test_lab_sensitivity_sweep_runs_valid_lab_commands_one_change_each():
    """examples/lab/sensitivity.sh: every printed command parses with gepo-lab's own parser, resolves to a valid
    lab config, and differs from the ``base`` variant in exactly the setting its name says."""
    resolved = _printed_lab_configs("lab/sensitivity.sh", {})
    for config in resolved.values():
        assert (config["methods"], config["lags"], config["seeds"]) == (["gepo", "gspo", "grpo"], [64], [0, 1, 2])
    base = resolved.pop("base")
    expected = {
        "lr_3e-3": {"lr"},
        "lr_3e-4": {"lr"},
        "group_4": {"group_size"},
        "group_16": {"group_size"},
        "clip_0.1": {"clip"},
        "clip_0.4": {"clip"},
        "long_delays": {"delay_low", "delay_high"},
        "steps_400": {"rl_steps"},
    }
    assert set(resolved) == set(expected)
    for name, config in resolved.items():
        changed = {field for field in base if config[field] != base[field]}
        assert changed == expected[name], name
    unknown = subprocess.run(
        ["bash", str(EXAMPLES / "lab/sensitivity.sh"), "no_such_variant"],
        capture_output=True,
        text=True,
        env={**os.environ, **PRINT_ONLY_ENV},
    )
    assert unknown.returncode == 2 and "unknown variant" in unknown.stderr


@pytest.mark.parametrize("vllm_url", [None, "http://127.0.0.1:8000"], ids=["starts-vllm", "attaches"])
def test_the_sampler_host_script_prints_a_command_its_parser_takes(tmp_path, vllm_url):
    """examples/remote/sampler_host.sh: the command a remote machine runs, parsed and checked by the host's own
    parser; with VLLM_URL it attaches to that server instead of starting one (the host refuses both at once)."""
    from gepo_sampler.host.cli import build_parser, check

    variables = {
        "GATEWAY_URL": "https://learner.example.org:8471",
        "SAMPLER_NAME": "dc-west",
        "RELAY_PUBLIC_KEY": "ab" * 32,
        "CA_CERT": str(tmp_path / "ca.pem"),
        "GEPO_SAMPLER_TOKEN": "t" * 32,
    }
    env = script_env(tmp_path, variables | ({"VLLM_URL": vllm_url} if vllm_url else {}))
    (tmp_path / "ca.pem").write_text("")
    result = subprocess.run(
        ["bash", str(EXAMPLES / "remote/sampler_host.sh"), "--poll-s", "2"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[1:3] == ["-m", "gepo_sampler"]
    args = build_parser().parse_args(words[3:])
    assert (args.gateway, args.name, args.public_key) == ("https://learner.example.org:8471", "dc-west", "ab" * 32)
    assert (args.ca_cert, args.poll_s, args.storage_options) == (str(tmp_path / "ca.pem"), 2.0, "{}")
    if vllm_url is None:
        assert (args.vllm_url, args.model, args.dtype) == (None, "Qwen/Qwen3-1.7B", "bfloat16")
    else:
        assert (args.vllm_url, args.model) == (vllm_url, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GEPO_SAMPLER_TOKEN", variables["GEPO_SAMPLER_TOKEN"])
        assert check(args)[1] == {}  # the host's own checks take it: one of --model and --vllm-url, not both


def test_lab_sensitivity_sweep_runs_in_its_quick_form(tmp_path):
    """examples/lab/sensitivity.sh executed, in its quick form (two variants, one method, one seed, a few updates, two
    at a time): each variant's run holds the setting its name says, and the table has a row for each."""
    env = {
        **os.environ,
        **{"PYTHON": sys.executable, "OUT": str(tmp_path), "SEEDS": "0", "METHODS": "gepo", "STEPS": "4", "JOBS": "2"},
    }
    result = subprocess.run(
        ["bash", str(EXAMPLES / "lab/sensitivity.sh"), "base", "lr_3e-3"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lr = {}
    for variant in ("base", "lr_3e-3"):
        summary = json.loads((tmp_path / variant / "stability_summary.json").read_text())
        assert (summary["methods"], summary["lags"], summary["seeds"]) == (["gepo"], [64], [0])
        assert summary["config"]["rl_steps"] == 4
        lr[variant] = summary["config"]["lr"]
    assert lr == {"base": 1e-3, "lr_3e-3": 3e-3}
    table = (tmp_path / "sensitivity.md").read_text().splitlines()
    rows = [line for line in table[2:] if line.startswith("| ")]  # after the header and its rule
    assert [row.split("|")[1:3] for row in rows] == [[" base ", " gepo "], [" lr_3e-3 ", " gepo "]], rows


#: what a script's header says when a test runs it, or when none does (then why)
RUN_IN_CI, NOT_RUN = "Run in this repository's CI", "Not executed by the tests:"


@pytest.mark.parametrize(
    "path",
    [
        path
        for path in sorted(EXAMPLES.rglob("*"))
        if path.suffix in (".sh", ".sbatch", ".py") and path.name != "common.sh"
    ],
    ids=lambda path: str(path.relative_to(EXAMPLES)),
)
def test_every_example_script_says_which_test_runs_it_or_why_none_does(path):
    """Each runnable script's header names the tests that execute it (which exist and name the script, or the script
    that calls it), or says why no test does (common.sh is sourced, never run)."""
    header = path.read_text()[:6000]
    assert (RUN_IN_CI in header) != (NOT_RUN in header), path
    if RUN_IN_CI in header:
        named = set(re.findall(r"tests/[\w/]+\.py", header))
        assert named, f"{path}: say which test runs it"
        for test in named:
            assert (ROOT / test).is_file(), (path, test)


def test_the_stale_setting_search_moves_the_sweep_to_long_delays_and_changes_one_setting_per_variant():
    """examples/lab/stale_search.sh: grpo and gspo at max lags 0 and 256, delays on [64, 4096], 300 updates, and each
    variant one change from its base."""
    resolved = _printed_lab_configs("lab/stale_search.sh", {})
    base = resolved.pop("base")
    assert (base["methods"], base["lags"], base["seeds"], base["rl_steps"]) == (["grpo", "gspo"], [0, 256], [0, 1], 300)
    assert (base["delay_low"], base["delay_high"], base["eval_every"]) == (64.0, 4096.0, 20)
    expected = {"lr_2e-3": {"lr"}, "lr_3e-3": {"lr"}, "group_4": {"group_size"}, "hard_task": {"max_a"}}
    assert {name: {k for k in base if config[k] != base[k]} for name, config in resolved.items()} == expected


def test_the_stale_comparison_runs_in_its_quick_form_and_resumes(tmp_path):
    """examples/lab/stale_comparison.sh: its commands are the search's base setting at lags 0/64/256 for every method
    (and GEPO with verl's correction); executed in its quick form (one seed, two methods, 4 updates) it writes the
    paired tables, every method's intervals and the staleness plot, and a second call trains nothing again."""
    resolved = _printed_lab_configs("lab/stale_comparison.sh", {"SEEDS": "3"})
    plain, corrected = resolved["plain/seed_3"], resolved["decoupled_seq_is/seed_3"]
    assert plain["methods"] == ["gepo", "gepo_plus", "gspo", "grpo", "m2po", "gepo_m2"]
    assert corrected["methods"] == ["gepo"] and corrected["rollout_correction"] == "decoupled_seq_is"
    for config in (plain, corrected):
        assert (config["lags"], config["seeds"], config["rl_steps"]) == ([0, 64, 256], [3], 300)
        assert (config["delay_low"], config["delay_high"]) == (64.0, 4096.0)
    for method in ("grpo", "gspo"):  # the control: other methods under the same correction
        control = resolved.pop(f"control_decoupled_seq_is/{method}")
        assert (control["methods"], control["lags"], control["seeds"]) == ([method], [64, 256], [0, 1, 2])
        assert control["rollout_correction"] == "decoupled_seq_is" and control["delay_high"] == 4096.0
    env = {
        **os.environ,
        **{"PYTHON": sys.executable, "OUT": str(tmp_path), "SEEDS": "0", "METHODS": "gepo gepo_m2", "LAGS": "0 8"},
        **{"STEPS": "4", "JOBS": "2", "SETTING": "--preset ci", "CONTROL_SEEDS": ""},
    }
    script = ["bash", str(EXAMPLES / "lab/stale_comparison.sh")]
    first = subprocess.run(script, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = [line.split("|")[1:3] for line in (tmp_path / "intervals.md").read_text().splitlines()[2:]]
    names = ("gepo", "gepo_m2", "gepo+decoupled_seq_is")
    assert [(name.strip(), int(lag)) for name, lag in rows] == [(m, lag) for m in names for lag in (0, 8)]
    paired_rows = (tmp_path / "paired_gap.md").read_text().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in paired_rows] == ["gepo − gepo_m2"] * 2 + [
        "gepo − gepo+decoupled_seq_is"
    ] * 2
    assert (tmp_path / "staleness.png").stat().st_size > 10_000
    again = subprocess.run(script, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and "present: plain/seed_0" in again.stdout and "done:" not in again.stdout
