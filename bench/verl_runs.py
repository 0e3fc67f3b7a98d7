"""What a CPU training run of verl's trainer measured, from its tracker's metrics: one summary for every benchmark."""

from __future__ import annotations

import statistics


def run_summary(metrics: dict[int, dict], skip: int) -> dict[str, float]:
    """Medians and totals over the steps after the first ``skip`` (they compile and warm up).

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
