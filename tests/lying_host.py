"""A sampler host that lies, for the audit's end-to-end tests: the real host (vLLM and all), one lie on its work.

    python tests/lying_host.py <lie> <the arguments of `python -m gepo_sampler`>

Everything else (the relay, installs, versions, the protocol) is the real host's; the learner sees only what a
dishonest or misconfigured sampler would send:

* ``shifted`` / ``scaled``: the log-probs of each result are changed where the host sends it (what a sampler with
  other weights, another dtype or a codec bug sends);
* ``greedy``: vLLM is asked for temperature 0 whatever the request says, and the result reported as sampled at the
  request's temperature (vLLM's processed log-probs of a greedy request are the untempered ones, so they agree with
  the auditor's at temperature 1: only the sampling test can catch it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from gepo_sampler.host import engine as engine_module
from gepo_sampler.host import host as host_module
from gepo_sampler.host.cli import main
from gepo_sampler.remote.protocol import Result


def _results(change: Callable[[Result], Result]) -> Callable[[], None]:
    def install() -> None:
        send = host_module.SamplerHost._send

        async def lying_send(self, result: Result) -> None:
            if result.token_ids and result.log_probs:
                result = change(result)
            await send(self, result)

        host_module.SamplerHost._send = lying_send

    return install


def _greedy() -> None:
    generate = engine_module.VLLMEngine.generate

    async def greedy_generate(self, request):
        return await generate(self, request.model_copy(update={"temperature": 0.0}))

    engine_module.VLLMEngine.generate = greedy_generate


#: Each lie, as what it changes in the real host.
LIES: dict[str, Callable[[], None]] = {
    "shifted": _results(lambda result: result.model_copy(update={"log_probs": [x - 0.01 for x in result.log_probs]})),
    "scaled": _results(lambda result: result.model_copy(update={"log_probs": [1.02 * x for x in result.log_probs]})),
    "greedy": _greedy,
}


if __name__ == "__main__":
    LIES[sys.argv[1]]()
    sys.exit(main(sys.argv[2:]))
