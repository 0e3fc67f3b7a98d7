"""The weight relay through verl's real separate_async trainer on CPU, on three Ray nodes, over a real S3 server.

The learner (head node, started with examples/ray/start_head.sh) publishes each version to moto's S3 server over
HTTP; two sampler groups on two other Ray nodes (start_worker.sh) pull over their own links, one limited to 4 Mbit/s.
While it trains, the test corrupts a stored shard (the samplers must detect it and get a keyframe) and kills a whole
sampler node (its raylet and every process on it); the run finishes on the other sampler, then a resumed run
continues from the store. Nothing in the run is mocked or hooked.
"""

from __future__ import annotations

import threading
import time

import pytest
from chaos import start_run, wait_for_step
from ray_nodes import HEAD_IP, LEARNER_RESOURCE, SAMPLER_NODE_CPUS, actors_by_ip, ray_nodes
from relay_fixtures import s3_server

from gepo_plugin.hetero.relay.manifest import Manifest
from gepo_plugin.hetero.relay.publisher import MANIFESTS, parse_manifest_name, shard_key
from gepo_plugin.hetero.relay.store import RelayStore
from gepo_plugin.tiny import cpu_run_overrides, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

MAX_LAG, SLOW_MBPS, LATENCY_MS = 2, 4.0, 20.0
#: what may run on a sampler node: the rollout server and its checkpoint-engine worker (and Ray's idle workers)
SAMPLER_ACTORS = {"HFGenerationServer", "CheckpointEngineWorker"}
STEPS, RESUMED_STEPS, SAVE_FREQ, KILL_AFTER, CORRUPT_VERSION = 8, 10, 4, 4, 3


def relay_overrides(tiny, workdir, steps: int, address: str, url: str, endpoint: str) -> list[str]:
    return [
        *cpu_run_overrides(tiny, loss="gepo", mode="separate_async", steps=steps, output_dir=str(workdir)),
        f"trainer.save_freq={SAVE_FREQ}",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=2",  # one sampler replica on each of the two worker nodes
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.hybrid_engine=False",
        "hetero.enable=true",
        f"hetero.max_lag={MAX_LAG}",
        "hetero.strategy=wait",
        "hetero.transport=relay",
        f"hetero.relay.url={url}",
        f"+hetero.relay.storage_options.client_kwargs.endpoint_url={endpoint}",
        f"hetero.relay.links=[{{bandwidth_mbps:{SLOW_MBPS},latency_ms:{LATENCY_MS}}},{{}}]",
        "hetero.relay.poll_s=0.2",
        f"+transfer_queue.backend.SimpleStorage.required_node_resource={LEARNER_RESOURCE}",
        f"++ray_kwargs.ray_init.address={address}",
        f"++ray_kwargs.ray_init._node_ip_address={HEAD_IP}",
        "ray_kwargs.ray_init.num_cpus=null",
        "++ray_kwargs.ray_init.num_gpus=null",
    ]


def corrupt_when_published(store: RelayStore, version: int, stop: threading.Event, done: list[str]) -> None:
    """Overwrite version ``version``'s delta shard in the bucket as soon as its manifest appears."""
    while not stop.is_set():
        for name in store.list(MANIFESTS):
            parsed = parse_manifest_name(name)
            if parsed and parsed[0] == version:
                manifest = Manifest.from_json(store.get(f"{MANIFESTS}/{name}").decode())
                shard = manifest.delta[0]
                store.fs.pipe_file(store.path(shard_key(shard.sha256)), b"\0" * shard.nbytes)
                done.append(shard.sha256)
                return
        time.sleep(0.05)


def _check_every_step(metrics: dict[int, dict]) -> None:
    for step, m in sorted(metrics.items()):
        if "hetero/produced" in m:
            queued = m["hetero/queued"]
            assert m["hetero/produced"] == m["hetero/trained"] + m["hetero/dropped"] + queued, (step, m)
            assert m["hetero/lag/max"] <= MAX_LAG, (step, m["hetero/lag/max"])


def test_relay_over_s3_on_three_ray_nodes_survives_corruption_and_a_lost_node_then_resumes(tiny, tmp_path):
    workdir = tmp_path / "run"
    with s3_server() as (bucket, options), ray_nodes(head_gpus=2, worker_gpus=[1, 1]) as cluster:
        address, nodes = cluster.address, cluster.nodes
        endpoint = options["client_kwargs"]["endpoint_url"]
        url = f"{bucket}/runs"
        run_store = RelayStore(f"{url}/gepo_tiny/tiny_gepo_separate_async", options)
        stop, corrupted = threading.Event(), []
        watcher = threading.Thread(target=corrupt_when_published, args=(run_store, CORRUPT_VERSION, stop, corrupted))
        watcher.start()
        process, metrics_path, log = start_run(relay_overrides(tiny, workdir, STEPS, address, url, endpoint), workdir)
        try:
            before_kill = wait_for_step(process, metrics_path, KILL_AFTER + 1, timeout_s=600)
            placed = actors_by_ip(address)
            # a node that only samples: a sampler's server there and nothing the run cannot lose
            victims = [n for n in nodes.values() if n.name != "head" and set(placed.get(n.ip, [])) <= SAMPLER_ACTORS]
            assert victims and any("HFGenerationServer" in placed.get(n.ip, []) for n in victims), placed
            victim = next(n for n in victims if "HFGenerationServer" in placed.get(n.ip, []))
            victim.kill()  # a whole sampler node: its raylet and every process on it
            process.wait(timeout=600)
        finally:
            stop.set()
            watcher.join()
            if process.poll() is None:
                process.kill()
        text = log.read_text()
        assert process.returncode == 0, text[-5000:]

        metrics = read_metrics(metrics_path)
        assert sorted(metrics) == list(range(1, STEPS + 1))
        _check_every_step(metrics)

        # the slow group lags because its bytes are slow: its arrivals are later by about bytes / bandwidth
        m = before_kill[KILL_AFTER]
        slow_bytes = m["hetero/sampler_group_0/relay_bytes"] / max(m["hetero/sampler_group_0/installs"], 1)
        link_s = slow_bytes * 8 / (SLOW_MBPS * 1e6)
        lag_slow = m["hetero/sampler_group_0/arrival_lag_mean_s"]
        lag_fast = m["hetero/sampler_group_1/arrival_lag_mean_s"]
        assert lag_slow - lag_fast >= 0.7 * link_s, (lag_slow, lag_fast, link_s)
        assert lag_fast < lag_slow

        # the corrupted shard was detected, fetched again, and a keyframe got the samplers past it
        final = metrics[STEPS]
        assert corrupted and final["hetero/relay/samplers/shards_corrupt"] >= 1
        assert final["hetero/relay/keyframes"] >= 2
        # a step's metrics come before its own publish: at step 8, versions 0..7 were published, each once
        assert final["hetero/relay/versions_published"] == STEPS

        # the lost node was retired through the elastic path and counted; the other sampler finished the run
        assert final["hetero/sampler_failures"] == 1 and final["hetero/sampler_replicas_alive"] == 1
        assert sum(final[f"hetero/sampler_group_{g}/alive"] for g in (0, 1)) == 1

        # resume on a fresh sampler node: the learner continues from the store (nothing discarded or re-published)
        cluster.add_worker(1, SAMPLER_NODE_CPUS)  # a new machine takes the lost one's place
        resumed_dir = tmp_path / "resumed"
        resumed_dir.mkdir()
        overrides = relay_overrides(tiny, workdir, RESUMED_STEPS, address, url, endpoint)
        process, metrics_path, log = start_run(overrides, resumed_dir)
        process.wait(timeout=900)
        assert process.returncode == 0, log.read_text()[-5000:]
        resumed = read_metrics(metrics_path)
        assert sorted(resumed) == [STEPS + 1, STEPS + 2], sorted(resumed)
        _check_every_step(resumed)
        last = resumed[RESUMED_STEPS]
        # by step 10's metrics only version 9 was published: version 8 came from the store, not published again
        assert last["hetero/relay/versions_published"] == RESUMED_STEPS - STEPS - 1
        assert last.get("hetero/relay/versions_discarded", 0) == 0
        assert min(last[f"hetero/sampler_group_{g}/weight_version"] for g in (0, 1)) >= STEPS
