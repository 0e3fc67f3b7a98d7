"""Every remote sampler's proxy in one process, so that a learner node holds a fleet of a thousand.

A :class:`~gepo_plugin.verl_glue.hetero.remote.proxy.RemoteSamplerProxy` is a few kilobytes of state and a handful of
coroutines; as a Ray actor of its own it was a worker process of ~320 MiB resident (``bench/bench_gateway.py``).
:class:`ProxyPool` holds any number of them by key (a sampler's name and its incarnation: a sampler that rejoins gets
a new proxy under a new key, so nothing meant for the old one reaches it). The gateway's actor holds the pool
(:class:`~gepo_plugin.verl_glue.hetero.remote.gateway.RemoteGateway`), so a sampler's HTTP call reaches its proxy
without a Ray call. :class:`PooledProxy` gives each proxy the face verl and the fleet already use, an actor handle's
(``proxy.generate.remote(...)``: verl's ``LLMServerClient`` reaches a server only through that), so nothing on
verl's side changes. What the learner asks of many samplers at once (their versions, reports, the version window,
health probes, resuming or aborting those that installed a version) is one call, not one per sampler. Retiring a
sampler removes its proxy from the pool; whatever it was asked fails at once, as when a proxy's own process was
killed (:class:`ProxyGone`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from gepo_plugin.verl_glue.hetero.engine_probe import ENGINE_DIED, engine_error
from gepo_plugin.verl_glue.hetero.remote.proxy import RemoteSamplerProxy

#: What a health probe of a proxy no longer in its pool answers (the prober counts it as died).
LEFT_THE_POOL = f"{ENGINE_DIED} (its proxy left its pool: the sampler was retired)"


class ProxyGone(RuntimeError):
    """The sampler's proxy was removed from its pool (retired): its callers treat it as a killed actor."""


class ProxyPool:
    """Remote samplers' proxies by key (in the gateway's actor: every call is a coroutine of its one loop)."""

    def __init__(self) -> None:
        self.proxies: dict[str, RemoteSamplerProxy] = {}

    def add(self, key: str, name: str, *args: Any, **kwargs: Any) -> None:
        """A new proxy for sampler ``name`` under ``key`` (built with the proxy's own arguments)."""
        self.proxies[key] = RemoteSamplerProxy(name, *args, **kwargs)

    async def remove(self, key: str) -> None:
        """Retire ``key``'s proxy: whatever it was asked to generate fails now (a key already gone is no error)."""
        proxy = self.proxies.pop(key, None)
        if proxy is not None:
            proxy.fail_all(ProxyGone(f"remote sampler {proxy.name!r} was retired"))

    def size(self) -> int:
        return len(self.proxies)

    def _proxy(self, key: str) -> RemoteSamplerProxy:
        proxy = self.proxies.get(key)
        if proxy is None:
            raise ProxyGone(f"remote sampler {key.rpartition('#')[0]!r} has no proxy (retired)")
        return proxy

    async def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``key``'s proxy's ``method`` (awaited where it is a coroutine)."""
        answer = getattr(self._proxy(key), method)(*args, **kwargs)
        return await answer if inspect.isawaitable(answer) else answer

    async def call_with(self, key: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(proxy, ...)`` on ``key``'s proxy, as Ray's ``__ray_call__`` runs one on an actor's instance."""
        answer = function(self._proxy(key), *args, **kwargs)
        return await answer if inspect.isawaitable(answer) else answer

    # ------------------------------------------------------------------ one call for the whole pool
    async def probe(self, keys: list[str]) -> dict[str, str | None]:
        """Each proxy's health (:func:`engine_error`: None while its sampler may serve), answered on this loop."""
        return {key: engine_error(p) if (p := self.proxies.get(key)) is not None else LEFT_THE_POOL for key in keys}

    async def reports(self, keys: list[str]) -> dict[str, dict]:
        """The reports (:meth:`RemoteSamplerProxy.report`) of those of ``keys`` still in the pool."""
        return {key: await self.proxies[key].report() for key in keys if key in self.proxies}

    def versions(self, keys: list[str]) -> dict[str, int | None]:
        """The version each of ``keys`` holds (None: none yet, or it cannot serve: dead, failed), for the fleet's
        frequent check of what was installed (the full reports are read once a step)."""
        out = {}
        for key in keys:
            proxy = self.proxies.get(key)
            if proxy is not None and proxy.status is not None and proxy.why_dead() is None:
                out[key] = proxy.status.version
        return out

    async def call_many(self, keys: list[str], method: str, **kwargs: Any) -> None:
        """``method`` on each of ``keys``' proxies at once (resume or abort those of a group that installed a
        version); one gone meanwhile is skipped (its retirement fails what it held)."""
        proxies = [self.proxies[key] for key in keys if key in self.proxies]
        await asyncio.gather(*(getattr(proxy, method)(**kwargs) for proxy in proxies))

    async def set_window(self, first: int, latest: int) -> None:
        """Every proxy's window of versions (:meth:`RemoteSamplerProxy.set_window`)."""
        for proxy in self.proxies.values():
            await proxy.set_window(first, latest)


class _PooledMethod:
    """One method of a pooled proxy, called as an actor's method is: ``.remote(...)`` returns an ObjectRef."""

    def __init__(self, pool: Any, key: str, method: str) -> None:
        self.pool, self.key, self.method = pool, key, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.method == "__ray_call__":
            return self.pool.call_with.remote(self.key, *args, **kwargs)
        return self.pool.call.remote(self.key, self.method, *args, **kwargs)


class PooledProxy:
    """One sampler's proxy in a :class:`ProxyPool`, with an actor handle's face (picklable: it travels to verl's
    load balancer and agent-loop workers like a handle)."""

    def __init__(self, pool: Any, key: str) -> None:
        self.pool, self.key = pool, key

    def __getattr__(self, method: str) -> _PooledMethod:
        if method.startswith("__") and method != "__ray_call__":
            raise AttributeError(method)
        return _PooledMethod(self.pool, self.key, method)

    @property
    def __ray_call__(self) -> _PooledMethod:  # the health probe runs a function on the server's instance
        return _PooledMethod(self.pool, self.key, "__ray_call__")

    def retire(self) -> Any:
        """Remove the proxy from its pool (what killing a proxy's process was): an ObjectRef to wait on if needed."""
        return self.pool.remove.remote(self.key)

    def __reduce__(self):
        return (PooledProxy, (self.pool, self.key))

    def __repr__(self) -> str:
        return f"PooledProxy({self.key!r})"
