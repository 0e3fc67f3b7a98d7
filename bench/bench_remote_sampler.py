"""Benchmark: one vLLM engine reached directly and through the remote sampler's path (gateway, proxy, host).

A sampler host (``python -m gepo_sampler``: vLLM's CPU build on localhost, outside Ray) joins a relay run
whose weights are in moto's S3 server, and the learner's side runs as in a HeteroRL run: the gateway and the
sampler's proxy as Ray actors. The same requests (``--concurrency`` at a time, ``--requests`` in all, token ids in,
``--lengths`` new tokens each) are sent two ways, interleaved per length (``--repeats`` times each, after one
untimed round that warms both paths up; medians reported):

* **direct**: to the host's vLLM server itself (``/v1/completions``, what the host sends it);
* **remote**: as verl's agent loop does, to the proxy's ``generate`` (Ray), which the host collects with its long
  poll through the gateway (HTTP), runs on the same vLLM and answers.

Reported per length: generated tokens per second each way and their ratio (remote / direct: the path's overhead),
the seconds one batch of ``--requests`` takes each way (a step's sampling time when a step trains that many
rollouts: what the learner waits for) and the time the path adds to one request (the batch's extra seconds times
``--concurrency`` over ``--requests``), the bytes a rollout costs on the wire (its request and result messages as
JSON), and the seconds from the learner's publication of a new version to the host's install of it
(``--publishes`` versions).

    python bench/bench_remote_sampler.py                        # about 4 minutes on 2 cores
    python bench/bench_remote_sampler.py --lengths 16 128 --json out.json
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import add_generation_options, add_output_options, script_parser, write_json_around

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the store, host and hosts' helpers


def run(args) -> dict:
    import aiohttp
    import ray
    import torch
    from relay_fixtures import s3_server
    from remote_hosts import free_port, start_host, stop, wait_for
    from safetensors.torch import load_file

    from gepo_plugin.hetero.settings import parse_hetero
    from gepo_plugin.tiny import write_all
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers
    from gepo_sampler.relay.publisher import RelayPublisher
    from gepo_sampler.relay.signing import Signer, generate_pair
    from gepo_sampler.relay.store import open_store
    from gepo_sampler.remote.protocol import GenerateRequest, Result, VersionWindow

    private, public = generate_pair()
    token = secrets.token_urlsafe(24)
    os.environ["GEPO_BENCH_TOKEN"], os.environ["GEPO_BENCH_KEY"] = token, private
    record: dict = {"lengths": {}, "install_s": [], "requests": args.requests, "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as tmp, s3_server() as (url, options):
        tiny = write_all(Path(tmp) / "tiny", for_vllm=True)
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        hetero = parse_hetero(
            {
                "enable": True,
                "transport": "relay",
                "relay": {
                    "url": url,
                    "run_id": "bench",
                    "storage_options": options,
                    "signing_key_env": "GEPO_BENCH_KEY",
                    "public_key": public,
                },
                "remote_samplers": [{"name": "far", "token_env": "GEPO_BENCH_TOKEN"}],
                "gateway": {"host": "127.0.0.1", "port": free_port(), "poll_wait_s": 5.0},
            }
        )
        publisher = RelayPublisher(open_store(hetero.relay), "bench", hetero.relay, signer=Signer(private))
        weights = load_file(f"{tiny['model']}/model.safetensors")
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        publisher.publish(0, weights)
        publisher.wait()
        hello = {"run_id": "bench", "relay_url": url, "first_version": 0, "learner_version": 0}
        max_len = 16 + max(args.lengths)
        remote = RemoteSamplers(hetero, 0, VersionWindow(first=0, latest=0), 256, 8, hello, 100_000)
        proxy = remote.replicas["far"].proxy
        vllm_port = free_port()
        host, _ = start_host(
            remote.url, "far", token, public, tiny["model"], url, options, Path(tmp), max_len, vllm_port=vllm_port
        )
        try:

            def held() -> int | None:
                status = ray.get(proxy.report.remote())["status"]
                return None if status is None else status["version"]

            wait_for(lambda: held() == 0, "the host installing version 0", 900)
            engine_url = f"http://127.0.0.1:{vllm_port}"
            prompts = [[5 + (i % 20), 9, 12 + (i % 7), 3] for i in range(args.requests)]
            warming = True
            for length in [min(args.lengths), *args.lengths]:  # the first round warms both paths up, untimed
                params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": length}
                row = {}
                for way in ("direct", "remote") * args.repeats:  # interleaved: drift hits both
                    if way == "direct":
                        tokens, seconds = asyncio.run(_direct(engine_url, prompts, length, args.concurrency, aiohttp))
                    else:
                        tokens, seconds = asyncio.run(_remote(proxy, prompts, params, args.concurrency))
                    row.setdefault(way, []).append(tokens / seconds)
                    row.setdefault(f"{way}_s", []).append(seconds)
                if warming:
                    warming = False
                    continue
                request = GenerateRequest(request_id="x" * 36, prompt_ids=prompts[0], max_tokens=length)
                result = Result(
                    request_id="x" * 36,
                    token_ids=[1] * length,
                    log_probs=[-1.234567] * length,
                    finish_reason="stop",
                    version=0,
                )
                record["lengths"][length] = {
                    "direct_tokens_per_s": statistics.median(row["direct"]),
                    "remote_tokens_per_s": statistics.median(row["remote"]),
                    "direct_batch_s": statistics.median(row["direct_s"]),
                    "remote_batch_s": statistics.median(row["remote_s"]),
                    "bytes_per_rollout": len(request.model_dump_json()) + len(result.model_dump_json()),
                }
            for version in range(1, args.publishes + 1):
                torch.manual_seed(version)
                moved = {n: t + 1e-3 * torch.randn_like(t) for n, t in weights.items()}
                started = time.monotonic()
                publisher.publish(version, moved)
                remote.set_window(0, version)
                wait_for(lambda v=version: held() == v, f"the host installing version {version}", 300, 0.05)
                record["install_s"].append(time.monotonic() - started)
        finally:
            stop(host)
            publisher.close()
            ray.shutdown()
    return record


async def _direct(url: str, prompts: list[list[int]], length: int, concurrency: int, aiohttp) -> tuple[int, float]:
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        model = (await (await session.get(url + "/v1/models")).json())["data"][0]["id"]

        async def one(prompt):
            async with semaphore:
                body = {"model": model, "prompt": prompt, "max_tokens": length, "temperature": 1.0, "logprobs": 0}
                body["return_token_ids"] = True
                async with session.post(url + "/v1/completions", json=body) as response:
                    return len((await response.json())["choices"][0]["token_ids"])

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - started


async def _remote(proxy, prompts, params, concurrency) -> tuple[int, float]:
    """The same requests as :func:`_direct`, as many at a time, through the proxy (verl's agent loop awaits a Ray
    call to its ``generate``)."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with semaphore:
            out = await proxy.generate.remote(prompt, params, request_id=secrets.token_hex(4))
            return len(out.token_ids)

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - started


def report(record: dict) -> dict:
    derived = {}
    print(
        f"\n{'new tokens':>10} {'direct tok/s':>13} {'remote tok/s':>13} {'remote/direct':>14} "
        f"{'batch direct s':>15} {'batch remote s':>15} {'bytes/rollout':>14}"
    )
    waves = record["requests"] / record["concurrency"]  # a batch's requests, as many at a time as allowed
    for length, row in record["lengths"].items():
        ratio = row["remote_tokens_per_s"] / row["direct_tokens_per_s"]
        derived[f"ratio_{length}"] = ratio
        print(
            f"{length:>10} {row['direct_tokens_per_s']:>13.1f} {row['remote_tokens_per_s']:>13.1f} {ratio:>14.2f} "
            f"{row['direct_batch_s']:>15.2f} {row['remote_batch_s']:>15.2f} {row['bytes_per_rollout']:>14}"
        )
    for length, row in record["lengths"].items():
        # the time the path adds to one request: the batch's extra seconds, spread over its waves of requests
        added = (row["remote_batch_s"] - row["direct_batch_s"]) / waves
        derived[f"added_s_per_request_{length}"] = added
        print(f"{length} new tokens: the remote path adds {1000 * added:.0f} ms per request")
    if record["install_s"]:
        print(f"publish -> installed on the remote sampler: median {statistics.median(record['install_s']):.2f} s")
    return derived


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    add_generation_options(parser, "requests per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per length and way; medians (5)")
    parser.add_argument("--publishes", type=int, default=3, help="versions published to time their install (3)")
    add_output_options(parser, "the measurements")
    args = parser.parse_args(argv)
    record = run(args)
    write_json_around(args.json, record, lambda: report(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
