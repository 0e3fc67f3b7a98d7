"""A sampler group's link: a bandwidth limit and a latency applied to its real transfers from the store.

To rehearse a deployment (and to test that a slow group lags because its bytes are slow), each group's reads can
be paced: every request first waits ``latency_ms``, then its bytes flow at no more than ``bandwidth_mbps``. The pacing
is one virtual clock per link, so transfers sharing a link share its bandwidth. Without limits it costs nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pydantic import BaseModel, Field

from gepo_sampler.blocks import STRICT_BLOCK


class LinkConfig(BaseModel):
    """One sampler group's link (``hetero.relay.links[i]``)."""

    model_config = STRICT_BLOCK

    bandwidth_mbps: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="megabits per second the group's reads may use; null = no limit"
    )
    latency_ms: float = Field(0.0, ge=0, allow_inf_nan=False, description="milliseconds added to every request")


@dataclass
class Link:
    """Paces reads to a :class:`LinkConfig`; thread-safe."""

    config: LinkConfig

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    @property
    def limited(self) -> bool:
        return self.config.bandwidth_mbps is not None or self.config.latency_ms > 0

    def request(self) -> None:
        """The latency of one request."""
        if self.config.latency_ms > 0:
            time.sleep(self.config.latency_ms / 1000.0)

    def transfer(self, nbytes: int) -> None:
        """Block until ``nbytes`` more may have crossed the link."""
        if self.config.bandwidth_mbps is None or nbytes <= 0:
            return
        seconds = nbytes * 8 / (self.config.bandwidth_mbps * 1e6)
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + seconds
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)
