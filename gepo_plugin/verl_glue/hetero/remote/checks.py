"""Remote samplers' settings checked before Ray starts, on the learner's node: tokens, the key, the gateway's port.

The entries themselves (names, duplicates, the relay and its key pair being configured) are the typed model's checks
(:class:`~gepo_sampler.remote.settings.RemoteSamplerConfig`); what needs this node's environment is here. A
sampler dials the learner (it may sit behind NAT), so the learner cannot probe it at start-up: it joins when it
dials in, and the gateway's port must be free to listen on.
"""

from __future__ import annotations

import socket

from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_sampler.relay.signing import SigningKeyError


def check_remote_samplers(hetero: HeteroSettings, inspecting: bool = False) -> list[str]:
    """Every remote sampler's token is set, the signing key is this node's and matches the public key, and the
    gateway can listen (``inspecting``: only printing the config, so each of these is a warning instead)."""
    config = hetero.config
    if not hetero.enable or not config.remote_samplers:
        return []
    problems = []
    for sampler in config.remote_samplers:
        try:
            sampler.token()
        except RuntimeError as error:
            problems.append(f"hetero.remote_samplers[{sampler.name}].token_env: {error}")
    try:
        config.relay.signer()
    except SigningKeyError as error:
        problems.append(str(error))  # (it names hetero.relay.signing_key_env)
    gateway = config.gateway
    problems += gateway.missing_files()
    try:
        with socket.socket(socket.AF_INET6 if ":" in gateway.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((gateway.host, gateway.port))
    except OSError as error:
        problems.append(
            f"hetero.gateway: cannot listen on {gateway.host}:{gateway.port} ({error.strerror or error}); choose a "
            "free port (hetero.gateway.port) or an address of this node (hetero.gateway.host)"
        )
    if problems and not inspecting:
        raise PluginConfigError("; ".join(problems))
    return problems
