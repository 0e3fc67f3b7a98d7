"""What the relay tests share: a small model trained for real, and stores (a directory, an S3-protocol server)."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gepo_sampler.relay.store import RelayStore, RetryPolicy

FAST_RETRY = RetryPolicy(attempts=3, first_delay_s=0.01, max_delay_s=0.05)


class Learner:
    """A small MLP trained with AdamW in fp32; its versions are published in bf16, as a rollout engine gets them."""

    def __init__(self, lr: float = 1e-3, width: int = 64, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, width),
            torch.nn.Tanh(),
            torch.nn.Linear(width, width),
            torch.nn.Tanh(),
            torch.nn.Linear(width, 4),
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.inputs, self.targets = torch.randn(256, 16), torch.randn(256, 4)

    def step(self) -> None:
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.inputs), self.targets).backward()
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in self.model.state_dict().items()}


@contextmanager
def s3_server() -> Iterator[tuple[str, dict]]:
    """A real S3-protocol server over HTTP (moto's ThreadedMotoServer) on a free port, with one bucket.

    Yields the bucket's URL and the fsspec ``storage_options`` that reach it (its endpoint; the credentials are the
    usual AWS environment variables, set here as a user would).
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        host, port = server.get_host_and_port()
        # moto keeps its buckets in module state shared by every server of this process: start from none
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"))
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}
        store = RelayStore("s3://relay-bucket", options, retry=FAST_RETRY)
        store.fs.mkdir("relay-bucket")
        yield "s3://relay-bucket", options
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train_and_publish(learner: Learner, publisher, versions) -> None:
    """One learner step per version, each version published and uploaded before the next."""
    for version in versions:
        learner.step()
        publisher.publish(version, learner.weights())
        publisher.wait()
