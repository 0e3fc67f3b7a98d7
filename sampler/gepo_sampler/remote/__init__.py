"""Samplers outside the learner's Ray cluster: their settings, the wire protocol and its checks (framework-free).

A remote sampler is a vLLM server in another data centre, fronted by the plugin's sampler host
(:mod:`gepo_sampler.host`): it follows the weight relay from the store and dials one HTTPS endpoint of the
learner's side (the gateway, :mod:`gepo_plugin.verl_glue.hetero.remote`) for work, sending its rollouts back.
This package holds what both sides agree on and nothing that needs Ray, verl or vLLM.
"""
