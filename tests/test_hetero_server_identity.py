"""patches/server_identity.py through verl's real LLMServerClient and load balancer (real Ray).

Per-sampler-group throughput needs to know which rollout server produced each trajectory. The patch
records the server id the load balancer returned and writes it into ``extra_fields``; here 48
concurrent requests go through verl's own ``GlobalRequestLoadBalancer`` (least-loaded routing over
three servers) and each output must name exactly the server that answered it. The servers are small
Ray actors standing in for vLLM (the seam): each reports its own name in the output.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from omegaconf import OmegaConf

pytestmark = pytest.mark.ray


@ray.remote
class NamedServer:
    """A rollout server's ``generate`` contract: a TokenOutput whose extra_fields carry the version."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        await asyncio.sleep(0.01 * (len(prompt_ids) % 3))  # uneven service times: routing interleaves
        return TokenOutput(
            token_ids=[1, 2], log_probs=[-0.1, -0.2], extra_fields={"global_steps": 3, "served_by": self.name}
        )


@pytest.fixture
def patched(monkeypatch):
    """Apply the patch for this test only (verl's classes and the applied-patch list are restored after)."""
    from verl.workers.rollout import llm_server

    from gepo_plugin import patching
    from gepo_plugin.patches.server_identity import PATCH

    for cls, name in (
        (llm_server.LLMServerClient, "_acquire_server"),
        (llm_server.LLMServerClient, "generate"),
        (llm_server.FullyAsyncLLMServerClient, "generate"),
    ):
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setattr(patching, "APPLIED", [])
    assert patching.apply(PATCH)
    return llm_server


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def _client(llm_server, servers: dict):
    from verl.workers.rollout.router import get_router_handle

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf", "full_determinism": False}}})
    return llm_server.LLMServerClient(config=config, load_balancer_handle=get_router_handle(servers=servers))


def test_every_output_names_the_server_that_generated_it(local_ray, patched):
    from gepo_plugin.verl_glue.hetero.server_identity import SERVER_ID

    servers = {f"10.0.0.{i}:800{i}": NamedServer.remote(f"10.0.0.{i}:800{i}") for i in range(3)}
    client = _client(patched, servers)

    async def run_all():
        return await asyncio.gather(
            *(client.generate(f"request-{i}", prompt_ids=list(range(i % 7 + 1)), sampling_params={}) for i in range(48))
        )

    outputs = asyncio.run(run_all())
    served = [output.extra_fields["served_by"] for output in outputs]
    assert [output.extra_fields[SERVER_ID] for output in outputs] == served
    assert len(set(served)) == 3, "least-loaded routing should have used every server"
    # verl's own version fields are untouched
    assert all(output.extra_fields["min_global_steps"] == 3 for output in outputs)


def test_without_the_patch_verl_does_not_report_the_server(local_ray):
    """Why the patch exists: verl 0.9.1's client drops the server id (fails once verl records it itself)."""
    from verl.workers.rollout import llm_server

    from gepo_plugin.verl_glue.hetero.server_identity import SERVER_ID

    client = _client(llm_server, {"only:1": NamedServer.remote("only:1")})
    output = asyncio.run(client.generate("r", prompt_ids=[1], sampling_params={}))
    assert SERVER_ID not in output.extra_fields


def test_the_patch_refuses_another_verl(monkeypatch, installed_versions):
    from gepo_plugin import patching
    from gepo_plugin.patches.server_identity import PATCH

    monkeypatch.setattr(patching, "APPLIED", [])
    installed_versions(verl="0.9.9")
    with pytest.raises(patching.PatchVersionError, match=r"0\.9\.9"):
        patching.apply(PATCH)
