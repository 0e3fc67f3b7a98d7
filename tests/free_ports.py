"""A free local TCP port for a test's server (a gloo rendezvous, a Ray node, a vLLM host): fixed port numbers collide
when pytest-xdist runs two such tests at once, or when one test reuses a port its predecessor's server still holds."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel had free a moment ago on 127.0.0.1 (bound and released; the caller binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
