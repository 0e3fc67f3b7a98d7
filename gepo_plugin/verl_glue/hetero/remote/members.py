"""The learner's side of ``hetero.remote_samplers``: the gateway, one proxy per sampler, and their joins.

:class:`RemoteSamplers` starts the gateway (:class:`~gepo_plugin.verl_glue.hetero.remote.gateway.RemoteGateway`)
on the node of verl's TaskRunner (which every sampler dials), with a
:class:`~gepo_plugin.verl_glue.hetero.remote.proxy.RemoteSamplerProxy` per sampler in the gateway's own process
(:mod:`~gepo_plugin.verl_glue.hetero.remote.pool`), and gives the
sampler fleet a :class:`RemoteReplica` per sampler: what the fleet, verl's weight-sync manager and its load balancer
hold for a replica (servers, address, abort and resume). Remote groups start empty; a sampler joins its group when it
has dialled in and installed a version (the relay transport checks, :meth:`RemoteSamplers.candidates`). A retired
sampler's proxy leaves its pool with it (its requests fail and are counted); when it dials again, the gateway records
it and :meth:`RemoteSamplers.rejoin` gives it a new proxy, so it joins again without a learner restart. What the
learner asks of every sampler (versions, reports, the window of versions, resuming those that installed a version)
is one call for all.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gepo_plugin import metric_names
from gepo_plugin.hetero.audit.selection import AuditSelection
from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue.hetero.remote.auditor import AuditClient, RemoteAuditor
from gepo_plugin.verl_glue.hetero.remote.calibration_feed import CalibrationFeed
from gepo_plugin.verl_glue.hetero.remote.gateway import RemoteGateway
from gepo_plugin.verl_glue.hetero.remote.pool import PooledProxy
from gepo_sampler.remote.protocol import VersionWindow

logger = logging.getLogger(__name__)

#: Replica ranks of remote samplers start here (verl's replicas and their replacements count up from 0).
REMOTE_FIRST_RANK = 100_000
#: The prefix of a remote sampler's server address (verl's load balancer key, and the per-group metrics' label).
ADDRESS_PREFIX = "remote/"


class RemoteReplica:
    """One remote sampler as the fleet holds a verl ``RolloutReplica`` (its proxy is its one server)."""

    is_remote = True

    def __init__(self, name: str, proxy: PooledProxy, replica_rank: int) -> None:
        self.name = name
        self.proxy = proxy
        self.replica_rank = replica_rank
        self.servers = [proxy]
        self.workers: list[Any] = []
        self.resource_pool = None
        self.server_handle = proxy
        self.server_address = ADDRESS_PREFIX + name

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return await self.proxy.abort_all_requests.remote(reject_request=reject_request)

    async def resume_generation(self) -> None:
        await self.proxy.resume_generation.remote()

    # verl's manager calls these on every replica; a remote sampler manages its own engine
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def sleep(self) -> None: ...
    async def wake_up(self) -> None: ...
    async def start_profile(self, **kwargs) -> None: ...
    async def stop_profile(self) -> None: ...


class RemoteBatch:
    """Remote samplers that installed a version, with the two calls the fleet makes of a group's verl manager then
    (:meth:`~gepo_plugin.verl_glue.hetero.fleet.SamplerFleet.installed`), each one call for all of them."""

    def __init__(self, gateway: Any, keys: list[str]) -> None:
        self.gateway, self.keys = gateway, keys

    def resume_generation_replicas(self) -> None:
        ray.get(self.gateway.call_many.remote(self.keys, "resume_generation"))

    def abort_replicas(self, reject_request: bool = False) -> None:
        ray.get(self.gateway.call_many.remote(self.keys, "abort_all_requests", reject_request=reject_request))


def is_remote(replica: Any) -> bool:
    return getattr(replica, "is_remote", False)


class RemoteSamplers:
    """The gateway and the proxies of every remote sampler (built on verl's TaskRunner, which owns the fleet)."""

    def __init__(
        self,
        settings: HeteroSettings,
        first_group: int,
        window: VersionWindow,
        vocab_size: int,
        default_max_tokens: int,
        hello: dict[str, Any],
        first_rank: int,
        model_path: str | None = None,
    ) -> None:
        config = settings.config
        self.samplers = {sampler.name: sampler for sampler in config.remote_samplers}
        labels = settings.config.remote_groups()
        self.group_of = {name: first_group + labels.index(s.group_label) for name, s in self.samplers.items()}
        self.num_groups = len(labels)
        self.window = window
        self.vocab_size, self.default_max_tokens = vocab_size, default_max_tokens
        self._gateway_config = config.gateway
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self._placement = {"num_cpus": 0, "scheduling_strategy": here}
        self.gateway = (
            ray.remote(RemoteGateway)  # (each request verl has with a sampler is one call waiting here)
            .options(**self._placement, max_concurrency=1_000_000)
            .remote(config.gateway, list(config.remote_samplers), {**hello, "poll_wait_s": config.gateway.poll_wait_s})
        )
        self.url = ray.get(self.gateway.start.remote())
        self.auditor, self._selection = None, None
        if config.audit.enable:  # the key stays on the learner's side: proxies and auditor share it
            secret = secrets.token_bytes(32)
            self._selection = AuditSelection(config.audit.fraction, secret)
            self.auditor = (
                ray.remote(RemoteAuditor)
                .options(**self._placement, num_gpus=config.audit.num_gpus)
                .remote(config.audit, settings.relay, model_path, secret, config.audit.tau, list(self.samplers))
            )
        self._audit_mode = config.audit.mode
        self._next_rank = first_rank
        #: name -> its replica while it may serve or join (a retired sampler is absent until it dials again)
        self.replicas: dict[str, RemoteReplica] = {}
        ray.get([self._new_proxy(name) for name in self.samplers])
        ray.get(self.gateway.attach_many.remote({n: r.proxy.key for n, r in self.replicas.items()}))

    def _new_proxy(self, name: str) -> Any:
        """A proxy for ``name`` in the gateway's pool, under a key of its own incarnation (the replica rank); returns
        the ref of its creation (the gateway routes to it once attached)."""
        rank = self._next_rank
        self._next_rank += 1
        key = f"{name}#{rank}"
        created = self.gateway.add.remote(
            key,
            name,
            ADDRESS_PREFIX + name,
            self._gateway_config,
            self.window,
            self.vocab_size,
            self.default_max_tokens,
            self._audit_client(name),
        )
        self.replicas[name] = RemoteReplica(name, PooledProxy(self.gateway, key), rank)
        return created

    def _remove(self, replica: RemoteReplica) -> None:
        """Take ``replica``'s proxy out of the pool (its pending requests fail; again is no error)."""
        ray.get(replica.proxy.retire())

    def _audit_client(self, name: str) -> AuditClient | None:
        if self.auditor is None:
            return None
        return AuditClient(name, self._selection, self.auditor, mode=self._audit_mode)

    def audit_state(self) -> dict[str, Any]:
        """The audits' books (``hetero.json``), verdicts included; empty without ``hetero.audit``."""
        return ray.get(self.auditor.state.remote()) if self.auditor is not None else {}

    def restore_audits(self, state: dict[str, Any]) -> None:
        """A resumed run's audits: the books continue, and a sampler quarantined before stays out (403)."""
        if self.auditor is None or not state:
            return
        ray.get(self.auditor.restore.remote(state))
        for name, saved in state.items():
            if saved.get("verdict") is not None and name in self.replicas:
                self._remove(self.replicas.pop(name))
                ray.get(self.gateway.detach.remote(name, True))
                logger.warning("hetero: remote sampler %r stays quarantined (test %r)", name, saved["verdict"]["test"])

    def candidates(self, members: list[Any]) -> list[tuple[int, RemoteReplica]]:
        """``(group, replica)`` of every remote sampler that is not a member of the fleet (it may join once it
        reports a version)."""
        current = {id(member) for member in members}
        return [(self.group_of[name], r) for name, r in self.replicas.items() if id(r) not in current]

    def retired(self, replica: RemoteReplica, quarantined: bool = False) -> None:
        """The fleet retired ``replica`` (its proxy leaves its pool): its calls get 410 until it dials again, or, once
        the audit quarantined it, 403 for the rest of the run."""
        if self.replicas.get(replica.name) is replica:
            del self.replicas[replica.name]
        self._remove(replica)
        ray.get(self.gateway.detach.remote(replica.name, quarantined))

    def rejoin(self) -> list[str]:
        """Retired samplers that dialled in again get a new proxy; returns their names."""
        back = [name for name in ray.get(self.gateway.rejoining.remote()) if name not in self.replicas]
        ray.get([self._new_proxy(name) for name in back])
        if back:
            ray.get(self.gateway.attach_many.remote({name: self.replicas[name].proxy.key for name in back}))
        for name in back:
            logger.warning("hetero: remote sampler %r dialled in again; it rejoins once it holds a version", name)
        return back

    def set_window(self, first: int, latest: int) -> None:
        """Every proxy accepts results of this run's versions ``first``..``latest`` (the learner's)."""
        self.window = VersionWindow(first=first, latest=latest)
        ray.get(
            [
                self.gateway.set_window.remote(first, latest),
                self.gateway.set_hello.remote(first_version=first, learner_version=latest),
            ]
        )

    def _ask(self, method: str, replicas: dict[int, RemoteReplica], timeout_s: float) -> dict[int, Any]:
        """The pool's ``method`` over ``replicas``' keys in one call, by member; empty if the gateway does not
        answer in time (the health monitor judges it); a proxy gone from the pool is left out."""
        if not replicas:
            return {}
        members = {replica.proxy.key: member for member, replica in replicas.items()}
        try:
            answered = ray.get(getattr(self.gateway, method).remote(list(members)), timeout=timeout_s)
        except Exception as error:
            logger.debug("hetero: remote samplers' %s failed: %r", method, error)
            return {}
        return {members[key]: value for key, value in answered.items()}

    def reports(self, replicas: dict[int, RemoteReplica], timeout_s: float) -> dict[int, dict]:
        """Each member's proxy report (:meth:`~gepo_plugin.verl_glue.hetero.remote.proxy.RemoteSamplerProxy.report`),
        in one call."""
        return self._ask("reports", replicas, timeout_s)

    def versions(self, replicas: dict[int, RemoteReplica], timeout_s: float) -> dict[int, int | None]:
        """The version each member holds, of those that may serve (one call; what the fleet checks while it waits)."""
        return self._ask("versions", replicas, timeout_s)

    def batch(self, replicas: list[RemoteReplica]) -> RemoteBatch:
        """Several remote samplers as one weight-sync manager for the fleet (resume or abort them in one call)."""
        return RemoteBatch(self.gateway, [replica.proxy.key for replica in replicas])

    def metrics(self, reports: dict[str, dict]) -> dict[str, float]:
        """Per sampler (``reports``: name -> its proxy's report) and the gateway's refusals, named."""
        counts, latencies = ray.get([self.gateway.counts.remote(), self.gateway.latencies.remote()])
        out = metric_names.under(metric_names.REMOTE, {**counts, **latencies})
        for name, report in reports.items():
            prefix = f"{metric_names.REMOTE}{name}/"
            out.update({prefix + key: float(value) for key, value in report["counters"].items()})
            out.update({f"{prefix}refused/{reason}": float(n) for reason, n in report["refused"].items()})
            if "silent_s" in report:  # (a retired sampler's report keeps its totals only)
                out[prefix + "silent_s"] = float(report["silent_s"])
            status = report.get("status")
            if status is not None and status["version"] is not None:
                out[prefix + "version"] = float(status["version"])
        if self.auditor is not None:
            audits = ray.get(self.auditor.report.remote())
            for name, values in audits["samplers"].items():
                out.update({f"{metric_names.REMOTE}{name}/{key}": float(v) for key, v in values.items()})
            out[metric_names.REMOTE + "audit_seconds"] = float(audits["seconds"])
            out[metric_names.REMOTE + "audit_version_pulls"] = float(audits["version_pulls"])
            for dtype, values in audits["calibration"].items():
                prefix = f"{metric_names.REMOTE}calibration/{dtype}/"
                out.update({prefix + key: float(v) for key, v in values.items() if v is not None})
        return out

    def calibration_feed(self, config: Any) -> CalibrationFeed | None:
        """What the trainer hands the auditor to calibrate the threshold of the in-cluster samplers' dtype
        (``config``: verl's trainer config); None where nothing is calibrated (no audit, ``hetero.audit.tau`` set,
        a derived dtype, or calibrated before a resume)."""
        rollout = config.actor_rollout_ref.rollout
        dtype = str(rollout.get("dtype", "bfloat16"))
        if self.auditor is None or not (remaining := ray.get(self.auditor.calibrating.remote(dtype))):
            return None
        return CalibrationFeed(
            dtype=dtype,
            temperature=float(rollout.temperature),
            top_k=int(rollout.get("top_k", -1)),
            top_p=float(rollout.get("top_p", 1.0)),
            remaining=int(remaining),
            untrusted_prefix=ADDRESS_PREFIX,
        )

    def calibrate(self, dtype: str, trajectories: list[dict[str, Any]]) -> None:
        """Hand the auditor trusted (in-cluster) trajectories to calibrate the threshold of ``dtype`` (not waited
        for: the auditor works through them between audits)."""
        if self.auditor is not None and trajectories:
            self.auditor.calibrate.remote(dtype, trajectories)


def build_remote_samplers(config: Any, settings: HeteroSettings, first_group: int, version: int) -> RemoteSamplers:
    """The run's remote samplers (``config``: verl's trainer config), their gateway listening on this node."""
    from transformers import AutoConfig  # lazy: the model's config is read once, where the fleet is built

    model = AutoConfig.from_pretrained(config.actor_rollout_ref.model.path, trust_remote_code=True)
    relay = settings.relay
    hello = {"run_id": relay.run_id, "relay_url": relay.url, "first_version": version, "learner_version": version}
    return RemoteSamplers(
        settings,
        model_path=config.actor_rollout_ref.model.path,
        first_group=first_group,
        window=VersionWindow(first=version, latest=version),
        vocab_size=int(getattr(model, "vocab_size", None) or model.get_text_config().vocab_size),
        default_max_tokens=int(config.actor_rollout_ref.rollout.response_length),
        hello=hello,
        first_rank=REMOTE_FIRST_RANK,
    )
