"""HeteroRL inside verl's ``separate_async`` trainer: the sampler fleet and the checkpointed books.

:class:`HeteroMixin` is inert unless ``hetero.enable=true``. Then it

1. hands the plugin's replay buffer the ``hetero`` settings it parsed, and replaces the standalone (sampler)
   ``CheckpointEngineManager`` with a :class:`~gepo_plugin.verl_glue.hetero.fleet.SamplerFleet` (elastic samplers:
   lost replicas are retired, optionally replaced) whose weights travel by the configured transport
   (:data:`TRANSPORTS`: simulated delay on verl's own engine, or the relay), connected to the replay buffer's
   staleness core (version floors for in-flight groups, admission) and polled while the learner waits for data;
2. saves the replay buffer's books (:class:`~gepo_plugin.hetero.core.StalenessCore`) as ``hetero.json`` next to
   verl's checkpoint (verl's TransferQueue checkpoint holds the groups themselves) and restores them on
   resume, so counters continue and nothing is counted twice or lost;
3. writes each response's lag (learner version - oldest weight version of its group) into the batch (in the
   same TransferQueue round trip as GEPO's group term: :mod:`gepo_plugin.verl_glue.advantage_fields`),
   so the GEPO loss reports its importance weight by lag bucket (``actor/gepo/iw_by_lag/<bucket>/{mean,var,
   fraction}``, from totals that add up across micro-batches and ranks: see ``hetero/lag_buckets.py``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from gepo_plugin import metric_names
from gepo_plugin.config_keys import HETERO, HF_ROLLOUT_LATENCY
from gepo_plugin.hetero import drop_bias
from gepo_plugin.hetero.lag_buckets import STEP_ESS, finalize_lag_metrics
from gepo_plugin.hetero.lags import response_lags
from gepo_plugin.hetero.settings import RELAY_TRANSPORT, SIMULATED_TRANSPORT, HeteroSettings, parse_hetero
from gepo_plugin.patching import apply_optional
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.advantage_fields import AdvantageFieldsMixin
from gepo_plugin.verl_glue.hetero.fleet import SamplerFleet
from gepo_plugin.verl_glue.hetero.relay_transport import RelayTransport
from gepo_plugin.verl_glue.hetero.remote.calibration_feed import CALIBRATION_FIELDS, CalibrationFeed
from gepo_plugin.verl_glue.hetero.remote.members import build_remote_samplers
from gepo_plugin.verl_glue.hetero.server_identity import server_of
from gepo_plugin.verl_glue.hetero.simulated_transport import SimulatedTransport
from gepo_plugin.verl_glue.hetero.transport import WeightTransport
from gepo_plugin.verl_glue.response_terms import RESPONSE_LAG
from gepo_plugin.verl_glue.weight_versions import learner_version

logger = logging.getLogger(__name__)

STATE_FILE = "hetero.json"

#: ``hetero.transport`` -> how weights reach the samplers (a new transport is one more entry).
TRANSPORTS: dict[str, Callable[[SamplerFleet], WeightTransport]] = {
    SIMULATED_TRANSPORT: SimulatedTransport,
    RELAY_TRANSPORT: RelayTransport,
}


@dataclass
class HeteroTrainerState:
    """Everything :class:`HeteroMixin` adds to verl's trainer, declared in one place."""

    #: The ``hetero`` block, parsed once when the trainer is built.
    settings: HeteroSettings
    #: The sampler books of ``hetero.json`` at a resume: verl loads the checkpoint before it starts the samplers,
    #: and the weight sync takes these books when it is built.
    resumed_sampler_books: dict[str, Any] = field(default_factory=dict)
    #: The remote samplers' audits of ``hetero.json`` at a resume (a quarantined sampler stays out).
    resumed_audits: dict[str, Any] = field(default_factory=dict)
    #: Rollout server address -> sampler group label; retired and pre-resume addresses stay (their rollouts may
    #: still be trained).
    server_groups: dict[str, str] = field(default_factory=dict)
    #: When the last step's throughput was measured (``time.monotonic``); None before the first step.
    last_throughput_time: float | None = None
    #: The in-cluster rollouts owed to the audit's threshold calibration (None: nothing to calibrate).
    calibration: CalibrationFeed | None = None


class HeteroMixin(AdvantageFieldsMixin):
    def __init__(self, config):
        self.hetero = HeteroTrainerState(settings=parse_hetero(config.get(HETERO)))
        if self.hetero.settings.enable:
            seam.require("hetero")
        if config.actor_rollout_ref.get("hybrid_engine", True) is False:
            apply_hybrid_engine_off_patch()
        super().__init__(config)

    def _hetero_buffer(self):
        # lazy: a cycle through verl (importing the buffer first imports verl, whose hook imports this module)
        from gepo_plugin.verl_glue.hetero.replay_buffer import HeteroReplayBuffer

        buffer = getattr(self, "replay_buffer", None)
        return buffer if isinstance(buffer, HeteroReplayBuffer) else None

    def _setup(self):
        buffer = self._hetero_buffer()
        if buffer is not None:  # the settings parsed once, before verl's set-up may load a checkpoint into the buffer
            buffer.attach(self.hetero.settings)
        super()._setup()
        settings = self.hetero.settings
        if not settings.enable:
            return
        if buffer is None:
            raise RuntimeError(
                "hetero.enable=true but trainer.v1.sampler.custom_sampler is not the plugin's HeteroReplayBuffer; "
                "launch with python -m gepo_plugin.main_ppo (it sets it) or set "
                "trainer.v1.sampler.custom_sampler.path=pkg://gepo_plugin.verl_glue.hetero.replay_buffer "
                "trainer.v1.sampler.custom_sampler.name=HeteroReplayBuffer"
            )
        remote = None
        if settings.config.remote_samplers:
            in_cluster = len(settings.group_sizes(len(self.standalone_checkpoint_manager.replicas)))
            # the version window is set when the weights first go out (the fleet's start); 0 until then
            remote = build_remote_samplers(self.config, settings, in_cluster, 0)
            remote.restore_audits(self.hetero.resumed_audits)
            self.hetero.calibration = remote.calibration_feed(self.config)
        fleet = SamplerFleet(
            self.standalone_checkpoint_manager,
            settings,
            staleness=buffer.core,
            transport=TRANSPORTS[settings.transport],
            server_manager=self.standalone_server_manager,
            remote=remote,
        )
        self.standalone_checkpoint_manager = fleet
        fleet.roster.load_state_dict(self.hetero.resumed_sampler_books)
        buffer.on_poll = fleet.poll
        buffer.quarantined_servers = fleet.quarantined_servers  # one set: the fleet adds, the buffer reads

    def _fleet(self) -> SamplerFleet | None:
        fleet = getattr(self, "standalone_checkpoint_manager", None)
        return fleet if isinstance(fleet, SamplerFleet) else None

    def _advantage_reads(self) -> frozenset[str]:
        reads = super()._advantage_reads()
        if self._hetero_buffer() is None:
            return reads
        calibration = self.hetero.calibration
        reads |= CALIBRATION_FIELDS if calibration is not None and calibration.remaining > 0 else frozenset()
        return reads | {"extra_fields", "rm_scores"}

    def _advantage_writes(self, batch, data, metrics: dict) -> dict[str, torch.Tensor]:
        writes = super()._advantage_writes(batch, data, metrics)
        if self._hetero_buffer() is None:
            return writes
        lags = response_lags(batch.keys, batch.tags, learner_version=learner_version(self.global_steps))
        metrics.update(self._throughput_metrics(batch, data["extra_fields"], data["rm_scores"]))
        metrics.update(self._drop_bias_metrics(batch, data["rm_scores"], metrics))
        fleet = self._fleet()
        if fleet is not None:  # this step's view: alive groups, failures and replacements so far
            metrics.update(metric_names.under(metric_names.HETERO, fleet.roster.metrics()))
        calibration = self.hetero.calibration
        if fleet is not None and fleet.remote is not None and calibration is not None and calibration.remaining > 0:
            fleet.remote.calibrate(calibration.dtype, calibration.take(batch.tags, data))
        writes[RESPONSE_LAG] = torch.as_tensor(lags, dtype=torch.float32)
        return writes

    def _update_actor(self, batch, metrics: dict):
        batch = super()._update_actor(batch, metrics=metrics)
        # the loss reports by-lag totals; the step's mean / var / ESS / fraction per bucket come from them
        finalize_lag_metrics(metrics)
        buffer = self._hetero_buffer()
        ess = metrics.get(metric_names.GEPO_LOSS + STEP_ESS)
        if buffer is not None and ess is not None:  # the staleness guard reads the trained batch's ESS/N
            # keyed by the version this update produced (global_steps itself, not the learner_version it started at)
            note = buffer.core.observe_ess(self.global_steps, float(ess))
            if note is not None:
                logger.warning(note)
        return batch

    @staticmethod
    def _drop_bias_metrics(batch, rm_scores: torch.Tensor, metrics: dict) -> dict[str, float]:
        """The step's dropped trajectories (totals the replay buffer reported) against the trained ones."""
        real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        lengths = [batch.tags[i].get("response_len", 0) for i in real]
        trained = drop_bias.totals(lengths, rm_scores.float().sum(-1)[real].numpy())
        prefix = metric_names.HETERO + drop_bias.DROPPED_STEP
        dropped = {name: float(metrics.pop(prefix + name, 0.0)) for name in drop_bias.TOTALS}
        return metric_names.under(metric_names.HETERO, drop_bias.bias_metrics(dropped, trained))

    def _server_groups(self) -> dict[str, str]:
        """Rollout server address -> sampler group label (``learner`` for the hybrid replicas on the learner).

        Addresses of retired replicas stay: their rollouts finished before the loss may still be trained."""
        live: dict[str, str] = {}
        fleet = self._fleet()
        for replica_id, replica in fleet.members.items() if fleet is not None else ():
            live[replica.server_address] = str(fleet.roster.group_of[replica_id])
        for address in getattr(self.llm_server_manager, "server_addresses", []) or []:
            live.setdefault(address, "learner")
        self.hetero.server_groups.update(live)
        return self.hetero.server_groups

    def _throughput_metrics(self, batch, extra_fields, rm_scores: torch.Tensor) -> dict[str, float]:
        """Trained trajectories, response tokens per second since the last step, and mean reward, per sampler group.

        The reward shows what each group's weights are worth: a group that never receives the learner's weights
        stays at its first policy's reward while the others climb.

        Rollouts carry their server in ``extra_fields["server_id"]`` (patches/server_identity.py); if a
        rollout server does not report it the metrics are simply absent.
        """
        now = time.monotonic()
        last = self.hetero.last_throughput_time
        elapsed = now - (now if last is None else last)
        self.hetero.last_throughput_time = now
        real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        if not real:
            return {}
        extras = list(extra_fields)
        servers = [server_of(extras[i]) for i in real]
        if all(server is None for server in servers):
            return {}
        groups = self._server_groups()
        labels = np.asarray([groups.get(server, "unknown") for server in servers])
        lengths = np.asarray([batch.tags[i].get("response_len", 0) for i in real], dtype=np.float64)
        names, index = np.unique(labels, return_inverse=True)
        trajectories = dict(zip(names.tolist(), np.bincount(index).tolist(), strict=True))
        tokens = dict(zip(names.tolist(), np.bincount(index, weights=lengths).tolist(), strict=True))
        scores = rm_scores.float().sum(-1)[real].numpy().astype(np.float64)
        rewards = dict(zip(names.tolist(), np.bincount(index, weights=scores).tolist(), strict=True))
        out = {}
        for label in sorted({*trajectories, *(v for v in groups.values() if v != "learner")}):
            out[metric_names.sampler_group(label, "trained_trajectories")] = float(trajectories.get(label, 0))
            if trajectories.get(label):
                out[metric_names.sampler_group(label, "reward_mean")] = rewards[label] / trajectories[label]
            if elapsed > 0:
                out[metric_names.sampler_group(label, "trained_tokens_per_s")] = tokens.get(label, 0.0) / elapsed
        return out

    def hetero_state(self) -> dict:
        """What ``hetero.json`` holds: the replay buffer's books and queued versions, the sampler failures and
        replacements, and which sampler group each server address belonged to (groups queued at the checkpoint are
        attributed to the servers that generated them after a resume, whose servers have new addresses)."""
        fleet = self._fleet()
        samplers = fleet.roster.state_dict() if fleet is not None else self.hetero.resumed_sampler_books
        return {
            "global_steps": self.global_steps,
            "replay_buffer": self._hetero_buffer().state_dict(),
            "samplers": samplers,
            "audits": fleet.remote.audit_state()
            if fleet is not None and fleet.remote is not None
            else self.hetero.resumed_audits,
            "server_groups": dict(self._server_groups()),
            # the CPU rollout's modelled GPU, if any: the run's timings mean nothing without it
            "rollout_latency": _plain(OmegaConf.select(self.config, HF_ROLLOUT_LATENCY, default=None)),
        }

    def load_hetero_state(self, state: dict) -> None:
        self._hetero_buffer().load_state_dict(state["replay_buffer"])
        # verl loads the checkpoint before it starts the samplers: the weight sync takes these books when it is built
        self.hetero.resumed_sampler_books = state.get("samplers", {})
        self.hetero.resumed_audits = state.get("audits", {})
        # the live servers' addresses take precedence (a new server may reuse an old address)
        self.hetero.server_groups = dict(state.get("server_groups", {}))

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self._hetero_buffer() is None:
            return
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STATE_FILE), "w") as handle:
            json.dump(self.hetero_state(), handle)

    def _load_checkpoint(self):
        buffer = self._hetero_buffer()
        if buffer is None:
            return super()._load_checkpoint()
        folder = load_recording_folder(self, super()._load_checkpoint)
        if folder is None:
            return None
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            logger.warning("hetero: %s not found; staleness accounting restarts from zero at this resume", path)
            return None
        with open(path) as handle:
            state = json.load(handle)
        self.load_hetero_state(state)
        ledger = state["replay_buffer"]["ledger"]
        logger.info(
            "hetero: resumed at step %s with %d queued group(s), %d produced, %d trained",
            self.global_steps,
            len(ledger["queued"]),
            ledger["produced"],
            ledger["trained"],
        )
        return None


def _plain(node: Any) -> Any:
    """A config node as plain JSON-able data (None stays None)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def load_recording_folder(trainer, load_checkpoint) -> str | None:
    """Run verl's ``_load_checkpoint`` and return the ``global_step_*`` folder it resumed from (None: a fresh start).

    verl decides the folder (resume modes, relative paths, the latest step) and loads the actor from
    ``<folder>/actor`` with ``actor_rollout_wg.load_checkpoint(local_path=...)`` (a seam contact); recording that
    call gives exactly its choice, without repeating its rules here.
    """
    group = trainer.actor_rollout_wg
    original = group.load_checkpoint
    seen: list[str] = []

    def recording(*args, **kwargs):
        local_path = kwargs.get("local_path", args[0] if args else None)
        if local_path is not None:
            seen.append(os.path.dirname(os.path.normpath(str(local_path))))
        return original(*args, **kwargs)

    group.load_checkpoint = recording
    try:
        load_checkpoint()
    finally:
        group.load_checkpoint = original
    return seen[0] if seen else None


def apply_hybrid_engine_off_patch() -> None:
    """verl 0.9.1's separate_async crashes with ``hybrid_engine=False``; apply the version-checked fix."""
    apply_optional("hybrid_engine_off", "hybrid_engine=False may fail if this verl still has the bug", logger)
