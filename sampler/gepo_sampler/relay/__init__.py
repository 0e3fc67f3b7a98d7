"""A weight relay: the learner publishes each weight version once to a store; sampler groups pull exact deltas.

Framework-free (torch, numpy, fsspec, safetensors, zstandard). The rooms, one job each:

- :mod:`~gepo_sampler.relay.codec`: weights as bit patterns, keyframes and exact sparse XOR deltas;
- :mod:`~gepo_sampler.relay.manifest`: what one published version is, tied to its run and signed;
- :mod:`~gepo_sampler.relay.store`: the store behind a URL (any fsspec protocol), retried and counted;
- :mod:`~gepo_sampler.relay.link`: a sampler group's link, its bandwidth and latency applied to real reads;
- :mod:`~gepo_sampler.relay.publisher`: the learner's side, in the background with bounded memory;
- :mod:`~gepo_sampler.relay.puller`: a sampler's side, the cheapest chain, verified, never half-installed.
"""
