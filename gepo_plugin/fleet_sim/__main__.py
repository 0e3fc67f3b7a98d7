"""``python -m gepo_plugin.fleet_sim``: run a slice of a synthetic fleet in this process until SIGTERM, then write
what it saw (:class:`~gepo_plugin.fleet_sim.sampler.FleetStats`) as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from gepo_plugin.fleet_sim.follower import ManifestFollower
from gepo_plugin.fleet_sim.honest import HonestGenerator
from gepo_plugin.fleet_sim.profile import FleetProfile, sampler_name, sampler_token
from gepo_plugin.fleet_sim.sampler import FleetStats, SyntheticSampler
from gepo_sampler.host.gateway_client import GatewayClient
from gepo_sampler.relay.puller import RelayPuller
from gepo_sampler.relay.signing import Verifier
from gepo_sampler.relay.store import RelayStore

#: the environment variable holding the fleet's secret (each sampler's token is derived from it and its name)
SECRET_ENV = "GEPO_FLEET_SECRET"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gepo_plugin.fleet_sim", description=__doc__)
    parser.add_argument("--gateway", required=True, help="the learner's gateway URL (hetero.gateway)")
    parser.add_argument("--first", type=int, required=True, help="index of this process's first sampler")
    parser.add_argument("--count", type=int, required=True, help="samplers in this process")
    parser.add_argument("--store", required=True, help="the run's store: hetero.relay.url/run_id (a directory)")
    parser.add_argument("--run-id", required=True, help="hetero.relay.run_id")
    parser.add_argument("--public-key", required=True, help="the learner's Ed25519 public key (hetero.relay)")
    parser.add_argument("--vocab-size", type=int, required=True, help="the model's vocabulary size")
    parser.add_argument("--stats", required=True, help="write what this process saw here (JSON) when stopped")
    parser.add_argument(
        "--model", help="the model's directory: answers are sampled from it at the claimed version (for the audit)"
    )
    for name, spec in FleetProfile.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(spec.default),
            default=spec.default,
            help=f"{spec.description} ({spec.default})",
        )
    return parser


def _ended(task: asyncio.Task, name: str, stats: FleetStats) -> None:
    """A sampler that stopped before the fleet did (refused by the gateway, an error): counted and said, never
    silent."""
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    stats.counters[f"stopped/{type(error).__name__}"] += 1
    if sum(v for k, v in stats.counters.items() if k.startswith("stopped/")) <= 3:
        print(f"fleet_sim: sampler {name} stopped: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace, profile: FleetProfile, stats: FleetStats) -> None:
    secret = os.environ[SECRET_ENV]
    store = RelayStore(args.store)  # one client, its counters the process's: reads per version per sampler
    verifier = Verifier(args.public_key)
    clients, tasks = [], []
    honest = None
    if args.model:
        honest = HonestGenerator(
            args.model, RelayPuller(store, args.run_id, verifier=verifier), profile.seed + args.first
        )
        tasks.append(asyncio.create_task(honest.run()))
    try:
        for index in range(args.first, args.first + args.count):
            name = sampler_name(index)
            client = await GatewayClient(args.gateway, name, sampler_token(secret, name)).__aenter__()
            clients.append(client)
            follower = ManifestFollower(RelayPuller(store, args.run_id, verifier=verifier))
            liar = index < profile.liars
            sampler = SyntheticSampler(name, client, follower, profile, args.vocab_size, stats, honest, liar)
            task = asyncio.create_task(sampler.run())
            task.add_done_callback(lambda done, name=name: _ended(done, name, stats))
            tasks.append(task)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.__aexit__(None, None, None)
        stats.counters.update({f"store_{k}": v for k, v in store.counters.metrics().items()})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = FleetProfile(**{name: getattr(args, name) for name in FleetProfile.model_fields})
    stats = FleetStats()
    started = time.perf_counter()
    asyncio.run(serve(args, profile, stats))
    record = {
        "samplers": args.count,
        # the cores this process took from the machine it shares with the learner (on average over its life)
        "cores": time.process_time() / (time.perf_counter() - started),
        "latencies": dict(stats.latencies),
        "calls": dict(stats.calls),
        "arrivals": {str(v): [published, times] for v, (published, times) in stats.arrivals.items()},
        "counters": dict(stats.counters),
    }
    Path(args.stats).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
