"""Benchmark: what the plugin costs at start-up, measured against verl without it, in one run.

1. ``python -c "import verl"`` with the plugin installed against ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl skips
   every plugin): wall time and the lines printed. Every Ray process of a verl run pays this once.
2. Time to the first configuration error of ``python -m gepo_plugin.main_ppo`` (the launcher stops before Ray).
3. ``python -m gepo_plugin doctor --fast``.

Each command runs in a fresh interpreter; the variants are interleaved over repetitions, so machine drift hits
all alike, and medians are reported. Run it on an idle machine: on a loaded one every number grows.

    python bench/bench_startup.py            # 7 repetitions
    python bench/bench_startup.py --help
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

IMPORT = ("import verl", [sys.executable, "-c", "import verl"])
MISTAKES = {
    "hetero.enable=no": ["hetero.enable=no"],
    "algorithm.loss=nope": ["algorithm.loss=nope"],
    "clip_ratio_high=nan": ["algorithm.loss=gepo", "actor_rollout_ref.actor.clip_ratio_high=nan"],
}


def run(command: list[str], env_extra: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds, exit status and combined output of one fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "PYTHONWARNINGS")}
    env.update(env_extra or {})
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, result.returncode, result.stdout + result.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/bench_startup.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1]
    )
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of every command (default 7)")
    parser.add_argument("--no-doctor", action="store_true", help="skip the doctor --fast timing")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from tqdm.auto import tqdm

    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        "import verl (plugin installed)": (IMPORT[1], {}),
        "import verl (VERL_USE_EXTERNAL_PLUGINS=none)": (IMPORT[1], {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
    }
    for name, overrides in MISTAKES.items():
        variants[f"first config error: {name}"] = ([sys.executable, "-m", "gepo_plugin.main_ppo", *overrides], {})
    if not args.no_doctor:
        doctor = [sys.executable, "-m", "gepo_plugin", "doctor", "--fast"]
        variants["python -m gepo_plugin doctor --fast"] = (doctor, {})
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, tuple[int, str]] = {}
    with tqdm(total=args.repeats * len(variants), desc="start-up", unit="run") as bar:
        for _ in range(args.repeats):
            for name, (command, env) in variants.items():
                seconds, code, text = run(command, env)
                times[name].append(seconds)
                outputs[name] = (code, text)
                bar.update(1)
    with_plugin = statistics.median(times["import verl (plugin installed)"])
    baseline = statistics.median(times["import verl (VERL_USE_EXTERNAL_PLUGINS=none)"])
    print(f"\n{'command':<48} {'median s':>9} {'min s':>7} {'exit':>5} {'output lines':>13}")
    for name, values in times.items():
        code, text = outputs[name]
        lines = len([line for line in text.splitlines() if line.strip()])
        print(f"{name:<48} {statistics.median(values):>9.2f} {min(values):>7.2f} {code:>5} {lines:>13}")
    print(f"\nimport verl: plugin adds {with_plugin - baseline:+.2f} s (ratio {with_plugin / baseline:.2f}x)")
    same = outputs["import verl (plugin installed)"][1] == outputs["import verl (VERL_USE_EXTERNAL_PLUGINS=none)"][1]
    print(f"import verl: output identical with and without the plugin: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
