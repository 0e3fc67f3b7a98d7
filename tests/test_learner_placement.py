"""verl's own services on the learner's nodes (patches/learner_placement.py), against a real three-node Ray cluster.

The node offering the learner resource is deliberately not the one the test process (the driver, as verl's TaskRunner
would be) runs on: Ray's default placement prefers the caller's node, so every assertion below fails without the
patch, and verl's round-robin spreads its agent-loop and reward workers over all three nodes.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.ray

RESOURCE = "gepo_learner_test"


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 8})
    learner = nodes.add_node(num_cpus=8, resources={RESOURCE: 1})
    nodes.add_node(num_cpus=8)
    ray.init(address=nodes.address, log_to_driver=False)
    yield learner.node_id
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def placed(cluster):
    """The patch applied in this process, as the launcher's environment switch applies it in verl's TaskRunner."""
    import os

    from gepo_plugin.patching import apply_named
    from gepo_plugin.verl_glue.hetero.placement import ENV

    os.environ[ENV] = RESOURCE
    apply_named("learner_placement")
    yield cluster
    os.environ.pop(ENV, None)
    # undone for the modules that run after this one in the same process: the controller was bound to this
    # cluster's resource when the patch was applied, and a later TransferQueue would wait for a node offering it
    from gepo_plugin import patching
    from gepo_plugin.verl_glue import seam

    for contact in seam.CONTACTS:
        if "learner_placement" in contact.features:
            seam.restore(contact.name)
    patching.APPLIED.remove("learner_placement")


def nodes_of(handles) -> set[str]:
    import ray

    return {
        ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())) for handle in handles
    }


def worker_class():
    """A stand-in for verl's worker classes (defined here, so Ray ships it by value to the other nodes)."""
    import ray

    class Worker:
        def __init__(self, *args) -> None:
            self.args = args

    return ray.remote(num_cpus=0)(Worker)


def test_verls_agent_loop_and_reward_workers_go_to_the_learner_node_not_round_robin(placed):
    import asyncio

    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.experimental.reward_loop.reward_loop import RewardLoopManager

    agents = object.__new__(AgentLoopManager)  # verl's own method runs; only its inputs are set here
    agents.rollout_config = OmegaConf.create({"agent": {"num_workers": 3}})
    agents.agent_loop_workers_class = worker_class()
    agents.config = agents.llm_client = agents.teacher_client = agents.reward_loop_worker_handles = None
    asyncio.run(agents._init_agent_loop_workers())
    assert len(agents.agent_loop_workers) == 3 and nodes_of(agents.agent_loop_workers) == {placed}

    rewards = object.__new__(RewardLoopManager)
    rewards.config = OmegaConf.create({"reward": {"num_workers": 3}})
    rewards.reward_loop_workers_class = worker_class()
    rewards.reward_router_address = None
    rewards._init_reward_loop_workers()
    assert len(rewards.reward_loop_workers) == 3 and nodes_of(rewards.reward_loop_workers) == {placed}


def test_the_load_balancer_and_transfer_queue_go_to_the_learner_node(placed):
    import ray
    import transfer_queue as tq
    from verl.workers.rollout.router import get_router_handle

    from gepo_plugin.launch import compose_config

    balancers = [get_router_handle(servers={}) for _ in range(2)]
    assert nodes_of(balancers) == {placed}
    conf = OmegaConf.merge(
        compose_config().transfer_queue, {"backend": {"SimpleStorage": {"num_data_storage_units": 2}}}
    )
    tq.init(conf)
    try:
        from ray.util.state import list_actors

        actors = [a for a in list_actors() if a.class_name in ("TransferQueueController", "SimpleStorageUnit")]
        assert len(actors) == 3 and {a.node_id for a in actors} == {placed}, actors
    finally:
        tq.close()
    assert ray.is_initialized()


def test_the_task_runner_goes_to_the_learner_node_and_a_cluster_without_the_resource_is_warned_about(placed):
    from verl.trainer import main_ppo

    from gepo_plugin.verl_glue.hetero.placement import place_task_runner, placement_warning

    original = main_ppo.TaskRunnerV1
    try:
        place_task_runner(RESOURCE)
        runner = main_ppo.TaskRunnerV1.remote()
        assert nodes_of([runner]) == {placed}
    finally:
        main_ppo.TaskRunnerV1 = original
    assert placement_warning(RESOURCE) is None
    warning = placement_warning("no_such_resource")
    assert "HeteroRL on 3 Ray nodes" in warning and "start_head.sh" in warning and "learner_resource=null" in warning
