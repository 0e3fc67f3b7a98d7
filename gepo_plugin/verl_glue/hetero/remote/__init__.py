"""The learner's side of samplers outside its Ray cluster (``hetero.remote_samplers``): gateway, proxies, members."""
