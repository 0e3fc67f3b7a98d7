"""Benchmark: the weight relay's bytes per version (full against delta) and its throughput, beside the machine's own.

Over real training steps (AdamW, fp32 master weights, each version published in bf16 as a rollout engine receives
it; the loss is the policy-gradient form -A * log p(response) on sequences with random +-1 advantages), for the
tiny Llama model of the CPU tests and a Llama-architecture model of about 110M parameters, at RL learning rates:

- bytes per version: a keyframe against an exact zstd-compressed sparse delta, and the share of bf16 elements that
  changed;
- throughput in GB/s of weights: delta encode and apply (both without zstd, which the pull+apply figure includes),
  the digest (xxHash3-128 of every tensor's bits, which every manifest carries and every install is checked against)
  and the staging copy (a pull applies into a fresh copy of the tensors it changes, never into the held version),
  full publish (the host copy and a keyframe written to a fresh directory store, a median over the steps, beside
  this machine's memory-copy and disk-write bandwidth measured in the same run), pull and apply (staging copy,
  apply and digest check included);
- from those, the transfer time of one version of Qwen3-1.7B and of an 8B model at 1 Gbit/s and 100 Mbit/s.

    python bench/bench_relay.py                    # tiny + ~110M model, lr 1e-6 and 1e-5, 6 steps each (~6 min)
    python bench/bench_relay.py --steps 3 --hidden 384 --layers 4   # a quick look
    python bench/bench_relay.py --help
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import add_output_options, write_json
from tqdm import tqdm

from gepo_sampler.relay import codec
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.puller import RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.store import RelayStore

GB = 1e9
#: parameters of the models whose transfer time is projected (bf16: 2 bytes each)
PROJECTED = {"Qwen3-1.7B": 1.72e9, "8B": 8.19e9}
LINKS_GBIT = {"1 Gbit/s": 1.0, "100 Mbit/s": 0.1}


def llama(hidden: int, layers: int, vocab: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def bf16_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}


def training_versions(model: torch.nn.Module, lr: float, steps: int, vocab: int, label: str, seed: int = 0):
    """Yield the bf16 weights after each of ``steps`` AdamW steps of the policy-gradient loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    yield bf16_weights(model)
    for _ in tqdm(range(steps), desc=f"{label} lr={lr:g}", leave=False):
        tokens = torch.randint(0, vocab, (4, 64), generator=generator)
        advantages = torch.randint(0, 2, (4,), generator=generator).float() * 2 - 1
        logits = model(tokens[:, :-1]).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(advantages * logp.sum(-1)).mean() / 64
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield bf16_weights(model)


def disk_write_gbps(data: np.ndarray, directory: Path) -> float:
    """One write of ``data`` to a fresh file with fsync, in GB/s (the file is deleted)."""
    path = directory / "disk-probe.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data.data)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return data.nbytes / seconds / GB


def machine_bandwidth(nbytes: int, directory: Path) -> dict[str, float]:
    """This machine's memory-copy and disk-write (with fsync) bandwidth in GB/s, best of three."""
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    copies, writes = [], []
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        copies.append(nbytes / (time.perf_counter() - started) / GB)
        writes.append(disk_write_gbps(source, directory))
    return {"memcpy_gbps": max(copies), "disk_write_gbps": max(writes)}


def measure(label: str, model: torch.nn.Module, lr: float, steps: int, vocab: int, workdir: Path) -> dict:
    """Publish every version to a directory store; a sampler pulls each; time every stage."""
    store_dir = workdir / f"{label}-{lr:g}"
    versions = list(training_versions(model, lr, steps, vocab, label))
    publisher = RelayPublisher(RelayStore(str(store_dir)), "bench", RelayConfig(keyframe_every=1000))
    publisher.hold(0)
    puller = RelayPuller(RelayStore(str(store_dir)), "bench")
    held = None
    rows = []
    previous = None
    encoder = codec.DeltaEncoder()
    probe = None  # the paired disk write's data
    for version, weights in enumerate(versions, start=1):
        bits = codec.WeightBits.from_tensors(weights)
        size = bits.nbytes
        row: dict = {"version": version, "weights_bytes": size}
        if previous is not None:
            names = list(bits.specs)
            started = time.perf_counter()
            raw, changed = encoder.encode(previous, bits, names)
            row["delta_encode_gbps"] = size / (time.perf_counter() - started) / GB
            compressed = codec.compress(raw, RelayConfig().delta_zstd_level)
            row["delta_bytes"] = len(compressed)
            row["changed_share"] = changed / bits.elements
            started = time.perf_counter()
            bits.digests()
            row["digest_gbps"] = size / (time.perf_counter() - started) / GB
            started = time.perf_counter()
            target = previous.copy()  # what a pull pays to stage the tensors it changes (fresh memory)
            row["staging_copy_gbps"] = size / (time.perf_counter() - started) / GB
            decompressed = codec.decompress(compressed, True)
            started = time.perf_counter()  # as encode excludes zstd, apply excludes it (pull+apply has both)
            codec.apply_delta(target, decompressed)
            row["delta_apply_gbps"] = size / (time.perf_counter() - started) / GB
            assert target.equal(bits), "delta chain is not exact"
        started = time.perf_counter()
        publisher.publish(version, weights)
        publisher.wait()
        seconds = time.perf_counter() - started
        manifest = publisher.published[version]
        row["full_bytes"] = manifest.nbytes("full") if manifest.full is not None else size
        row["publish_gbps"] = size / seconds / GB
        row["publish_kind"] = "keyframe" if manifest.full is not None else "delta"
        # every version also published alone (a fresh store, so a keyframe and nothing else): the keyframe figure
        # is a median over the steps, not one cold write
        # ... paired with a disk write of the same size just before it, in the same state of the page cache
        if probe is None or probe.nbytes != size:
            probe = np.random.default_rng(version).integers(0, 255, size, dtype=np.uint8)
        row["disk_write_gbps"] = disk_write_gbps(probe, workdir)
        keyframe_dir = Path(f"{store_dir}-keyframe-{version}")
        keyframes = RelayPublisher(RelayStore(str(keyframe_dir)), "bench", RelayConfig())
        started = time.perf_counter()
        keyframes.publish(version, weights)
        keyframes.wait()
        row["keyframe_publish_gbps"] = size / (time.perf_counter() - started) / GB
        keyframes.close()
        shutil.rmtree(keyframe_dir)
        started = time.perf_counter()
        result = puller.pull(held)
        row["pull_apply_gbps"] = size / (time.perf_counter() - started) / GB
        held = result.held
        assert held.weights.equal(bits), "the sampler's weights differ from the learner's"
        rows.append(row)
        previous = bits
    publisher.close()
    deltas = [r for r in rows if "delta_bytes" in r]
    summary = {
        "model": label,
        "parameters": sum(p.numel() for p in model.parameters()),
        "lr": lr,
        "steps": steps,
        "full_bytes": rows[0]["full_bytes"],
        "delta_bytes_median": statistics.median(r["delta_bytes"] for r in deltas),
        "changed_share_median": statistics.median(r["changed_share"] for r in deltas),
        "delta_encode_gbps": statistics.median(r["delta_encode_gbps"] for r in deltas),
        "delta_apply_gbps": statistics.median(r["delta_apply_gbps"] for r in deltas),
        "digest_gbps": statistics.median(r["digest_gbps"] for r in deltas),
        "staging_copy_gbps": statistics.median(r["staging_copy_gbps"] for r in deltas),
        "keyframe_publish_gbps": statistics.median(r["keyframe_publish_gbps"] for r in rows),
        "keyframe_over_paired_disk": statistics.median(r["keyframe_publish_gbps"] / r["disk_write_gbps"] for r in rows),
        "delta_publish_gbps": statistics.median(r["publish_gbps"] for r in rows[1:]),
        "delta_pull_apply_gbps": statistics.median(r["pull_apply_gbps"] for r in rows[1:]),
        "keyframe_pull_gbps": rows[0]["pull_apply_gbps"],
    }
    summary["delta_over_full"] = summary["delta_bytes_median"] / summary["full_bytes"]
    return summary


def learner_stall(model: torch.nn.Module, workdir: Path, versions: int = 8) -> dict:
    """Publish ``versions`` versions back to back (faster than the store takes them): the learner's time per publish
    (its host copy) against the background upload, and the peak host memory the publisher added, in model sizes."""
    import threading

    import psutil

    process = psutil.Process()
    weights = bf16_weights(model)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    publisher = RelayPublisher(RelayStore(str(workdir / "stall")), "bench", RelayConfig())
    publisher.hold(0)
    baseline = process.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stalls = []
    started = time.perf_counter()
    for version in range(1, versions + 1):
        weights = {k: (v.float() * (1 + 1e-3)).to(torch.bfloat16) for k, v in weights.items()}
        stalls.append(publisher.publish(version, weights))
    publisher.wait()
    total = time.perf_counter() - started
    stop.set()
    watcher.join()
    counters = publisher.counters
    publisher.close()
    return {
        "model_bytes": size,
        "stall_s_median": statistics.median(stalls),
        "publish_s_total": total,
        "published": counters.get("versions_published"),
        "coalesced": counters.get("versions_coalesced"),
        "peak_extra_model_sizes": (peak[0] - baseline) / size,
    }


def projection(summaries: list[dict]) -> list[dict]:
    """Seconds per version over each link for the projected models: full, and delta at each measured ratio."""
    out = []
    large = [s for s in summaries if s["model"] != "tiny"] or summaries
    for name, params in PROJECTED.items():
        full = params * 2
        for link, gbit in LINKS_GBIT.items():
            row = {"model": name, "link": link, "full_s": full * 8 / (gbit * GB)}
            for s in large:
                row[f"delta_s_lr{s['lr']:g}"] = full * s["delta_over_full"] * 8 / (gbit * GB)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Bytes per version (full vs exact delta) and relay throughput over real AdamW steps, with the "
        "machine's memcpy and disk bandwidth measured in the same run, and projected transfer times."
    )
    parser.add_argument("--steps", type=int, default=6, help="training steps per learning rate (default 6)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5], help="AdamW learning rates")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size of the large model (default 768)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the large model (default 8: ~110M)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of the large model (default 32000)")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model (seconds)")
    add_output_options(parser, "every figure")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        workdir = Path(tmp)
        models = [("tiny", lambda: llama(64, 2, 64, seed=0), 64)]
        if not args.skip_large:
            models.append(("llama-110M", lambda: llama(args.hidden, args.layers, args.vocab, seed=0), args.vocab))
        # first, while the process holds no freed memory that the publisher's host copies could reuse unseen
        stall = learner_stall(models[-1][1](), workdir)
        for label, build, vocab in models:
            for lr in args.lrs:
                summaries.append(measure(label, build(), lr, args.steps, vocab, workdir))
        largest = max(s["full_bytes"] for s in summaries)
        machine = machine_bandwidth(max(largest, 64 << 20), workdir)
    print(
        f"machine: memcpy {machine['memcpy_gbps']:.2f} GB/s, disk write (fsync) {machine['disk_write_gbps']:.2f} GB/s"
    )
    print(
        "\n| model | params | lr | full MB | delta MB | delta/full | changed bf16 | encode GB/s | apply GB/s | "
        "digest GB/s | staging copy GB/s | keyframe publish GB/s (x paired disk write) | pull+apply delta GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(
            f"| {s['model']} | {s['parameters'] / 1e6:.1f}M | {s['lr']:g} | {s['full_bytes'] / 1e6:.2f} | "
            f"{s['delta_bytes_median'] / 1e6:.3f} | {s['delta_over_full']:.3f} | {s['changed_share_median']:.2%} | "
            f"{s['delta_encode_gbps']:.2f} | {s['delta_apply_gbps']:.2f} | {s['digest_gbps']:.2f} | "
            f"{s['staging_copy_gbps']:.2f} | {s['keyframe_publish_gbps']:.2f} "
            f"({s['keyframe_over_paired_disk']:.2f}x) | {s['delta_pull_apply_gbps']:.2f} |"
        )
    print(
        f"\nlearner stall ({stall['model_bytes'] / 1e6:.0f} MB model, 8 versions back to back): "
        f"{stall['stall_s_median'] * 1e3:.0f} ms per publish (the host copy) against {stall['publish_s_total']:.1f} s "
        f"of background publishing; {stall['published']:.0f} published, {stall['coalesced']:.0f} coalesced; "
        f"peak extra host memory {stall['peak_extra_model_sizes']:.2f} model sizes (bound: 3 copies + the encoder)"
    )
    rows = projection(summaries)
    keys = [k for k in rows[0] if k.startswith("delta_s")]
    print("\n| model (bf16) | link | full s | " + " | ".join(k.replace("delta_s_", "delta s, ") for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for row in rows:
        print(
            f"| {row['model']} | {row['link']} | {row['full_s']:.1f} | "
            + " | ".join(f"{row[k]:.2f}" for k in keys)
            + " |"
        )
    if args.json:
        record = {"machine": machine, "models": summaries, "stall": stall, "projection": rows}
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
