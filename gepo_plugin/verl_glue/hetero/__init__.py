"""HeteroRL on verl's ``separate_async`` trainer: thin adapters around the framework-free core.

* :mod:`.replay_buffer`: :class:`~.replay_buffer.HeteroReplayBuffer`, verl's async replay buffer whose staleness
  decisions and books are :class:`gepo_plugin.hetero.core.StalenessCore`'s (over TransferQueue);
* :mod:`.weight_sync`: the delayed weight sync (per-sampler-group verl checkpoint engines following
  :class:`gepo_plugin.hetero.weight_schedule.WeightArrivalSchedule`);
* :mod:`.trainer`: the trainer mixin (wiring, checkpointed books, per-response lags, throughput);
* :mod:`.wiring`: what ``hetero.enable=true`` sets in the config.
"""
