"""A synthetic fleet of remote samplers that speaks the real protocol, to measure the learner's side at scale.

Synthetic samplers (:mod:`.sampler`, many per process on one asyncio loop) dial the real gateway over HTTP with their
own tokens, follow the real relay's manifests (fetching and checking what a host fetches, installing nothing), and
answer every request with well-formed tokens after a delay drawn from :class:`.profile.FleetProfile`. :mod:`.run`
starts verl's real trainer in ``separate_async`` HeteroRL mode with the tiny model and such a fleet beside it, and
measures the learner node (``bench/bench_fleet.py`` draws the growth curve; ``tests/test_fleet_sim.py`` runs it in CI).
"""
