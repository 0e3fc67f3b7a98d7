"""HeteroRL inside verl's ``separate_async`` trainer: the delayed weight sync and the checkpointed books.

:class:`HeteroMixin` is inert unless ``hetero.enable=true``. Then it

1. replaces the standalone (sampler) ``CheckpointEngineManager`` with
   :class:`~gepo_plugin.verl_glue.hetero_sync.DelayedWeightSync` when a delay is configured, and
   connects it to the plugin's sampler (version floors for in-flight groups, installs while the
   learner waits);
2. saves the sampler's ledger and queued-group versions as ``hetero.json`` next to verl's
   checkpoint (verl's TransferQueue checkpoint holds the groups themselves) and restores them on
   resume, so counters continue and nothing is counted twice or lost.
"""

from __future__ import annotations

import json
import logging
import os

from gepo_plugin.hetero.settings import HeteroSettings, parse_hetero

logger = logging.getLogger(__name__)

STATE_FILE = "hetero.json"


class HeteroMixin:
    @property
    def hetero_settings(self) -> HeteroSettings:
        return parse_hetero(self.config.get("hetero"))

    def _hetero_sampler(self):
        from gepo_plugin.verl_glue.hetero_sampler import HeteroReplayBuffer

        buffer = getattr(self, "replay_buffer", None)
        return buffer if isinstance(buffer, HeteroReplayBuffer) else None

    def _setup(self):
        super()._setup()
        settings = self.hetero_settings
        if not settings.enable:
            return
        sampler = self._hetero_sampler()
        if sampler is None:
            raise RuntimeError(
                "hetero.enable=true but trainer.v1.sampler.custom_sampler is not the plugin's HeteroReplayBuffer; "
                "launch with python -m gepo_plugin.main_ppo (it sets the sampler) or set "
                "trainer.v1.sampler.custom_sampler.path=pkg://gepo_plugin.verl_glue.hetero_sampler "
                "trainer.v1.sampler.custom_sampler.name=HeteroReplayBuffer"
            )
        if settings.simulates_delay:
            from gepo_plugin.verl_glue.hetero_sync import DelayedWeightSync

            sync = DelayedWeightSync(self.standalone_checkpoint_manager, settings)
            self.standalone_checkpoint_manager = sync
            sampler.version_floor_by_step = sync.version_floor_by_step
            sampler.on_poll = sync.poll

    def _save_checkpoint(self):
        super()._save_checkpoint()
        sampler = self._hetero_sampler()
        if sampler is None:
            return
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        state = {"global_steps": self.global_steps, "sampler": sampler.state_dict()}
        with open(os.path.join(folder, STATE_FILE), "w") as handle:
            json.dump(state, handle)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        sampler = self._hetero_sampler()
        if sampler is None or not self.global_steps:
            return
        folder = self.config.trainer.resume_from_path if self.config.trainer.resume_mode == "resume_path" else None
        folder = folder or os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            logger.warning("hetero: %s not found; staleness accounting restarts from zero at this resume", path)
            return
        with open(path) as handle:
            state = json.load(handle)
        sampler.load_state_dict(state["sampler"])
        ledger = state["sampler"]["ledger"]
        logger.info(
            "hetero: resumed at step %s with %d queued group(s), %d produced, %d trained",
            self.global_steps,
            len(ledger["queued"]),
            ledger["produced"],
            ledger["trained"],
        )
