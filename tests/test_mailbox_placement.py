"""The CPU backend's weight mailbox lives on its creator's node, against a real three-node Ray cluster.

Found by the Slurm job (tests/test_slurm_e2e.py): trainer rank 0 created the mailbox, Ray placed the actor (which asks
for no resource) on a sampler's node, and when that node's Ray ended every sampler group's weight sync failed, so the
run stopped instead of retiring one sampler. The creator here is a task pinned to a node that is not the driver's.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

MAILBOXES = 6  # Ray's default placement puts all six on the creator's node only by chance


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    creator = nodes.add_node(num_cpus=2)
    nodes.add_node(num_cpus=2)
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.wait_for_nodes()
    yield creator.node_id
    ray.shutdown()
    nodes.shutdown()


def test_a_mailbox_is_created_on_its_creators_node(cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from ray.util.state import get_actor

    @ray.remote(num_cpus=0)
    def create(count: int) -> tuple[str, list[str]]:
        from gepo_plugin.cpu_backend.ray_mailbox_engine import get_or_create_mailbox

        handles = [get_or_create_mailbox(f"placement_test_{i}") for i in range(count)]
        ray.get([handle.pending.remote() for handle in handles])  # created and answering
        return ray.get_runtime_context().get_node_id(), [handle._actor_id.hex() for handle in handles]

    pinned = NodeAffinitySchedulingStrategy(node_id=cluster, soft=False)
    node, actor_ids = ray.get(create.options(scheduling_strategy=pinned).remote(MAILBOXES))
    assert node == cluster
    placed = {get_actor(actor_id).node_id for actor_id in actor_ids}
    assert placed == {cluster}, placed
