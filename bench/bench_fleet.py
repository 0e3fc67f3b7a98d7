"""Benchmark: a fleet of --samplers synthetic remote samplers (16 64 256 1024) against verl's real trainer on this
machine: what the learner's node pays for each size, for this tree and, up to --before-max samplers, for --before
(the revision with a proxy process per sampler: at 64 its proxies alone would take ~20 GiB, more than this 24 GiB
VM holds beside the trainer), measured in one run.

Each size is one run of ``gepo_plugin.fleet_sim.run.run_fleet``: verl's separate_async trainer with HeteroRL over the
relay (a directory store), the tiny model on CPU, one in-cluster sampler group, and the remote samplers in --groups
groups, dialling the real gateway over HTTP from --fleet-processes processes (many samplers per asyncio loop), each
following the relay's manifests (fetching and checking every shard a host would, installing nothing) and answering
after a log-normal delay (stragglers and vanishing samplers as configured). Per size: the learner node's memory (the
proportional set size of the launcher and every process under it: Ray's and verl's, not the fleet's), the learner's
step time and the fleet's bookkeeping per step (``hetero/fleet_s``), the gateway's calls per second and the time a
status or results call takes (p50, p99), the store's reads and listings per published version per sampler, the time
from a version's publication until every live sampler has it, and the ledger (produced = trained + dropped +
queued). The first two steps (start-up, samplers joining) are left out of the step medians. With --audit, the samplers
sample their answers from the tiny model at the version they claim (batched per process) and --liars of them report
higher log-probs; the row then has the audits done, the auditor's seconds and who was quarantined.

    python bench/bench_fleet.py --json docs/bench/fleet.json --png docs/bench/fleet.png   # about 17 minutes
    python bench/bench_fleet.py --samplers 16 64 --before-max 0 --steps 8                   # a few minutes
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from common import add_output_options, pyplot, save_figure, script_parser, write_json_around
from tqdm import tqdm

from gepo_plugin.fleet_sim.profile import FleetProfile
from gepo_plugin.fleet_sim.run import FleetRun, run_fleet

ROOT = Path(__file__).resolve().parents[1]
#: the last revision with one proxy process per remote sampler
BEFORE_POOLS = "936cb95"


def measure(args, samplers: int, source: Path | None, workdir: Path) -> dict:
    profile = FleetProfile(**{name: getattr(args, name) for name in FleetProfile.model_fields})
    run = FleetRun(
        samplers=samplers,
        groups=args.groups,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        audit=args.audit,
        profile=profile,
    )
    label = "before" if source is not None else "after"
    with tqdm(total=args.steps, desc=f"{samplers} samplers ({label})", unit="step") as progress:
        out = run_fleet(run, workdir / f"{label}_{samplers}", progress=progress, source=source)
    if source is not None and any("hetero/fleet_s" in m for m in out["metrics"].values()):
        raise SystemExit("the --before run logged a metric only this tree has: the worktree was not imported first")
    return out["summary"]


def run(args) -> dict:
    record: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")}, "after": {}}
    record["before"] = {}
    with tempfile.TemporaryDirectory(prefix="bench_fleet_") as tmp:
        workdir = Path(tmp)
        before = [n for n in args.samplers if n <= args.before_max]
        worktree = workdir / "before_tree"
        if before:
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
        try:
            for samplers in args.samplers:
                if samplers in before:
                    record["before"][samplers] = measure(args, samplers, worktree, workdir)
                record["after"][samplers] = measure(args, samplers, None, workdir)
        finally:
            if before:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    return record


def report(record: dict, png: str | None) -> dict:
    header = (f"{'side':6} {'samplers':>8} {'memory GiB':>10} {'step s':>7} {'fleet s':>7} {'calls/s':>8} "
              f"{'status p50/p99 ms':>18} {'results p50/p99 ms':>19} {'reads/v/s':>9} {'lists/v/s':>9} "
              f"{'publish->all s':>14} {'ledger p=t+d+q':>16} {'lag':>4}")  # fmt: skip
    print("\n" + header)
    for side in ("before", "after"):
        for samplers, row in sorted(record[side].items(), key=lambda kv: int(kv[0])):
            gateway = row["gateway"]
            status, results = gateway.get("status", {}), gateway.get("results", {})
            spread = row["publish_to_all_s"] or {"median": float("nan")}
            ledger = row["ledger"]
            print(f"{side:6} {samplers:>8} {row['memory_gib']:10.2f} {row['step_s']:7.2f} {row['fleet_s']:7.3f} "
                  f"{row['gateway_calls_per_s']:8.1f} {status.get('p50_ms', 0):8.1f}/{status.get('p99_ms', 0):<9.1f} "
                  f"{results.get('p50_ms', 0):8.1f}/{results.get('p99_ms', 0):<10.1f} "
                  f"{row['store_reads_per_version_per_sampler']:9.2f} "
                  f"{row['store_lists_per_version_per_sampler']:9.2f} "
                  f"{spread['median']:14.2f} {ledger['produced']:5.0f}={ledger['trained']:.0f}+{ledger['dropped']:.0f}"
                  f"+{ledger['queued']:.0f} {row['lag_max']:4.0f}")  # fmt: skip
    print(f"\n{'side':6} {'samplers':>8} {'handler status/results p99 ms':>30} {'loop late p50/p99 ms':>21} "
          f"{'loop busy':>9} {'busy when late':>14} {'fleet cores':>11}")  # fmt: skip
    for side in ("before", "after"):
        for samplers, row in sorted(record[side].items(), key=lambda kv: int(kv[0])):
            handler, loop = row["gateway_side"], row["gateway_side"].get("loop", {})
            nan = float("nan")
            print(f"{side:6} {samplers:>8} {handler.get('status', {}).get('p99_ms', nan):14.1f}/"
                  f"{handler.get('results', {}).get('p99_ms', nan):<15.1f} {loop.get('late_p50_ms', nan):10.1f}/"
                  f"{loop.get('late_p99_ms', nan):<10.1f} {loop.get('busy', nan):9.2f} "
                  f"{loop.get('busy_when_late', nan):14.2f} {row.get('fleet_cores', nan):11.2f}")  # fmt: skip
    for samplers, row in record["after"].items():
        if row.get("audits"):
            print(f"{samplers} samplers: {row['audits']:.0f} audits, the auditor's {row['audit_seconds']:.1f} s, "
                  f"quarantined {row['quarantined']}")  # fmt: skip
    after = {int(k): v for k, v in record["after"].items()}
    derived: dict = {}
    if len(after) >= 2:
        small, large = min(after), max(after)
        derived["memory_gib_per_sampler"] = (after[large]["memory_gib"] - after[small]["memory_gib"]) / (large - small)
        derived["memory_gib_over_smallest"] = after[large]["memory_gib"] - after[small]["memory_gib"]
        derived["step_ratio_over_smallest"] = after[large]["step_s"] / after[small]["step_s"]
        print(f"\n{large} samplers against {small}: +{derived['memory_gib_over_smallest']:.2f} GiB "
              f"({derived['memory_gib_per_sampler'] * 1024:.1f} MiB per sampler), "
              f"step x{derived['step_ratio_over_smallest']:.2f}")  # fmt: skip
    if png:
        plt = pyplot()
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for side, style in (("before", "o--"), ("after", "o-")):
            rows = sorted((int(k), v) for k, v in record[side].items())
            if not rows:
                continue
            xs = [n for n, _ in rows]
            axes[0].plot(xs, [v["memory_gib"] for _, v in rows], style, label=side)
            axes[1].plot(xs, [v["step_s"] for _, v in rows], style, label=side)
            axes[2].plot(xs, [v["gateway"].get("results", {}).get("p99_ms", float("nan")) for _, v in rows], style,
                         label=f"{side}: a results call, at the sampler")  # fmt: skip
            if side == "after":
                axes[2].plot(xs, [v["gateway_side"].get("loop", {}).get("late_p99_ms", float("nan")) for _, v in rows],
                             "s:", label="the gateway's loop, late by")  # fmt: skip
        axes[2].axhline(50.0, color="grey", linewidth=0.8, label="target (50 ms)")
        for axis, title in zip(axes, ("learner node memory (GiB, PSS)", "learner step (s, median)",
                                      "waits, p99 (ms)"), strict=True):  # fmt: skip
            axis.set_xscale("log", base=2)
            axis.set_xlabel("remote samplers")
            axis.set_title(title)
            axis.legend()
        save_figure(fig, png)
    return derived


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--samplers", type=int, nargs="+", default=[16, 64, 256, 1024], help="sizes (16 64 256 1024)")
    parser.add_argument("--groups", type=int, default=4, help="sampler groups the remote samplers form (4)")
    parser.add_argument("--steps", type=int, default=16, help="training steps per run (16)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts a step, 4 answers each (8)")
    parser.add_argument(
        "--audit", type=float, default=0.0, help="hetero.audit.fraction; the samplers then sample from the model (0)"
    )
    parser.add_argument("--before", default=BEFORE_POOLS, help=f"the revision to compare with ({BEFORE_POOLS})")
    parser.add_argument(
        "--before-max", type=int, default=16, help="largest size run at --before (16: a process per sampler)"
    )
    for name, spec in FleetProfile.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(spec.default), default=spec.default,
                            help=f"{spec.description} ({spec.default})")  # fmt: skip
    add_output_options(parser, "every size's row and the derived costs", "memory, step time and p99 against size")
    args = parser.parse_args()
    record = run(args)
    write_json_around(args.json, record, lambda: report(record, args.png))


if __name__ == "__main__":
    main()
