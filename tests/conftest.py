"""Shared fixtures: random GEPO batches with ragged responses and several prompt groups; a real TransferQueue; the
tiny model, the Ray cluster the end-to-end runs share, and the FSDP2 GEPO run the CPU e2e modules share
(``tests/cpu_runs.py``); the end-to-end tier's timing (``tests/e2e_timing.py``)."""

from __future__ import annotations

import os

import pytest

from gepo_plugin.synthetic import SyntheticBatch, random_batch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

pytest_plugins = ["e2e_timing"]

make_batch = random_batch


@pytest.fixture
def batch() -> SyntheticBatch:
    return random_batch()


@pytest.fixture(scope="module")
def transfer_queue():
    """A local Ray cluster and a real TransferQueue (one storage unit), per test module."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def hetero_buffer(refills: list[int] | None = None, poll_interval: float = 0.02, **hetero):
    """The plugin's replay buffer as verl's separate_async trainer builds it (``hetero`` is the hetero block)."""
    from omegaconf import OmegaConf

    from gepo_plugin.hetero.settings import parse_hetero
    from gepo_plugin.verl_glue.hetero.replay_buffer import HeteroReplayBuffer

    refills = [] if refills is None else refills
    buffer = HeteroReplayBuffer(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({"enable": True, **hetero}),
        refill_fn=lambda n: refills.append(n) or n,
        poll_interval=poll_interval,
    )
    buffer.attach(parse_hetero({"enable": True, **hetero}))  # as the trainer does
    return buffer


@pytest.fixture
def installed_versions(monkeypatch):
    """Pretend other installed versions: ``installed_versions(verl="0.9.9", **{"megatron-core": None})``.

    Every version check of the plugin (the seam's, the patches') asks ``gepo_plugin.versions.installed_version``;
    None means absent.
    """
    from gepo_plugin import versions as installed

    real = installed.installed_version

    def pretend(**versions: str | None) -> None:
        monkeypatch.setattr(installed, "installed_version", lambda package: versions.get(package, real(package)))

    return pretend


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    """The tiny model (bf16-exact weights, see ``tests/cpu_runs.py``), its data and reward, for every e2e module."""
    from gepo_plugin.tiny import write_all

    return write_all(tmp_path_factory.mktemp("tiny"), bf16_exact=True)


@pytest.fixture(scope="session")
def shared_cluster():
    """One Ray node (a learner node, 8 logical GPUs) for the whole session: the end-to-end runs that need no cluster
    of their own join it, one at a time, instead of each starting and stopping a Ray of its own."""
    from ray_nodes import ray_nodes

    with ray_nodes(head_gpus=8, worker_gpus=[], head_cpus=32) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def fsdp_gepo_sync_run(tiny, shared_cluster, tmp_path_factory):
    """The sync FSDP2 scenario (``tests/cpu_runs.py``), run once: test_cpu_e2e's claims and Megatron's reference."""
    from cpu_runs import M2_MASK, gepo_sync_overrides
    from trainer_run import complete_run

    workdir = tmp_path_factory.mktemp("gepo_sync_fsdp2")
    overrides = [*gepo_sync_overrides(tiny, workdir, 3), *M2_MASK, *shared_cluster.join_overrides()]
    return complete_run("fsdp2 sync", overrides, workdir, env=shared_cluster.env)
