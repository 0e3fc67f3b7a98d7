"""verl 0.9.1 places its own services on every node, sampler nodes included: with HeteroRL, keep them on the learner's.

In verl's TaskRunner process (where they are created) each creation site asks for a sliver of the learner nodes'
custom resource (:class:`~gepo_plugin.verl_glue.hetero.placement.OnLearnerNodes`) instead of verl's round-robin
over every node or Ray's default placement:

- verl's agent-loop and reward-loop workers (``AgentLoopManager._init_agent_loop_workers``,
  ``RewardLoopManager._init_reward_loop_workers`` place ``self.*_workers_class`` round-robin over ``ray.nodes()``):
  the worker class is wrapped before verl's own method runs;
- the rollout load balancer (``router._create_global_sticky_inflight`` creates it without a placement);
- TransferQueue's controller (created without a placement by ``transfer_queue.init``) and its storage units (the
  public ``backend.SimpleStorage.required_node_resource``, filled in when the config leaves it unset).

Applied only in HeteroRL runs whose cluster has a node offering the resource (``GEPO_LEARNER_RESOURCE``, set by the
launcher from ``hetero.learner_resource``); otherwise every site is left as verl wrote it.
"""

from __future__ import annotations

import functools
import inspect

import ray
from omegaconf import OmegaConf

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.hetero.placement import learner_resource, nodes_offering, on_learner_nodes

_AGENT = "verl.experimental.agent_loop.agent_loop.AgentLoopManager._init_agent_loop_workers"
_REWARD = "verl.experimental.reward_loop.reward_loop.RewardLoopManager._init_reward_loop_workers"
_BALANCER = "verl.workers.rollout.router._create_global_sticky_inflight"
_DEFAULT_BALANCER = "verl.workers.rollout.llm_server.GlobalRequestLoadBalancer"
_CONTROLLER = "transfer_queue.interface.TransferQueueController"
_TQ_INIT = "transfer_queue.init"


def _placing_workers(method, attribute: str):
    """``method`` of a manager, run with its worker class placed on the learner's nodes."""
    if getattr(method, "__wrapped__", None) is not None:
        return method

    def place(self) -> None:
        setattr(self, attribute, on_learner_nodes(getattr(self, attribute)))

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def wrapper(self, *args, **kwargs):
            place(self)
            return await method(self, *args, **kwargs)

    else:

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            place(self)
            return method(self, *args, **kwargs)

    return wrapper


def _placed_load_balancer(create):
    """verl's factory of the default load balancer, creating the actor on a learner node (the same arguments)."""
    if getattr(create, "__wrapped__", None) is not None:
        return create
    from verl.workers.rollout import router  # lazy: verl's main has no router module (the seam refuses first)

    default_balancer = seam.resolve(_DEFAULT_BALANCER)

    @functools.wraps(create)
    def _create_global_sticky_inflight(servers, full_determinism=False, load_balancer_cls=None):
        kwargs = dict(servers=servers, max_cache_size=router.DEFAULT_ROUTING_CACHE_SIZE)
        if load_balancer_cls is default_balancer:
            kwargs["full_determinism"] = full_determinism
        return on_learner_nodes(ray.remote(load_balancer_cls)).remote(**kwargs)

    return _create_global_sticky_inflight


def _storage_on_learner_nodes(init):
    """``transfer_queue.init`` with its storage units on the learner's nodes, unless the config placed them."""
    if getattr(init, "__wrapped__", None) is not None:
        return init

    @functools.wraps(init)
    def wrapper(conf=None, *args, **kwargs):
        resource = learner_resource()
        storage = OmegaConf.select(conf, "backend.SimpleStorage") if conf is not None else None
        unplaced = storage is not None and storage.get("required_node_resource") is None
        if resource and unplaced and nodes_offering(resource):
            plain = OmegaConf.to_container(conf, resolve=True)
            plain["backend"]["SimpleStorage"]["required_node_resource"] = resource
            conf = OmegaConf.create(plain)
        return init(conf, *args, **kwargs)

    return wrapper


def _apply() -> None:
    seam.replace(_AGENT, _placing_workers(seam.resolve(_AGENT), "agent_loop_workers_class"))
    seam.replace(_REWARD, _placing_workers(seam.resolve(_REWARD), "reward_loop_workers_class"))
    seam.replace(_BALANCER, _placed_load_balancer(seam.resolve(_BALANCER)))
    controller = seam.resolve(_CONTROLLER)
    seam.replace(_CONTROLLER, on_learner_nodes(controller))
    seam.replace(_TQ_INIT, _storage_on_learner_nodes(seam.resolve(_TQ_INIT)))


PATCH = Patch(
    name="learner_placement",
    versions={"verl": "==0.9.1", "TransferQueue": ">=0.1.10,<0.2"},
    reason="verl places its agent-loop and reward workers round-robin over every node, and its load balancer and "
    "TransferQueue wherever Ray puts them: a sampler node hosting one cannot be lost",
    apply=_apply,
    feature="learner_placement",
    check_contacts=seam.require,
)
