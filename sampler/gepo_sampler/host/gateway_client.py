"""The sampler host's side of the wire: it dials the learner's gateway (one HTTPS URL) and opens no port itself.

Every call carries the sampler's bearer token, verifies the gateway's certificate (a private CA or a self-signed
certificate with ``--ca-cert``), has a timeout and a body-size limit. A call the gateway refuses with 401 (a wrong
token, or a name the learner does not know: the gateway answers both alike), 403 (quarantined), 404 (a name an older
gateway does not know) or 426 (another protocol: both sides' versions and the fix) is permanent: the host stops and says
why. 410 means the learner retired this sampler: the host keeps polling and rejoins when the learner takes it back.
"""

from __future__ import annotations

import json
import ssl

import aiohttp

from gepo_sampler import __version__
from gepo_sampler.remote.protocol import (
    PACKAGE_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    Hello,
    Results,
    SamplerStatus,
    Work,
    protocol_mismatch,
)


class GatewayRefused(RuntimeError):
    """The gateway refused this sampler for good (wrong token, unknown name, another protocol)."""


class GatewayRetired(RuntimeError):
    """The learner retired this sampler; it may rejoin (poll again)."""


def ssl_context(url: str, ca_cert: str | None) -> ssl.SSLContext | bool:
    """Certificate checks for an https URL (system CAs, or ``ca_cert``); plain HTTP needs none."""
    if not url.startswith("https://"):
        return False
    context = ssl.create_default_context(cafile=ca_cert)
    return context


class GatewayClient:
    def __init__(
        self, url: str, name: str, token: str, ca_cert: str | None = None, timeout_s: float = 60.0, max_body_mb=16.0
    ) -> None:
        self.base = f"{url.rstrip('/')}/v1/samplers/{name}"
        self.name = name
        self._headers = {
            "Authorization": f"Bearer {token}",
            PROTOCOL_HEADER: str(PROTOCOL_VERSION),
            PACKAGE_HEADER: __version__,
        }
        self._ssl = ssl_context(url, ca_cert)
        self.timeout_s = timeout_s
        self.max_body = int(max_body_mb * (1 << 20))
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> GatewayClient:
        self._session = aiohttp.ClientSession(
            headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s), max_field_size=8190
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: str | None = None, timeout_s: float | None = None) -> dict:
        if body is not None and len(body) > self.max_body:
            raise ValueError(f"a {len(body)}-byte body exceeds the {self.max_body}-byte limit")
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        async with self._session.request(
            method,
            self.base + path,
            data=body,
            ssl=self._ssl,
            timeout=timeout,
            headers={"Content-Type": "application/json"} if body is not None else None,
        ) as response:
            text = await response.content.read(self.max_body + 1)
            if len(text) > self.max_body:
                raise ValueError(f"the gateway's answer exceeds the {self.max_body}-byte limit")
            if response.status in (401, 403, 404, 426):
                why = text[:1000].decode(errors="replace")
                raise GatewayRefused(f"the gateway refused sampler {self.name!r}: HTTP {response.status}: {why}")
            if response.status == 410:
                raise GatewayRetired(text.decode(errors="replace")[:300])
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=text.decode(errors="replace")[:300]
                )
            return json.loads(text)

    async def hello(self) -> Hello:
        """The run this sampler joins; a gateway of another protocol is refused before its hello is read (a new
        protocol may change the hello itself)."""
        answer = await self._call("GET", "/hello")
        mismatch = protocol_mismatch(
            (answer.get("protocol"), answer.get("package", "unknown")), (PROTOCOL_VERSION, __version__)
        )
        if mismatch is not None:
            raise GatewayRefused(mismatch)
        return Hello.model_validate(answer)

    async def poll(self, status: SamplerStatus, wait_s: float) -> Work:
        """Report ``status``; get work (waits up to ``wait_s`` on the gateway for some)."""
        answer = await self._call("POST", "/poll", status.model_dump_json(), timeout_s=wait_s + self.timeout_s)
        return Work.model_validate(answer)

    async def report(self, status: SamplerStatus) -> None:
        """Report ``status`` now, outside the long poll (a version installed)."""
        await self._call("POST", "/status", status.model_dump_json())

    async def send(self, results: Results) -> dict:
        return await self._call("POST", "/results", results.model_dump_json())
