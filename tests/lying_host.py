"""A sampler host that lies, for the audit's end-to-end tests: the real host (vLLM and all), one lie on its results.

    python tests/lying_host.py <lie> <the arguments of `python -m gepo_plugin sampler`>

The lie is applied where the host sends a result to the gateway, so everything else (the relay, installs, versions,
the protocol) is the real host's; the learner sees only what a dishonest or misconfigured sampler would send.
"""

from __future__ import annotations

import sys

from gepo_plugin.hetero.remote.protocol import Result
from gepo_plugin.sampler_host import host as host_module
from gepo_plugin.sampler_host.cli import main

#: Each lie, as a change to a result that carries tokens and log-probs.
LIES = {
    "shifted": lambda result: result.model_copy(update={"log_probs": [x - 0.01 for x in result.log_probs]}),
    "scaled": lambda result: result.model_copy(update={"log_probs": [1.02 * x for x in result.log_probs]}),
}


def install(lie: str) -> None:
    change = LIES[lie]
    send = host_module.SamplerHost._send

    async def lying_send(self, result: Result) -> None:
        if result.token_ids and result.log_probs:
            result = change(result)
        await send(self, result)

    host_module.SamplerHost._send = lying_send


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
