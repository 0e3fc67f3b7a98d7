"""What the bench scripts share (command line, JSON, plots, timing, verl CPU runs), written once so they agree."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# Only the standard library at module level: ``--help`` stays instant, and matplotlib (optional) and the plugin are
# imported by the functions that need them. ``gpu_check.py`` stands alone (it is run by path on a torch-only machine).


# --------------------------------------------------------------------------------------------- command line


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser whose ``--help`` is its module docstring, line breaks kept: the docstring already says what
    is measured and how to run it."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_options(parser: argparse.ArgumentParser, json_what: str, png_what: str | None = None) -> None:
    """``--json PATH`` ("also write ``json_what`` to this JSON file") and, with ``png_what``, ``--png PATH``: every
    script keeps its figures and draws its picture under the same option names, only on request."""
    parser.add_argument("--json", help=f"also write {json_what} to this JSON file")
    if png_what is not None:
        parser.add_argument("--png", help=f"also draw {png_what} to this PNG (needs matplotlib)")


# --------------------------------------------------------------------------------------------- files


def add_generation_options(parser: argparse.ArgumentParser, requests_what: str) -> None:
    """The load of a benchmark that sends a vLLM server batches of requests: response lengths, requests per
    measurement and how many at a time."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64], help="new tokens per request (16 64)")
    parser.add_argument("--requests", type=int, default=32, help=f"{requests_what} (32)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at a time (8)")


def write_json(path: str | Path, record: Any) -> None:
    """``record`` as indented JSON at ``path``: one format for every script's results, read back by
    ``bench_staleness_lab.py`` and kept under ``docs/bench``."""
    Path(path).write_text(json.dumps(record, indent=2))


def write_json_around(path: str | None, record: dict[str, Any], report: Callable[[], dict[str, Any]]) -> None:
    """Run ``report()`` (it prints and returns what it derived) and write ``record`` with that added to ``path``, when
    given; ``record`` is also written before the report, so that the numbers of a long run survive a reporting error.
    """
    if path:
        write_json(path, record)
    derived = report()
    if path:
        write_json(path, record | derived)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, imported only when a picture is asked for: matplotlib is
    optional, and no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out and write ``fig``: one layout and resolution for every picture under ``docs/bench``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def max_lag_axis(axis: Any, lags: Iterable[int], sync_linestyle: str) -> None:
    """The x axis of a throughput-against-staleness plot, and its sync line at 1: ``hetero.max_lag`` on a symlog
    scale (0 and the powers of two alike) with a tick at each lag measured, so the staleness plots read the same."""
    axis.axhline(1.0, color="gray", linestyle=sync_linestyle, label="sync")
    axis.set_xlabel("hetero.max_lag (weight versions)")
    axis.set_xscale("symlog", linthresh=1)
    ticks = sorted(set(lags))
    axis.set_xticks(ticks, [str(tick) for tick in ticks])


# --------------------------------------------------------------------------------------------- timing


def median_seconds(fn: Callable[[], object], repeats: int, calls: int = 1) -> float:
    """The median over ``repeats`` of the mean seconds per call of ``fn`` over ``calls`` calls, after one untimed
    call: the first call pays one-off costs (imports, caches, allocations) that are not ``fn``'s."""
    fn()
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        values.append((time.perf_counter() - start) / calls)
    return statistics.median(values)


def paired_median_ratio(tops: Iterable[float], bottoms: Iterable[float]) -> float:
    """The median of ``top / bottom`` over pairs measured side by side: each pair shares the machine's state at the
    time, so its ratio is free of drift that a ratio of two medians would keep."""
    return statistics.median(top / bottom for top, bottom in zip(tops, bottoms, strict=True))


# --------------------------------------------------------------------------------------------- verl CPU runs


def cpu_training_metrics(overrides: list[str], workdir: Path, what: str) -> dict[int, dict]:
    """The per-step metrics of one CPU training run of verl's trainer (``gepo_plugin.tiny.run_cpu_training``, 20
    minutes at most); a failed run raises with ``what`` and the end of its log, as a benchmark has nothing to report.
    """
    from gepo_plugin.tiny import run_cpu_training

    code, metrics, log = run_cpu_training(overrides, workdir, timeout_s=1200)
    if code != 0:
        raise RuntimeError(f"{what} failed (exit {code}):\n{log[-4000:]}")
    return metrics


def run_summary(metrics: dict[int, dict], skip: int) -> dict[str, Any]:
    """What a CPU training run of verl's trainer measured, from its tracker's metrics: one summary for every benchmark.

    Medians and totals over the steps after the first ``skip`` (they compile and warm up).
    ``step_s``: median ``timing_s/step``; ``idle_s``: median ``timing_s/gen`` (the learner waiting for finished
    rollouts); ``tokens_per_s``: trained tokens (verl's ``perf/total_num_tokens``: prompt and response) over the
    summed step time; ``lag_mean`` / ``lag_max``: HeteroRL's trained-group lag (0 without HeteroRL); ``dropped``:
    groups HeteroRL dropped by the last step;
    ``phase_s``: the median of every other ``timing_s/<phase>`` verl reports (where a step's time goes).
    """
    steps = [m for step, m in sorted(metrics.items()) if step > skip and "timing_s/step" in m]
    if not steps:
        raise RuntimeError(f"no step after the first {skip} reported timing_s/step: run more steps")
    seconds = sum(m["timing_s/step"] for m in steps)
    tokens = sum(m.get("perf/total_num_tokens", 0.0) for m in steps)  # verl's own count: prompt + response
    return {
        "steps": len(steps),
        "step_s": statistics.median(m["timing_s/step"] for m in steps),
        "idle_s": statistics.median(m.get("timing_s/gen", 0.0) for m in steps),
        "tokens_per_s": tokens / seconds,
        "lag_mean": statistics.mean(m.get("hetero/lag/mean", 0.0) for m in steps),
        "lag_max": max(m.get("hetero/lag/max", 0.0) for m in steps),
        "dropped": max(m.get("hetero/dropped", 0.0) for m in steps),
        "phase_s": {
            key.removeprefix("timing_s/"): statistics.median(m.get(key, 0.0) for m in steps)
            for key in sorted({key for m in steps for key in m if key.startswith("timing_s/")})
        },
    }
