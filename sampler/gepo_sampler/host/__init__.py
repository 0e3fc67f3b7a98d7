"""A sampler host: a vLLM server outside the learner's Ray cluster that joins a HeteroRL run by URL (no Ray).

``python -m gepo_sampler`` (or ``gepo-sampler``) starts vLLM on localhost, follows the weight relay from the
store with read-only credentials, and dials the learner's gateway for work (:mod:`gepo_sampler.host.host`).
"""
