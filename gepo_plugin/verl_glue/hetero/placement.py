"""verl's own services on the learner's nodes (``hetero.learner_resource``), so that any sampler node can be lost.

verl 0.9.1 does not keep its services with the learner: its TaskRunner, TransferQueue's controller and the rollout
load balancer go wherever Ray's default scheduling puts them, TransferQueue's storage units and verl's agent-loop
and reward-loop workers go round-robin over every node with CPUs. A sampler node that hosts one of them cannot be
lost without stopping the run. With HeteroRL, the learner's nodes are marked by a custom Ray resource
(``hetero.learner_resource``, default ``gepo_learner``; ``examples/ray/start_head.sh`` and ``start_worker.sh`` set it
for ``NODE_ROLE=learner``), and every such service asks for a sliver of it (:class:`OnLearnerNodes`): Ray can then
only place it on a learner node, whichever sampler node fails.

The switch is the environment variable :data:`ENV` in every Ray process (set by the launcher); the actors are
created in verl's TaskRunner process (TransferQueue, the load balancer, the agent-loop and reward workers), where
``patches/learner_placement.py`` wraps verl's creation sites, and the TaskRunner itself in the launching process.
Placement is arranged only when some alive node offers the resource: a single machine, or a cluster started
without it, runs as verl places things (the launcher warns for a cluster of several nodes).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.registration import PLACEMENT_ENV

logger = logging.getLogger(__name__)

#: Environment variable naming the learner nodes' custom resource in every Ray process of a HeteroRL run.
ENV = PLACEMENT_ENV
#: How much of the resource one service asks for: a sliver, so a learner node with 1 unit hosts up to 1000.
SHARE = 0.001


def learner_resource() -> str | None:
    """The custom resource that marks learner nodes in this run (None: placement is Ray's)."""
    return os.environ.get(ENV) or None


def nodes_offering(resource: str) -> list[str]:
    """Ids of the alive nodes that offer ``resource``."""
    return [node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["Resources"].get(resource, 0) > 0]


class OnLearnerNodes:
    """A Ray actor class whose every actor goes to a node offering ``resource``: ``.options()`` replaces any
    scheduling strategy (verl's round-robin node affinity) by a request for :data:`SHARE` of the resource."""

    def __init__(self, actor_class: Any, resource: str) -> None:
        self.actor_class, self.resource = actor_class, resource

    def options(self, **options: Any) -> Any:
        options.pop("scheduling_strategy", None)
        options["resources"] = {**(options.get("resources") or {}), self.resource: SHARE}
        logger.info("gepo-plugin: %s placed on a node offering %s", options.get("name") or self, self.resource)
        return self.actor_class.options(**options)

    def __repr__(self) -> str:
        return f"OnLearnerNodes({getattr(self.actor_class, '__name__', self.actor_class)!r})"

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.options().remote(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # everything else is the class's
        return getattr(self.actor_class, name)


def on_learner_nodes(actor_class: Any, resource: str | None = None) -> Any:
    """``actor_class`` placed on the learner's nodes when some alive node offers the resource; else unchanged."""
    resource = resource or learner_resource()
    if resource is None or isinstance(actor_class, OnLearnerNodes) or not nodes_offering(resource):
        return actor_class
    return OnLearnerNodes(actor_class, resource)


def placement_warning(resource: str | None) -> str | None:
    """What the launcher warns about once Ray is up: a cluster of several nodes where no node offers the resource
    (verl's services then go where Ray puts them, and a sampler node hosting one cannot be lost)."""
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if resource is None or len(alive) < 2 or nodes_offering(resource):
        return None
    return (
        f"HeteroRL on {len(alive)} Ray nodes, but none offers the custom resource {resource!r} that marks the "
        "learner's nodes: verl's services (TaskRunner, TransferQueue, load balancer, agent-loop and reward workers) go "
        "where Ray puts them, and a sampler node that hosts one cannot be lost without stopping the run. Fix: start "
        "the learner's nodes with examples/ray/start_head.sh (NODE_ROLE=learner), or `ray start ... "
        f"--resources='{{\"{resource}\": 1}}'`; or set hetero.learner_resource=null to accept Ray's placement"
    )


class PlacedTaskRunner:
    """verl's TaskRunner class, placed on a learner node when ``.remote()`` creates it (Ray is up by then), after
    the placement warning if the cluster lacks the resource."""

    def __init__(self, runner_class: Any, resource: str) -> None:
        self.runner_class, self.resource = runner_class, resource

    def _placed(self) -> Any:
        warning = placement_warning(self.resource)
        if warning:
            logger.warning("gepo-plugin: %s", warning)
        return on_learner_nodes(self.runner_class, self.resource)

    def options(self, **options: Any) -> Any:
        return self._placed().options(**options)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._placed().remote(*args, **kwargs)


def place_task_runner(resource: str) -> None:
    """In the launching process: verl's TaskRunner goes to a learner node (and the cluster is checked once Ray is
    up). Its children (TransferQueue, load balancer, agent-loop and reward workers) follow through
    ``patches/learner_placement.py`` in the TaskRunner's own process."""
    name = "verl.trainer.main_ppo.TaskRunnerV1"
    current = seam.resolve(name)
    if not isinstance(current, PlacedTaskRunner):
        seam.replace(name, PlacedTaskRunner(current, resource))
