"""Auditing remote samplers: statistics that decide, with a stated false-positive rate, whether a sampler lies.

Framework-free (torch, numpy). The rooms, one job each:

- :mod:`~gepo_plugin.hetero.audit.pit`: the randomised PIT of sampled tokens under the claimed distribution;
- :mod:`~gepo_plugin.hetero.audit.sequential`: anytime-valid sequential tests (test martingales) over audits;
- :mod:`~gepo_plugin.hetero.audit.thresholds`: how far log-probs may differ, derived (fp32) or calibrated (bf16);
- :mod:`~gepo_plugin.hetero.audit.selection`: which trajectories are audited, from a secret samplers never see;
- :mod:`~gepo_plugin.hetero.audit.examine`: one audited trajectory's log-prob gap and PITs;
- :mod:`~gepo_plugin.hetero.audit.book`: each sampler's tests, counters and verdict, saved with the run.
"""
