"""Tag each rollout with the server that generated it, so HeteroRL can report per-sampler-group throughput.

verl 0.9.1's ``LLMServerClient.generate`` picks a rollout server through the global load balancer
(``_acquire_server`` returns its id, the server address) but does not record it in the output. This
patch remembers the id in a context variable when the server is acquired and adds
``extra_fields["server_id"]`` to the ``TokenOutput`` of ``LLMServerClient.generate`` and of
``FullyAsyncLLMServerClient.generate`` (which rebuilds ``extra_fields`` after partial-rollout
resumes; the last server used is recorded). verl carries ``extra_fields`` into TransferQueue with the
trajectory. Applied only in HeteroRL runs (``GEPO_SERVER_IDENTITY=1``, set in the Ray runtime env
by ``hetero.enable=true``; the names are the glue's, :mod:`gepo_plugin.verl_glue.hetero.server_identity`);
nothing else changes.
"""

from __future__ import annotations

import contextvars
import functools

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam
from gepo_plugin.verl_glue.hetero.server_identity import SERVER_ID

_LAST_SERVER: contextvars.ContextVar[str | None] = contextvars.ContextVar("gepo_last_server", default=None)


def _tagging(generate):
    @functools.wraps(generate)
    async def wrapper(self, *args, **kwargs):
        output = await generate(self, *args, **kwargs)
        server = _LAST_SERVER.get()
        extra = getattr(output, "extra_fields", None)
        if server is not None and isinstance(extra, dict):
            extra[SERVER_ID] = server
        return output

    wrapper.__wrapped__ = generate
    return wrapper


_CLIENT = "verl.workers.rollout.llm_server.LLMServerClient"
_ASYNC_CLIENT = "verl.workers.rollout.llm_server.FullyAsyncLLMServerClient"


def _apply() -> None:
    acquire = seam.resolve(f"{_CLIENT}._acquire_server")

    @functools.wraps(acquire)
    async def _acquire_server(self, *args, **kwargs):
        server_id, server = await acquire(self, *args, **kwargs)
        _LAST_SERVER.set(server_id)
        return server_id, server

    seam.replace(f"{_CLIENT}._acquire_server", _acquire_server)
    for client in (_CLIENT, _ASYNC_CLIENT):
        seam.replace(f"{client}.generate", _tagging(seam.resolve(f"{client}.generate")))


PATCH = Patch(
    name="server_identity",
    versions={"verl": "==0.9.1"},
    reason="rollout outputs do not say which server generated them (needed for per-sampler-group throughput)",
    apply=_apply,
    feature="server_identity",
    check_contacts=seam.require,
)
