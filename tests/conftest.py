"""Shared fixtures: random GEPO batches with ragged responses and several prompt groups; a real TransferQueue; the
tiny model, the Ray cluster the end-to-end runs share, and the FSDP2 GEPO run the CPU e2e modules share
(``tests/cpu_runs.py``); the end-to-end tier's timing (``tests/e2e_timing.py``)."""

from __future__ import annotations

import os

import pytest

from gepo_plugin.synthetic import SyntheticBatch, random_batch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

pytest_plugins = ["e2e_timing"]

#: The second phase (``ray or e2e``) runs in two lanes at once, one pytest-xdist worker each (``test.sh``: ``-n 2
#: --dist loadgroup``): an end-to-end run's start-up leaves a core idle most of the time (one Python process importing
#: torch and verl after another), so two runs side by side take far less than two runs one after the other. The lanes
#: are kept apart by what they share and balanced by their measured time: every run with vLLM in one (they watch
#: /dev/shm, which another vLLM run would write to, and two vLLM runs at once would use most of this machine's memory),
#: the other trainer runs in the other, whose session fixtures (the FSDP2 run Megatron's is compared with) are computed
#: once; short Ray modules fill both up to the same time.
#: Modules not named here are SOLO or in phase one.
LANES = {
    "vllm": (
        "test_vllm_e2e",
        "test_remote_e2e",
        "test_vllm_cpu",
        "test_remote_sampler",
        "test_registration",
        "test_cpu_rollout",
        "test_hetero_server_identity",
        "test_hetero_differential",
    ),
    "trainer": (
        "test_cpu_e2e",
        "test_cpu_megatron_e2e",
        "test_stale_corrections_e2e",
        "test_hetero_elastic_e2e",
        "test_relay_e2e",
        "test_fleet_sim",
        "test_hetero_sampler",
        "test_mailbox_placement",
        "test_learner_placement",
        "test_lab_cli",
        "test_gepo_padding",
    ),
}
#: Modules of the second phase that run alone, after the lanes (marked ``solo``): their assertions are about timings of
#: a second or less (paced polls, probes, a held long poll), or they end every Ray process of the machine (the Slurm
#: job's ``ray stop``, on one machine standing in for several).
SOLO = ("test_replay_poll", "test_hetero_health", "test_remote_gateway", "test_gateway_properties", "test_slurm_e2e")


def lane_of(nodeid: str) -> str | None:
    """The lane of a test (its module's), or None."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return next((lane for lane, modules in LANES.items() if module in modules), None)


@pytest.hookimpl(tryfirst=True)  # before `-m` reads the marks
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if (item.get_closest_marker("ray") or item.get_closest_marker("e2e")) and item.path.stem in SOLO:
            item.add_marker(pytest.mark.solo)


def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadgroup``, a lane's tests all go to one worker, in order; every other test goes wherever a
    worker is free. pytest-xdist's own grouping (``xdist_group`` marks, which its worker turns into a nodeid suffix in
    an undecorated ``pytest_collection_modifyitems``) is never called under pytest 9 (measured: xdist 3.8, pytest 9.2),
    so the lanes are handed to xdist's scheduler through its public hook instead."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid) or nodeid

    return LaneScheduling(config, log)


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

    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
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
