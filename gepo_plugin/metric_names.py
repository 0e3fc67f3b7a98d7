"""Every metric the plugin logs through verl's tracker, named in one place: its key, its prefix and what it means.

Components return unprefixed names (the framework-free ``hetero`` and ``maths`` packages do not choose verl's
namespaces); the verl glue names them here when it hands them to verl's tracker. :data:`METRICS` is the table of
every key a run can log under the plugin's namespaces (:data:`NAMESPACES`), with a one-line meaning each: the docs'
metrics reference is generated from it, and the end-to-end tests check that every metric a real run logs under those
namespaces is declared here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: verl tracker namespaces of the plugin.
GEPO_LOSS = "actor/gepo/"
M2PO_LOSS = "actor/m2po/"
GEPO_GROUPS = "gepo/"
HETERO = "hetero/"
LAG = HETERO + "lag/"
RELAY = HETERO + "relay/"
RELAY_SAMPLERS = RELAY + "samplers/"
REMOTE = HETERO + "remote/"
FRESH_GAP = "rollout/fresh_logprob_gap/"
#: Every key under these is the plugin's, and must be in :data:`METRICS`.
NAMESPACES: tuple[str, ...] = (GEPO_LOSS, M2PO_LOSS, GEPO_GROUPS, HETERO, FRESH_GAP)


def sampler_group(group: int | str, name: str) -> str:
    """The key of one sampler group's metric ``name``."""
    return f"{HETERO}sampler_group_{group}/{name}"


def by_group(metrics: Mapping[tuple[int, str], float]) -> dict[str, float]:
    """``(group, name) -> value`` (a :class:`~gepo_plugin.hetero.sampler_versions.SamplerVersions`' metrics) as keys."""
    return {sampler_group(group, name): value for (group, name), value in metrics.items()}


def under(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` with their (unprefixed) names put under ``prefix``."""
    return {prefix + name: value for name, value in metrics.items()}


@dataclass(frozen=True)
class Metric:
    """One key (``{group}``, ``{bucket}``, ``{reason}``, ``{kind}``: one path segment each) and what it means."""

    key: str
    meaning: str


#: The relay's counters (``hetero/relay/store.py`` ``RelayCounters``: the learner's publisher and every sampler's
#: puller count with the same names).
RELAY_COUNTERS: dict[str, str] = {
    "versions_published": "versions published to the store",
    "versions_coalesced": "versions skipped while an upload ran (the next one carries them)",
    "versions_discarded": "versions discarded at a resume (newer than the checkpoint)",
    "versions_deleted": "old versions deleted from the store",
    "versions_pulled": "versions pulled from the store",
    "published_bytes": "bytes published",
    "publish_s": "seconds publishing took, in total",
    "publish_host_copy_s": "seconds spent copying weights to host memory",
    "publish_failures": "publications that failed and were retried",
    "outage_s": "seconds the store could not be written",
    "keyframes": "full versions published",
    "keyframes_on_request": "full versions published because a sampler asked",
    "objects_deleted": "store objects deleted",
    "bytes_written": "bytes written to the store",
    "bytes_read": "bytes read from the store",
    "reads": "objects read from the store (manifests and shards)",
    "lists": "listings of the store's manifests",
    "bytes_pulled": "bytes of versions pulled",
    "pull_failures": "pulls that failed and were retried",
    "retries": "store operations retried",
    "store_errors": "store operations that failed",
    "manifests_refused": "manifests refused (malformed or from another run)",
    "shards_corrupt": "shards that failed their digest",
    "shards_missing": "shards missing from the store",
    "shards_rewritten": "shards rewritten after corruption",
    "digest_mismatches": "assembled versions whose digest did not match (never installed)",
}

_G = HETERO + "sampler_group_{group}/"
_IW = GEPO_LOSS + "iw_by_lag/{bucket}/"
_IS = GEPO_LOSS + "seq_is_by_lag/{bucket}/"

METRICS: tuple[Metric, ...] = (
    # GEPO's loss (every loss of the family logs verl's own actor/pg_* metrics; these are GEPO's)
    Metric(GEPO_LOSS + "iw_mean", "mean of the group-expectation importance weight over the step's sequences"),
    Metric(GEPO_LOSS + "iw_std", "standard deviation of that weight"),
    Metric(GEPO_LOSS + "iw_max", "largest weight of the step (after the log-ratio cap)"),
    Metric(GEPO_LOSS + "iw_min", "smallest weight of the step"),
    Metric(GEPO_LOSS + "log_iw_max", "largest raw log-weight, before the cap (a binding cap shows here)"),
    Metric(
        GEPO_LOSS + "ess",
        "effective sample size fraction of the weights, ESS/N = (sum w)^2 / (n sum w^2) over the step's sequences "
        "(1 = uniform)",
    ),
    Metric(GEPO_LOSS + "clipfrac", "share of sequences with a clipped token"),
    Metric(GEPO_LOSS + "log_ratio_cap_frac", "share of sequences whose weight the log-ratio cap replaced"),
    Metric(GEPO_LOSS + "sampler_kl", "mean per-token KL between the sampler's and the learner's policy"),
    Metric(GEPO_LOSS + "own_denominator_frac", "GEPO+: share of sequences whose own probability is the denominator"),
    Metric(GEPO_LOSS + "group_term_present", "1 when the batch carried the per-prompt group term (group-correct)"),
    Metric(GEPO_LOSS + "ess_step", "ESS/N of the sequence ratios p/q over the step (the staleness guard reads it)"),
    # M2PO's loss (its scope's values: the mini-batch's, or each micro-batch's with m2_scope=micro_batch)
    Metric(M2PO_LOSS + "m2", "M2PO: mean squared log-ratio of the harmful tokens, before the cap"),
    Metric(
        M2PO_LOSS + "m2_after",
        "M2PO: the same once capped at tau, as the authors' solver reports it: within policy_loss.m2_budget when "
        "tau > 0; when tau = 0 (every harmful token clipped) the uncapped M2",
    ),
    Metric(M2PO_LOSS + "cap_binds", "M2PO: 1 where the budget was exceeded and the bounds exp(+-tau) clipped"),
    Metric(M2PO_LOSS + "harmful_tokens", "M2PO: harmful tokens (advantage and ratio on the same side of 0 and 1)"),
    Metric(M2PO_LOSS + "masked_frac", "GEPO with policy_loss.m2_mask: share of response tokens M2PO's mask zeroed"),
    Metric(_IW + "mean", "HeteroRL: mean GEPO weight of the sequences in this lag bucket"),
    Metric(_IW + "var", "variance of that weight in the bucket"),
    Metric(_IW + "ess", "ESS/N of that weight in the bucket"),
    Metric(_IW + "fraction", "share of the step's sequences in the bucket"),
    Metric(_IS + "mean", "HeteroRL: mean sequence ratio p/q in this lag bucket"),
    Metric(_IS + "var", "variance of p/q in the bucket"),
    Metric(_IS + "ess", "ESS/N of p/q in the bucket"),
    Metric(_IS + "fraction", "share of the step's sequences in the bucket"),
    # GEPO's groups (the advantage step)
    Metric(GEPO_GROUPS + "num_groups", "prompt groups in the step's batch"),
    Metric(GEPO_GROUPS + "group_size_mean", "mean responses per prompt group"),
    Metric(GEPO_GROUPS + "log_group_expectation_mean", "mean log of the group's expected sampler probability"),
    # verl's rollout against the learner
    Metric(FRESH_GAP + "max", "largest |rollout - learner| log-prob over tokens of the learner's own version"),
    Metric(FRESH_GAP + "mean", "mean of that gap"),
    Metric(FRESH_GAP + "tokens", "tokens compared (0: no response of the learner's own version this step)"),
    # HeteroRL: the books (nothing lost silently)
    Metric(HETERO + "produced", "rollout groups produced so far (= trained + dropped + queued)"),
    Metric(HETERO + "trained", "rollout groups trained so far"),
    Metric(HETERO + "queued", "groups finished and not yet trained"),
    Metric(HETERO + "dropped", "groups dropped so far, every reason"),
    Metric(HETERO + "dropped/{reason}", "groups dropped for one reason (stale, stale_overflow, mixed_versions, ...)"),
    Metric(HETERO + "mixed_version_groups", "trained groups of this step whose tokens span several versions"),
    Metric(HETERO + "mixed_version_groups_total", "the same, summed over the run"),
    Metric(HETERO + "learner_version", "the weight version the learner trained from this step"),
    Metric(HETERO + "queue/finished_untrained", "groups waiting in the queue at the step"),
    Metric(HETERO + "queue/in_flight", "groups being generated at the step"),
    Metric(HETERO + "learner_wait_s", "seconds the learner waited for this step's batch"),
    Metric(HETERO + "learner_idle_fraction", "share of the step cycle the learner waited"),
    Metric(HETERO + "oldest_sampler_version", "the oldest weight version any live sampler group holds"),
    Metric(
        HETERO + "fleet_s",
        "seconds the sampler fleet's work took on the learner's thread since the last step (publishing, installs, "
        "joins, reports, metrics)",
    ),
    Metric(HETERO + "weight_snapshots", "simulated transport: host snapshots of versions still travelling"),
    # lags of the trained groups
    Metric(LAG + "min", "smallest lag (learner version - oldest token version) of the trained groups"),
    Metric(LAG + "p50", "median lag"),
    Metric(LAG + "p95", "95th-percentile lag"),
    Metric(LAG + "max", "largest lag (never above hetero.max_lag)"),
    Metric(LAG + "mean", "mean lag"),
    # what dropping costs
    Metric(HETERO + "dropped/length_mean", "mean response length of this step's dropped trajectories"),
    Metric(HETERO + "dropped/reward_mean", "mean reward of this step's dropped trajectories"),
    Metric(HETERO + "trained/length_mean", "mean response length of this step's trained trajectories"),
    Metric(HETERO + "trained/reward_mean", "mean reward of this step's trained trajectories"),
    Metric(HETERO + "drop_bias/length", "dropped minus trained mean length (dropping favours short answers if > 0)"),
    # the staleness guard
    Metric(HETERO + "guard/max_lag", "the guard's effective bound"),
    Metric(HETERO + "guard/tightened", "times the guard tightened the bound"),
    Metric(HETERO + "guard/relaxed", "times the guard relaxed it"),
    # the samplers: membership, failures, replacements
    Metric(HETERO + "sampler_failures", "sampler replicas retired so far"),
    Metric(HETERO + "sampler_failures/{kind}", "retired because they died, hung or were quarantined by the audit"),
    Metric(HETERO + "sampler_replacements", "replacements that joined"),
    Metric(HETERO + "sampler_replacements/starting", "replacements still starting"),
    Metric(HETERO + "sampler_replicas_alive", "sampler replicas serving"),
    Metric(HETERO + "sampler_detect_s/last", "seconds the last failure took to detect"),
    Metric(_G + "alive", "1 while the group has a replica"),
    Metric(_G + "weight_version", "the version the group samples with"),
    Metric(_G + "weight_age", "learner version - the group's version"),
    Metric(_G + "paused", "1 while admission control holds the group (its weights are too old)"),
    Metric(_G + "installs", "versions installed on the group so far"),
    Metric(_G + "delay_mean_s", "simulated transport: mean drawn weight delay"),
    Metric(_G + "relay_bytes", "relay: bytes the group pulled"),
    Metric(_G + "arrival_lag_mean_s", "relay: mean seconds from publication to arrival"),
    Metric(_G + "pull_s_mean", "relay: mean seconds a pull took"),
    Metric(_G + "trained_trajectories", "trajectories of the group trained this step"),
    Metric(_G + "reward_mean", "mean reward of the group's trajectories trained this step (absent when none)"),
    Metric(_G + "trained_tokens_per_s", "response tokens of the group trained per second"),
    # the relay: the learner's counters, and the samplers' summed over replicas
    *(Metric(RELAY + name, f"learner: {meaning}") for name, meaning in RELAY_COUNTERS.items()),
    *(Metric(RELAY_SAMPLERS + name, f"samplers, summed: {meaning}") for name, meaning in RELAY_COUNTERS.items()),
    # samplers outside the cluster (hetero.remote_samplers), per sampler name
    Metric(REMOTE + "{sampler}/requests", "generation requests the learner gave the sampler so far"),
    Metric(REMOTE + "{sampler}/results", "results it answered that were accepted"),
    Metric(REMOTE + "{sampler}/tokens", "tokens of those results"),
    Metric(REMOTE + "{sampler}/timed_out", "requests it did not answer within hetero.gateway.request_timeout_s"),
    Metric(REMOTE + "{sampler}/failed", "requests its engine could not generate (each fails its group)"),
    Metric(
        REMOTE + "{sampler}/refused/{reason}",
        "results and statuses refused, by reason (nothing of them is trained or stored)",
    ),
    Metric(REMOTE + "{sampler}/version", "the weight version it reports holding"),
    Metric(REMOTE + "{sampler}/silent_s", "seconds since it was last heard from"),
    Metric(REMOTE + "{sampler}/unauthorised", "calls in its name with a wrong or missing token (refused)"),
    Metric(REMOTE + "{sampler}/malformed", "calls in its name whose body was not a valid message (refused)"),
    Metric(REMOTE + "{sampler}/protocol", "hellos in its name from a host of another protocol version (refused)"),
    Metric(
        REMOTE + "{sampler}/idle", "calls in its name whose body stopped arriving for hetero.gateway.idle_timeout_s"
    ),
    Metric(REMOTE + "gateway/{route}/calls", "calls of a route (hello, status, results) the gateway handled this step"),
    Metric(
        REMOTE + "gateway/{route}/p50_ms",
        "median time the gateway's handler took over such a call this step (its body read and its proxy's work)",
    ),
    Metric(REMOTE + "gateway/{route}/p99_ms", "99th percentile of that time"),
    Metric(
        REMOTE + "gateway/loop_late_p50_ms",
        "median lateness of the gateway's event loop this step (the wait a call had before its handler started)",
    ),
    Metric(REMOTE + "gateway/loop_late_p99_ms", "99th percentile of that lateness"),
    Metric(REMOTE + "gateway/loop_busy", "the gateway loop thread's CPU time over the step's wall time"),
    Metric(
        REMOTE + "gateway/loop_busy_when_late",
        "that share over the intervals the loop ran over 10 ms late: near 1 it was saturated with its own work, "
        "near 0 it waited for a core other processes held",
    ),
    Metric(REMOTE + "unknown_sampler", "calls for a sampler name hetero.remote_samplers does not list (refused)"),
    Metric(
        REMOTE + "rate_limited",
        "wrong tokens answered 429 and unlogged: beyond hetero.gateway.auth_failures_per_minute from one address",
    ),
    # the audit of remote samplers (hetero.audit), per sampler name
    Metric(REMOTE + "{sampler}/audited", "its results selected for an audit (hetero.audit.fraction)"),
    Metric(REMOTE + "{sampler}/audit_errors", "audits that could not run (the result was released unaudited)"),
    Metric(REMOTE + "{sampler}/audit_failed", "audited results whose log-probs disagreed (hold: not trained)"),
    Metric(
        REMOTE + "{sampler}/cut_by_quarantine",
        "its requests failed because it was quarantined (in flight at the verdict; their groups count as failed)",
    ),
    Metric(REMOTE + "{sampler}/audits", "audits completed (trajectories recomputed under the claimed version)"),
    Metric(REMOTE + "{sampler}/audit_failures", "audits whose log-probs exceeded the threshold"),
    Metric(REMOTE + "{sampler}/largest_gap", "the largest |claimed - recomputed| log-prob over its audits"),
    Metric(REMOTE + "{sampler}/log_e/{test}", "the log e-value of its sequential test (log_probs, sampling)"),
    Metric(REMOTE + "{sampler}/quarantined", "1 once an audit's sequential test rejected it"),
    Metric(REMOTE + "audit_seconds", "the auditor's compute so far (recomputing audited and trusted trajectories), s"),
    Metric(REMOTE + "audit_version_pulls", "weight versions the auditor pulled from the relay"),
    Metric(REMOTE + "calibration/{dtype}/trusted", "in-cluster trajectories recomputed to calibrate the threshold"),
    Metric(REMOTE + "calibration/{dtype}/tau", "the calibrated threshold, once enough trusted trajectories were seen"),
)


@functools.cache
def _patterns() -> tuple[tuple[re.Pattern[str], Metric], ...]:
    out = []
    for metric in METRICS:
        pattern = re.sub(r"\\\{[a-z]+\\\}", "[^/]+", re.escape(metric.key))
        out.append((re.compile(pattern + r"\Z"), metric))
    return tuple(out)


def declaration(key: str) -> Metric | None:
    """The table's entry for ``key`` (None: not declared)."""
    return next((metric for pattern, metric in _patterns() if pattern.match(key)), None)


def undeclared(keys: Iterable[str]) -> list[str]:
    """The keys under the plugin's namespaces that the table does not declare (sorted)."""
    return sorted({key for key in keys if key.startswith(NAMESPACES) and declaration(key) is None})
