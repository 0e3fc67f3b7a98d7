"""Benchmark: the remote samplers' gateway under --samplers simulated samplers (64): calls per second and the time a
call takes through it (p50, p99), for this tree and for --before (by default the revision before the gateway checked
what samplers report), measured in one run.

Each revision runs in a child process of its own (--before from a ``git worktree``, put ahead of the editable install
on the import path, its Ray workers' too): a local Ray, the gateway and one proxy per sampler as Ray actors exactly as
a run builds them (``RemoteSamplers``), and the samplers in one asyncio process dialling it over HTTP with their own
tokens, each repeating for --seconds after --warm-up seconds: a status report (what the checks read: versions,
counters), a poll answered at once (nothing queued; the gateway's poll_wait_s is 1 ms) and a results message of
--results results of --tokens tokens for requests it was never sent (each parsed and refused: nothing trained). Two
loads: **saturated**, every sampler calling again as soon as it is answered (the gateway's throughput; a call's time
is then mostly its wait in the queue), and **paced**, every sampler's three calls once every --cycle-s seconds (more
than a real sampler's pace: a long poll every poll_wait_s, a status at each install, results per batch), whose
latencies are what the gateway adds to a call. A
call's round trip is the gateway's work alone (authentication, the body, the Ray call into the sampler's proxy, the
proxy's checks and its answer): what the gateway adds to a sampler's call. The revisions run one after the other (the
machine's two cores are all the load's), --repeats times each, interleaved; medians are reported, and the memory the
proxies hold (one process per sampler).

    python bench/bench_gateway.py                                   # about 9 minutes on 2 cores
    python bench/bench_gateway.py --samplers 16 --seconds 10 --json out.json
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_output_options, script_parser, write_json_around

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' free port
#: the last revision before the gateway checked what samplers report (the commit after it: "the gateway checks ...")
BEFORE_CHECKS = "098cd34"
ROUTES = ("status", "poll", "results")
#: each sampler calls as fast as it is answered (the gateway's throughput), then at a sampler's pace (its latency)
LOADS = ("saturated", "paced")


def measure(args) -> dict:
    """In the child: the gateway of the revision on the import path, under the load; calls per second and latencies."""
    import aiohttp
    import psutil
    import ray
    from free_ports import free_port

    import gepo_plugin
    from gepo_plugin.hetero.settings import parse_hetero
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers
    from gepo_sampler.relay.signing import generate_pair
    from gepo_sampler.remote.protocol import SamplerStatus, VersionWindow

    names = [f"s{i:04d}" for i in range(args.samplers)]
    tokens = {name: secrets.token_urlsafe(24) for name in names}
    for name, token in tokens.items():
        os.environ[f"GEPO_BENCH_TOKEN_{name}"] = token  # before Ray starts: its workers read them
    os.environ["GEPO_BENCH_KEY"] = generate_pair()[0]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="bench_gateway_") as tmp:
        hetero = parse_hetero(
            {
                "enable": True,
                "transport": "relay",
                "relay": {"url": tmp, "run_id": "b", "signing_key_env": "GEPO_BENCH_KEY", "public_key": "ab" * 32},
                "remote_samplers": [{"name": n, "token_env": f"GEPO_BENCH_TOKEN_{n}"} for n in names],
                "gateway": {"host": "127.0.0.1", "port": free_port(), "poll_wait_s": 0.001},
            }
        )
        hello = {"run_id": "b", "relay_url": tmp, "first_version": 0, "learner_version": 0}
        started = time.perf_counter()
        remote = RemoteSamplers(hetero, 0, VersionWindow(first=0, latest=0), 256, args.tokens, hello, 100_000)
        ray.get([replica.proxy.report.remote() for replica in remote.replicas.values()])  # every proxy up
        start_s = time.perf_counter() - started
        status = SamplerStatus(version=0, counters={"generated": 12.0, "pulls": 1.0}).model_dump_json().encode()
        results = json.dumps(
            {
                "results": [
                    {
                        "request_id": f"never-sent-{i}",
                        "token_ids": list(range(5, 5 + args.tokens)),
                        "log_probs": [-0.5] * args.tokens,
                        "finish_reason": "length",
                        "version": 0,
                    }
                    for i in range(args.results)
                ]
            }
        ).encode()
        bodies = {"status": status, "poll": status, "results": results}

        async def sampler(name: str, cycle_s: float, until: float, warm_until: float, latencies: dict) -> None:
            headers = {"Authorization": f"Bearer {tokens[name]}", "Content-Type": "application/json"}
            async with aiohttp.ClientSession(headers=headers) as session:
                if cycle_s:  # paced samplers start spread over one cycle
                    await asyncio.sleep(cycle_s * names.index(name) / len(names))
                while (now := time.perf_counter()) < until:
                    for route in ROUTES:
                        began = time.perf_counter()
                        url = f"{remote.url}/v1/samplers/{name}/{route}"
                        async with session.post(url, data=bodies[route]) as answer:
                            await answer.read()
                            assert answer.status == 200, (route, answer.status, await answer.text())
                        if now >= warm_until:
                            latencies[route].append(time.perf_counter() - began)
                    if cycle_s:
                        await asyncio.sleep(max(0.0, now + cycle_s - time.perf_counter()))

        async def load(cycle_s: float) -> dict:
            latencies: dict[str, list[float]] = {route: [] for route in ROUTES}
            warm_until = time.perf_counter() + args.warm_up
            until = warm_until + args.seconds
            await asyncio.gather(*(sampler(name, cycle_s, until, warm_until, latencies) for name in names))
            return {
                "calls_per_s": {route: len(values) / args.seconds for route, values in latencies.items()},
                "p50_ms": {route: 1e3 * statistics.median(values) for route, values in latencies.items()},
                "p99_ms": {route: 1e3 * statistics.quantiles(values, n=100)[98] for route, values in latencies.items()},
            }

        loads = {"saturated": asyncio.run(load(0.0)), "paced": asyncio.run(load(args.cycle_s))}
        proxies_rss = sum(  # the learner node's memory the samplers' proxies hold (a process each)
            process.info["memory_info"].rss
            for process in psutil.process_iter(["name", "memory_info"])
            if (process.info["name"] or "").startswith("ray::RemoteSampler")
        )
        ray.get(remote.gateway.stop.remote())
    ray.shutdown()
    return {
        "revision": str(Path(gepo_plugin.__file__).resolve().parents[1]),
        "proxies_start_s": start_s,
        "proxies_rss_mb": proxies_rss / 2**20,
        **loads,
    }


def _child(args, label: str, source: Path) -> dict:
    """One revision measured in a process of its own: ``source``'s packages ahead of the editable install. The script
    runs from ``source``, in it: Ray puts its driver's directories first on its workers' import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(source), str(source / "sampler"), *filter(None, [env.get("PYTHONPATH")])])
    script = source / "bench" / Path(__file__).name
    if not script.exists():  # an older revision: this script beside its bench/common.py
        shutil.copy(__file__, script)
    command = [sys.executable, str(script), "--child", *sys.argv[1:]]
    print(f"[bench_gateway] {label}: {args.samplers} samplers, {args.seconds:g} s ...", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=source)
    if done.returncode != 0:
        raise SystemExit(f"{label} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    settings = ("samplers", "seconds", "warm_up", "cycle_s", "results", "tokens", "repeats")
    record: dict = {key: getattr(args, key) for key in settings}
    revision = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True, check=True)
    record["before_revision"] = revision.stdout.strip()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench_gateway_before_") as tmp:
        worktree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            for _ in range(args.repeats):  # interleaved: the machine's drift hits both
                runs["before"].append(_child(args, f"before the checks ({args.before})", worktree))
                runs["after"].append(_child(args, "this tree", ROOT))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    if runs["before"][0]["revision"] == runs["after"][0]["revision"]:
        raise SystemExit(f"both runs imported {runs['after'][0]['revision']}: the worktree did not come first")
    record["runs"] = runs
    for side, measured in runs.items():  # medians over the repeats
        record[side] = {
            load: {
                key: {route: statistics.median(run[load][key][route] for run in measured) for route in ROUTES}
                for key in ("calls_per_s", "p50_ms", "p99_ms")
            }
            for load in LOADS
        } | {"proxies_rss_mb": statistics.median(run["proxies_rss_mb"] for run in measured)}
    return record


def report(record: dict) -> dict:
    before, after = record["before"], record["after"]
    print(f"\n{record['samplers']} samplers, {record['seconds']:g} s a load; before = {record['before_revision'][:10]}")
    ratios = {}
    for load in LOADS:
        what = "as fast as they are answered" if load == "saturated" else f"a cycle every {record['cycle_s']:g} s"
        print(f"\n{load} ({what}):")
        print(f"{'call':8} {'calls/s before':>15} {'after':>9} {'ratio':>6} | {'p50 ms before':>14} {'after':>7} "
              f"{'ratio':>6} | {'p99 ms before':>14} {'after':>7} {'ratio':>6}")  # fmt: skip
        for route in ROUTES:
            cells = []
            for key in ("calls_per_s", "p50_ms", "p99_ms"):
                b, a = before[load][key][route], after[load][key][route]
                ratios[f"{load}/{route}/{key}"] = a / b
                cells.append(f"{b:14.1f} {a:7.1f} {a / b:6.2f}")
            print(f"{route:8} " + " | ".join(cells))
    per_sampler = after["proxies_rss_mb"] / record["samplers"]
    print(f"\nthe proxies' memory: {before['proxies_rss_mb']:.0f} MiB before, {after['proxies_rss_mb']:.0f} MiB after "
          f"({per_sampler:.0f} MiB per sampler, resident, shared pages counted in each)")  # fmt: skip
    return {"ratios_after_over_before": ratios}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--samplers", type=int, default=64, help="simulated samplers, one proxy each (64)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds of each load (30)")
    parser.add_argument("--warm-up", type=float, default=5.0, help="seconds of load before measuring (5)")
    parser.add_argument(
        "--cycle-s", type=float, default=1.0, help="the paced load: each sampler's three calls every this many s (1)"
    )
    parser.add_argument("--results", type=int, default=4, help="results per results message (4)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per result (64)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each revision, interleaved; medians (2)")
    parser.add_argument(
        "--before", default=BEFORE_CHECKS, help=f"the revision to compare with ({BEFORE_CHECKS}: before the checks)"
    )
    parser.add_argument("--child", action="store_true", help="(internal) measure the revision on the import path")
    add_output_options(parser, "both revisions' figures and the ratios")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    record = run(args)
    write_json_around(args.json, record, lambda: report(record))


if __name__ == "__main__":
    main()
