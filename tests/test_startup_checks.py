"""Every mistake stops at start-up, before Ray, naming the key (the launcher's real code path, in this process).

Each case is a valid tiny command line plus one mistake. The launcher must exit with status 2 and a message that
names the key, before it composes the run (so before Ray or anything else starts), and a valid command must get
through every check.
"""

from __future__ import annotations

import pytest
from cpu_runs import valid_gepo_command

from gepo_plugin import main_ppo
from gepo_plugin.tiny import write_all

pytestmark = pytest.mark.slow

ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
    "trainer.v1.separate_async.parameter_sync_step=1",
]
HETERO = [*ASYNC, "hetero.enable=true"]
#: HeteroRL with the weight relay (its own checkpoint engine); the store URL of a check that fails before the probe
RELAY = [*ASYNC[:4], *ASYNC[5:], "hetero.enable=true", "hetero.transport=relay"]
NOT_PROBED = "hetero.relay.url=/nonexistent/relay"
#: the relay with a key pair, as remote samplers need it (the store is not probed: its checks come first)
PUBLIC_KEY = "f29ccee11d3801e0f24e88fe1f9f330f82a63d1e0a675ec62706c83d3ab8fd6b"
REMOTE = [
    *RELAY,
    NOT_PROBED,
    "hetero.relay.signing_key_env=GEPO_TEST_SIGNING_KEY",
    f"hetero.relay.public_key={PUBLIC_KEY}",
]

# (name, mistake overrides, text the message must contain)
MISTAKES = [
    ("string read as boolean: no", ["hetero.enable=no"], "hetero.enable='no'"),
    ("string read as boolean: off", ["hetero.enable=off"], "hetero.enable='off'"),
    ("verl boolean given a string", ["algorithm.norm_adv_by_std_in_grpo=no"], "algorithm.norm_adv_by_std_in_grpo"),
    ("non-finite clip", ["actor_rollout_ref.actor.clip_ratio_high=nan"], "clip_ratio_high=nan"),
    ("infinite clip", ["actor_rollout_ref.actor.clip_ratio_low=inf"], "clip_ratio_low=inf"),
    ("non-finite coefficient", ["actor_rollout_ref.actor.policy_loss.sampler_kl_coef=inf"], "sampler_kl_coef=inf"),
    ("cap out of range", ["actor_rollout_ref.actor.policy_loss.log_ratio_cap=0"], "log_ratio_cap=0"),
    (
        "non-finite delay",
        [*HETERO, "hetero.delay.distribution=constant", "hetero.delay.seconds=inf"],
        "hetero.delay.seconds=inf",
    ),
    (
        "non-numeric delay",
        [*HETERO, "hetero.delay.distribution=constant", "hetero.delay.seconds=abc"],
        "hetero.delay.seconds='abc'",
    ),
    ("delay without a distribution", [*HETERO, "hetero.delay.seconds=5"], "distribution=none"),
    (
        "loss preset contradicted",
        ["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"],
        "algorithm.loss=gepo sets actor_rollout_ref.actor.policy_loss.loss_mode=gepo",
    ),
    ("device typo", ["trainer.device=cpuu"], "trainer.device='cpuu'"),
    ("rollout name typo", ["trainer.device=cpu", "actor_rollout_ref.rollout.name=vlm"], "did you mean 'vllm'"),
    ("rollout without a CPU build", ["trainer.device=cpu", "actor_rollout_ref.rollout.name=sglang"], "no CPU build"),
    ("rollout boolean given a string", ["actor_rollout_ref.rollout.enforce_eager=maybe"], "enforce_eager='maybe'"),
    ("context shorter than prompt + response", ["actor_rollout_ref.rollout.max_model_len=8"], "max_model_len=8 is"),
    ("unknown rollout dtype", ["actor_rollout_ref.rollout.dtype=float8"], "dtype='float8'"),
    (
        "tensor parallel on a CPU vLLM",
        [
            "trainer.device=cpu",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        ],
        "tensor_model_parallel_size=2",
    ),
    (
        "remote samplers without the relay",
        [*HETERO, "hetero.remote_samplers=[{name:far,token_env:GEPO_T}]"],
        "hetero.remote_samplers follow the weight relay",
    ),
    (
        "remote samplers without a key pair",
        [*RELAY, NOT_PROBED, "hetero.remote_samplers=[{name:far,token_env:GEPO_T}]"],
        "set hetero.relay.signing_key_env and hetero.relay.public_key",
    ),
    (
        "a remote sampler named twice",
        [*REMOTE, "hetero.remote_samplers=[{name:far,token_env:GEPO_T},{name:far,token_env:GEPO_U}]"],
        "names ['far'] more than once",
    ),
    ("a remote sampler's bad name", [*REMOTE, "hetero.remote_samplers=[{name:'a b',token_env:GEPO_T}]"], "name"),
    ("a gateway idle timeout of 0", [*HETERO, "hetero.gateway.idle_timeout_s=0"], "hetero.gateway.idle_timeout_s"),
    ("a wrong-token limit of 0", [*HETERO, "hetero.gateway.auth_failures_per_minute=0"], "auth_failures_per_minute"),
    ("a wrong-token limit as a float", [*HETERO, "hetero.gateway.auth_failures_per_minute=2.5"], "auth_failures"),
    ("an audit without remote samplers", [*HETERO, "hetero.audit.enable=true"], "hetero.remote_samplers is empty"),
    ("an audit share above 1", [*HETERO, "hetero.audit.fraction=2"], "hetero.audit.fraction"),
    ("an audit mode misspelt", [*HETERO, "hetero.audit.mode=holdd"], "hetero.audit.mode"),
    ("an audit switch as a string", [*HETERO, "hetero.audit.enable=yes"], "hetero.audit.enable"),
    ("a calibration margin below 1", [*HETERO, "hetero.audit.calibration_margin=0.5"], "calibration_margin"),
    ("a public key that is no key", [*RELAY, NOT_PROBED, "hetero.relay.public_key=abc"], "not hexadecimal"),
    (
        "paced-poll switch read as a boolean",
        ["+ray_kwargs.ray_init.runtime_env.env_vars.GEPO_PACED_REPLAY_POLL=yes"],
        "GEPO_PACED_REPLAY_POLL='yes'",
    ),
    (
        "GEPO without sampler log-probs",
        ["actor_rollout_ref.rollout.calculate_log_probs=false"],
        "actor_rollout_ref.rollout.calculate_log_probs",
    ),
    ("sampler groups do not add up", [*HETERO, "hetero.sampler_groups=[2,1]"], "hetero.sampler_groups=[2, 1] covers 3"),
    ("trainer mode typo", ["trainer.v1.trainer_mode=separate_asynch"], "did you mean 'separate_async'"),
    ("unknown loss", ["algorithm.loss=gepoo"], "did you mean 'gepo'"),
    ("hetero outside separate_async", ["hetero.enable=true"], "trainer.v1.trainer_mode=separate_async"),
    ("hetero option without hetero", ["hetero.max_lag=2"], "set hetero.enable=true"),
    ("bnpo option without bnpo", ["algorithm.bnpo.reward_max=2"], "algorithm.bnpo.reward_max is set"),
    ("bad group scope", ["actor_rollout_ref.actor.policy_loss.group_scope=group"], "group_scope='group'"),
    (
        "GEPO+ option with plain GEPO",
        ["actor_rollout_ref.actor.policy_loss.gepo_plus_mode=soft"],
        "policy_loss.gepo_plus_mode is set, but actor_rollout_ref.actor.policy_loss.loss_mode=gepo",
    ),
    (
        "GEPO+ mode typo",
        ["algorithm.loss=gepo_plus", "actor_rollout_ref.actor.policy_loss.gepo_plus_mode=sof"],
        "gepo_plus_mode='sof'",
    ),
    (
        "GEPO+ threshold not positive",
        ["algorithm.loss=gepo_plus", "actor_rollout_ref.actor.policy_loss.gepo_plus_kl_threshold=0"],
        "gepo_plus_kl_threshold=0",
    ),
    ("one response per prompt", ["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n=1"),
    ("bad hetero bound", [*HETERO, "hetero.max_lag=-1"], "hetero.max_lag=-1"),
    ("hung-sampler timeout not positive", [*HETERO, "hetero.health.timeout_s=0"], "hetero.health.timeout_s=0"),
    ("probe interval not a number", [*HETERO, "hetero.health.interval_s=nan"], "hetero.health.interval_s"),
    ("replacement flag read as boolean", [*HETERO, "hetero.replace_failed=yes"], "hetero.replace_failed='yes'"),
    ("bad hetero strategy", [*HETERO, "hetero.strategy=dropp"], "hetero.strategy='dropp'"),
    ("guard flag read as boolean", [*HETERO, "hetero.guard.enable=on"], "hetero.guard.enable='on'"),
    (
        "guard without GEPO's weights",
        [*HETERO, "algorithm.loss=gspo", "hetero.guard.enable=true"],
        "hetero.guard.enable=true reads the ESS/N",
    ),
    ("guard floor above the bound", [*HETERO, "hetero.guard.enable=true", "hetero.guard.floor=99"], "guard.floor (99)"),
    (
        "margin beyond the bound",
        [*HETERO, "hetero.max_lag=2", "hetero.admission_margin=3"],
        "admission_margin (3) > max_lag (2)",
    ),
    ("hetero with verl's own bound", [*HETERO, "trainer.v1.sampler.max_off_policy_threshold=4"], "max_off_policy"),
    ("separate_async without samplers", ["trainer.v1.trainer_mode=separate_async"], "rollout.nnodes=0"),
    ("separate_async batch sizes", [*ASYNC, "trainer.v1.separate_async.parameter_sync_step=2"], "parameter_sync_step"),
    ("naive weight sync for separate_async", [*ASYNC[:-2], ASYNC[-1]], "checkpoint_engine.backend=naive"),
    ("missing data file", ["data.train_files=/nonexistent/train.parquet"], "data.train_files"),
    ("missing model", ["actor_rollout_ref.model.path=/nonexistent/model"], "actor_rollout_ref.model.path"),
    ("reward function typo", ["reward.custom_reward_function.name=compute_scor"], "did you mean 'compute_score'"),
    ("unregistered loss mode", ["algorithm.loss=null", "actor_rollout_ref.actor.policy_loss.loss_mode=gepoo"], "gepoo"),
    ("unknown estimator", ["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator='grpoo'"),
    ("verl's own check", ["data.train_batch_size=3"], "verl's config check failed"),
    ("relay without a store", RELAY, "hetero.transport=relay needs hetero.relay.url"),
    (
        "relay with a simulated delay",
        [*RELAY, NOT_PROBED, "hetero.delay.distribution=constant", "hetero.delay.seconds=1"],
        "remove hetero.delay",
    ),
    (
        "relay credential in storage options",
        [*RELAY, NOT_PROBED, "+hetero.relay.storage_options.secret=abc"],
        "hetero.relay.storage_options: secret looks like a credential",
    ),
    ("relay links for other groups", [*RELAY, NOT_PROBED, "hetero.relay.links=[{},{},{}]"], "one per group"),
    (
        "relay with another checkpoint engine",
        [*RELAY, NOT_PROBED, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
        "but actor_rollout_ref.rollout.checkpoint_engine.backend=nccl was set",
    ),
    ("relay link speed zero", [*RELAY, NOT_PROBED, "hetero.relay.links=[{bandwidth_mbps:0},{}]"], "bandwidth_mbps"),
    ("relay store not writable", [*RELAY, "hetero.relay.url=/proc/gepo-relay"], "hetero.relay.url='/proc/gepo-relay"),
    (
        "relay secret not in the environment",
        [*RELAY, NOT_PROBED, "hetero.relay.secret_env=GEPO_TEST_SECRET_NOT_SET"],
        "GEPO_TEST_SECRET_NOT_SET",
    ),
    (
        "modelled GPU without speed",
        ["trainer.device=cpu", "+actor_rollout_ref.rollout.engine_kwargs.hf.latency.decode_tokens_per_s=0"],
        "actor_rollout_ref.rollout.engine_kwargs.hf.latency.decode_tokens_per_s",
    ),
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> list[str]:
    """A valid tiny GEPO command line (GPU defaults; nothing is run)."""
    return valid_gepo_command(write_all(tmp_path_factory.mktemp("tiny")))


def launch(argv: list[str], monkeypatch) -> None:
    """The CLI's first pass only: a valid config stops right before Hydra's second pass (which would run it)."""
    monkeypatch.setattr(main_ppo, "_run", lambda: (_ for _ in ()).throw(SystemExit(0)))
    main_ppo.main(argv)


@pytest.mark.parametrize(("name", "mistake", "expected"), MISTAKES, ids=[case[0] for case in MISTAKES])
def test_each_mistake_stops_at_start_up_naming_the_key(name, mistake, expected, valid, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        launch([*valid, *mistake], monkeypatch)
    err = capsys.readouterr().err
    assert stop.value.code == main_ppo.CONFIG_ERROR_EXIT, err
    assert "gepo-plugin: configuration error" in err and expected in err, err


def test_the_valid_commands_pass_every_check(valid, monkeypatch, capsys, tmp_path):
    relay = [*RELAY, f"hetero.relay.url={tmp_path / 'relay'}", "hetero.relay.links=[{bandwidth_mbps:100},{}]"]
    for extra in ([], HETERO, [*HETERO, "hetero.delay.distribution=constant", "hetero.delay.seconds=2"], relay):
        with pytest.raises(SystemExit) as stop:
            launch([*valid, *extra], monkeypatch)
        assert stop.value.code == 0, capsys.readouterr().err


def test_the_relay_store_is_probed_before_ray_and_only_warned_about_when_printing(
    valid, monkeypatch, capsys, caplog, tmp_path
):
    """A run writes, reads back and deletes a probe object in the run's store; ``--cfg job`` touches nothing."""
    store = tmp_path / "relay"
    with pytest.raises(SystemExit) as stop:
        launch([*valid, *RELAY, f"hetero.relay.url={store}", "--cfg", "job"], monkeypatch)
    assert stop.value.code == 0, capsys.readouterr().err
    assert not store.exists() and "is not probed while printing" in caplog.text
    with pytest.raises(SystemExit) as stop:
        launch([*valid, *RELAY, f"hetero.relay.url={store}"], monkeypatch)
    assert stop.value.code == 0, capsys.readouterr().err
    probes = store / "verl_examples" / "gsm8k" / "_probe"  # the run's store: url/project/experiment (verl defaults)
    assert probes.is_dir() and not any(probes.iterdir())  # written, read back and deleted


def test_hydra_grammar_errors_also_exit_non_zero(valid, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        launch([*valid, "hetero.maxlag=3"], monkeypatch)  # not a key of the config
    assert stop.value.code != 0 and "maxlag" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("missing", "key"),
    [
        ("data.train_files=/nonexistent/train.parquet", "data.train_files"),
        ("actor_rollout_ref.model.path=/nonexistent/model", "actor_rollout_ref.model.path"),
        ("reward.custom_reward_function.path=/nonexistent/reward.py", "reward.custom_reward_function.path"),
    ],
)
def test_printing_a_config_with_files_missing_here_warns_and_a_run_refuses(
    missing, key, valid, monkeypatch, capsys, caplog
):
    """A cluster's command inspected on a laptop: ``--cfg job`` prints it and warns; the same command run stops."""
    with pytest.raises(SystemExit) as stop:
        launch([*valid, missing, "--cfg", "job"], monkeypatch)
    assert stop.value.code == 0, capsys.readouterr().err
    warned = [record.getMessage() for record in caplog.records if key in record.getMessage()]
    assert len(warned) == 1 and "a run refuses it" in warned[0], caplog.text
    with pytest.raises(SystemExit) as stop:
        launch([*valid, missing], monkeypatch)
    err = capsys.readouterr().err
    assert stop.value.code == main_ppo.CONFIG_ERROR_EXIT and key in err, err


def test_remote_samplers_need_their_tokens_the_key_and_a_free_port_on_this_node(
    valid, monkeypatch, capsys, tmp_path, caplog
):
    """What only the learner's node can tell: a run refuses at once, naming the key; --cfg job warns."""
    import socket

    from gepo_sampler.relay.signing import generate_pair

    private, public = generate_pair()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        remote = [
            *RELAY,
            f"hetero.relay.url={tmp_path / 'relay'}",
            "hetero.relay.signing_key_env=GEPO_TEST_SIGNING_KEY",
            f"hetero.relay.public_key={public}",
            "hetero.remote_samplers=[{name:far,token_env:GEPO_TEST_FAR_TOKEN}]",
            "hetero.gateway.host=127.0.0.1",
            f"hetero.gateway.port={port}",
        ]
        monkeypatch.delenv("GEPO_TEST_FAR_TOKEN", raising=False)
        monkeypatch.setenv("GEPO_TEST_SIGNING_KEY", generate_pair()[0])  # not the public key's
        with pytest.raises(SystemExit) as stop:
            launch([*valid, *remote], monkeypatch)
        err = capsys.readouterr().err
        assert stop.value.code == main_ppo.CONFIG_ERROR_EXIT, err
        assert "GEPO_TEST_FAR_TOKEN is not set" in err and "is not the private key" in err, err
        assert f"cannot listen on 127.0.0.1:{port}" in err, err
        with pytest.raises(SystemExit) as stop:  # printing only: the same three as warnings
            launch([*valid, *remote, "--cfg", "job"], monkeypatch)
        assert stop.value.code == 0, capsys.readouterr().err
        assert "GEPO_TEST_FAR_TOKEN is not set" in caplog.text
    monkeypatch.setenv("GEPO_TEST_FAR_TOKEN", "t" * 32)
    monkeypatch.setenv("GEPO_TEST_SIGNING_KEY", private)
    with pytest.raises(SystemExit) as stop:  # all set, the port free again: the run would start
        launch([*valid, *remote], monkeypatch)
    assert stop.value.code == 0, capsys.readouterr().err
