"""Benchmark: verl's real vLLM rollout (vLLM's CPU build) against the plugin's transformers CPU server, same run.

Both runs are verl's sync GEPO trainer on the same tiny model (the ``--for-vllm`` shape: head size 32), data, seed
and settings; only ``actor_rollout_ref.rollout.name`` differs (``hf``: the plugin's server; ``vllm``: verl's
``vLLMHttpServer`` around vLLM's ``AsyncLLM``, with the CPU backend's vLLM settings). Per run, over the steps after
``--skip``: generated tokens per second of generation (verl's ``response_length/mean`` x responses over
``timing_s/gen``), the step time, the weight-sync time (``timing_s/update_weights``), the wall time (start-up
included) and the peak memory of the whole run (the PSS of the trainer's process tree: Ray, its workers, vLLM's
engine and worker processes, sampled every 0.5 s). Ratios are vllm / hf, measured in one invocation.

    python bench/bench_rollout_engines.py                       # 6 steps each, 64-token responses
    python bench/bench_rollout_engines.py --steps 4 --response-length 32 --json out.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_output_options, run_summary, script_parser, write_json
from tqdm import tqdm

from gepo_plugin.tiny import cpu_run_overrides, read_metrics, write_all

ENGINES = ("hf", "vllm")


def tree_pss_bytes(root: int) -> int:
    """Proportional set size of ``root`` and all its descendants (shared pages counted once overall)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def timed_run(overrides: list[str], workdir: Path, timeout_s: float) -> tuple[int, dict[int, dict], float, int]:
    """Run ``python -m gepo_plugin.main_ppo``; returns (exit code, metrics, wall seconds, peak PSS bytes)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = workdir / "metrics.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_file), "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    with (workdir / "run.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gepo_plugin.main_ppo", *overrides], cwd=workdir, env=env, stdout=log, stderr=log
        )
        peak = [0]

        def sample() -> None:
            while process.poll() is None:
                peak[0] = max(peak[0], tree_pss_bytes(process.pid))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait(timeout=timeout_s)
        sampler.join()
    return code, read_metrics(metrics_file), time.perf_counter() - started, peak[0]


def engine_row(engine: str, metrics: dict[int, dict], wall_s: float, peak: int, skip: int, responses: int) -> dict:
    summary = run_summary(metrics, skip)
    steps = [m for step, m in sorted(metrics.items()) if step > skip]
    tokens = sum(m["response_length/mean"] * responses for m in steps)
    gen_s = sum(m["timing_s/gen"] for m in steps)
    return {
        "engine": engine,
        "gen_tokens_per_s": tokens / gen_s,
        "step_s": summary["step_s"],
        "gen_s": summary["phase_s"].get("gen", 0.0),
        "update_weights_s": summary["phase_s"].get("update_weights", 0.0),
        "wall_s": wall_s,
        "peak_pss_gib": peak / 2**30,
    }


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--response-length", type=int, default=64, help="data.max_response_length (default 64)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run (default 1200)")
    add_output_options(parser, "the rows")
    args = parser.parse_args(argv)
    prompts, responses = 4, 4
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
        tiny = write_all(Path(tmp) / "tiny", for_vllm=True)
        for engine in tqdm(ENGINES, desc="runs", unit="run"):
            overrides = [
                *cpu_run_overrides(tiny, loss="gepo", mode="sync", steps=args.steps, learners=1),
                f"actor_rollout_ref.rollout.name={engine}",
                f"data.max_response_length={args.response_length}",
                f"trainer.experiment_name=engines_{engine}",
            ]
            code, metrics, wall_s, peak = timed_run(overrides, Path(tmp) / engine, args.timeout)
            if code != 0:
                print((Path(tmp) / engine / "run.log").read_text()[-4000:], file=sys.stderr)
                raise SystemExit(f"the {engine} run failed (exit {code})")
            rows.append(engine_row(engine, metrics, wall_s, peak, args.skip, prompts * responses))
    hf, vllm = rows
    print(
        f"\nsync GEPO, {args.steps} steps ({args.skip} skipped), {prompts * responses} responses of <= "
        f"{args.response_length} tokens per step, one learner, one rollout replica"
    )
    print(f"{'':>22} {'hf':>10} {'vllm':>10} {'vllm/hf':>9}")
    labels = {
        "gen_tokens_per_s": "generated tokens/s",
        "step_s": "step (s, median)",
        "gen_s": "generation (s)",
        "update_weights_s": "weight sync (s)",
        "wall_s": "wall, start-up incl. (s)",
        "peak_pss_gib": "peak memory (GiB PSS)",
    }
    for key, label in labels.items():
        ratio = vllm[key] / hf[key] if hf[key] else float("nan")
        print(f"{label:>22} {hf[key]:>10.3f} {vllm[key]:>10.3f} {ratio:>9.2f}")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
