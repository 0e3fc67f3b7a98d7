"""Check that every section of the old README has a home in the documentation site (a one-time check).

Until commit 85b5e3f the repository's README was the project's whole manual (1,459 lines). It became a short front
page, and its content moved into the pages under docs/. This script exists so that the move can be shown to have lost
nothing: it reads the old README from git (``git show 85b5e3f:README.md``), lists every heading, and checks for each
that the page the HOMES table assigns it to exists and contains a heading or phrase that carries the section. Parts of
a section that moved to another page than the rest are listed in ALSO_MOVED and checked the same way.

Exit status 0 when every heading has a home, 1 otherwise (each heading without one is listed). Run it from anywhere
in the repository: ``python scripts/readme_homes.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The last commit whose README was the whole manual.
OLD_README = "85b5e3f:README.md"

#: Old heading (its text, without the leading #s) -> (page, a heading or phrase that must appear in that page).
HOMES: dict[str, str | tuple[str, str]] = {
    "gepo-plugin": ("docs/index.md", "not the unrelated method of the same name"),
    "Use it in a verl setup": "docs/getting-started.md",
    "What is checked at start-up": "docs/getting-started.md",
    "Staying with `python -m verl.trainer.main_ppo`": "docs/getting-started.md",
    "verl's own trainer on a CPU (`trainer.device=cpu`)": ("docs/cpu.md", "## What `trainer.device=cpu` does"),
    "A modelled GPU sampler (`rollout.engine_kwargs.hf.latency`)": "docs/cpu.md",
    "verl's Megatron engine on a CPU (`model_engine=megatron`)": "docs/cpu.md",
    "verl with vLLM on a CPU (`rollout.name=vllm`, vLLM's CPU build)": "docs/cpu.md",
    "How it plugs into verl": "docs/development.md",
    "verl's internals behind one guarded seam": "docs/development.md",
    "Metrics (verl tracker: console, wandb, tensorboard)": "docs/getting-started.md",
    "HeteroRL: decoupled samplers, an exact staleness bound, simulated WAN delay": "docs/hetero.md",
    "The staleness guard and the cost of dropping": "docs/hetero.md",
    "When a sampler fails": "docs/hetero.md",
    "Samplers in another cluster: the weight relay (`hetero.transport=relay`)": "docs/relay.md",
    "The lab: the paper's stability claims on a CPU": "docs/results.md",
    "Measured: the `paper` preset": "docs/results.md",
    "20 paired seeds: 400 updates, lag 0 against lag 64 (on the shared core)": "docs/results.md",
    "The harsh setting: lr 3e-3, 200 updates, 10 paired seeds (on the shared core)": "docs/results.md",
    "GEPO+ and the staleness guard: 20 paired seeds (on the shared core)": "docs/results.md",
    "Sensitivity at max lag 64: learning rate, group size, clip, delays, length": "docs/results.md",
    "Benchmarks": "docs/results.md",
    "Start-up (`bench/bench_startup.py`)": "docs/results.md",
    "GEPO loss (`bench/bench_loss.py`)": "docs/results.md",
    "HeteroRL against verl's own `separate_async` (`bench/bench_hetero_overhead.py`)": "docs/results.md",
    (
        "Throughput against staleness (`bench/bench_staleness_throughput.py`, `bench/bench_staleness_lab.py`)"
    ): "docs/results.md",
    "The weight relay (`bench/bench_relay.py`)": "docs/results.md",
    "Rollout engines (`bench/bench_rollout_engines.py`) and a GPU check (`bench/gpu_check.py`)": "docs/results.md",
    "HeteroRL sampler and delay models (`bench/bench_sampler.py`)": "docs/results.md",
    "Tests": "docs/development.md",
    "Layout": "docs/development.md",
}

#: Old heading -> further (page, phrase) homes of the parts of that section that moved elsewhere than HOMES says.
ALSO_MOVED: dict[str, list[tuple[str, str]]] = {
    "gepo-plugin": [("README.md", "bash run.sh     # main job")],
    "Use it in a verl setup": [
        ("docs/getting-started.md", "## Install into an existing verl"),
        ("docs/losses.md", "## The family"),  # the presets table (its verl settings: docs/reference/config.md)
        ("docs/losses.md", "## Clip range"),
        ("docs/losses.md", "## BNPO's options"),
        ("docs/losses.md", "## ΔL's options"),
        ("docs/gepo.md", "## GEPO's options"),  # the option table (generated: docs/reference/config.md)
        ("docs/gepo.md", "## GEPO+: the authors' adaptive denominator"),
        ("docs/gepo.md", 'Is GEPO+ "never worse than the better of the two"?'),
    ],
    "verl's own trainer on a CPU (`trainer.device=cpu`)": [
        ("docs/getting-started.md", "## A first run on a CPU"),
        ("docs/cpu.md", "## A tiny model, and the command that trains it"),
    ],
    "verl with vLLM on a CPU (`rollout.name=vllm`, vLLM's CPU build)": [
        ("docs/cpu.md", "### Measured: the transformers server against vLLM-CPU"),
    ],
    "verl's internals behind one guarded seam": [("docs/gepo.md", "How the plugin computes it")],
    "Metrics (verl tracker: console, wandb, tensorboard)": [("docs/reference/metrics.md", "# Metrics")],
    "HeteroRL: decoupled samplers, an exact staleness bound, simulated WAN delay": [
        ("README.md", "## HeteroRL: samplers apart from the learner"),
    ],
    "Samplers in another cluster: the weight relay (`hetero.transport=relay`)": [
        ("README.md", "## The weight relay: samplers in another cluster"),
    ],
    "Tests": [("README.md", 'bash test.sh -n 2 -m "not ray and not e2e and not slow"')],
}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def old_headings(revision: str) -> list[tuple[int, str]]:
    """(level, text) of every heading of the old README, in order (lines inside fenced code are not headings)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", revision], capture_output=True, text=True, check=True).stdout
    headings = []
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            headings.append((len(match[1]), match[2]))
    return headings


def problem(page: str, phrase: str) -> str | None:
    """Why ``phrase`` is not found in ``page`` (None when it is)."""
    path = ROOT / page
    if not path.is_file():
        return f"{page} does not exist"
    if phrase not in path.read_text():
        return f"{page} lacks {phrase!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/readme_homes.py",
        description="List every heading of the old README (read from git) and check that each has a home in the "
        "documentation site: its page exists and carries the heading or phrase the script's HOMES table names. "
        "Exit status 1 lists the headings without a home.",
    )
    parser.add_argument(
        "--revision",
        default=OLD_README,
        help=f"git object of the old README (default {OLD_README})",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the headings without a home")
    args = parser.parse_args(argv)

    headings = old_headings(args.revision)
    homeless: list[str] = []
    for level, heading in headings:
        if heading not in HOMES:
            homeless.append(f"{heading}: no home in HOMES")
            print(f"MISSING {'#' * level} {heading}: no home in HOMES")
            continue
        home = HOMES[heading]
        page, phrase = home if isinstance(home, tuple) else (home, heading)
        problems = [p for p in (problem(page, phrase), *(problem(*h) for h in ALSO_MOVED.get(heading, []))) if p]
        if problems:
            homeless.append(f"{heading}: {'; '.join(problems)}")
            print(f"MISSING {'#' * level} {heading}: {'; '.join(problems)}")
        elif not args.quiet:
            extra = "".join(f", {p}" for p in dict.fromkeys(p for p, _ in ALSO_MOVED.get(heading, [])) if p != page)
            print(f"ok      {'#' * level} {heading} -> {page}{extra}")
    stale = sorted(set(HOMES) - {heading for _, heading in headings})
    for heading in stale:
        print(f"note: HOMES names {heading!r}, which is no heading of the old README")
    if homeless:
        print(f"\n{len(homeless)} heading(s) of the old README without a home:", file=sys.stderr)
        for line in homeless:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("\nevery heading of the old README has a home")
    return 0


if __name__ == "__main__":
    sys.exit(main())
