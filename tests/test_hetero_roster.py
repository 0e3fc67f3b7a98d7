"""The sampler roster: membership of the groups, the failures and replacements, and their books across resume."""

from __future__ import annotations

import pytest

from gepo_plugin.hetero.roster import NoSamplerLeft, SamplerRoster


def test_a_group_is_alive_while_any_of_its_replicas_is():
    roster = SamplerRoster([2, 1])
    assert roster.groups == [{0, 1}, {2}] and roster.live_groups() == [0, 1]
    assert roster.retire(0, "died", learner_version=3, detect_s=1.5) is False  # replica 1 still serves group 0
    assert roster.alive(0)
    assert roster.retire(2, "hung", learner_version=4, detect_s=30.0) is True
    assert roster.live_groups() == [0]
    m = roster.metrics()
    assert m["sampler_failures"] == 2 and m["sampler_failures/died"] == 1
    assert m["sampler_failures/hung"] == 1 and m["sampler_replicas_alive"] == 1
    assert (m["sampler_group_0/alive"], m["sampler_group_1/alive"]) == (1.0, 0.0)
    assert m["sampler_detect_s/last"] == 30.0


def test_a_replica_is_retired_once_and_replacements_get_fresh_ids():
    roster = SamplerRoster([1, 1])
    roster.retire(1, "died", 2, 1.0)
    with pytest.raises(ValueError, match="already retired"):
        roster.retire(1, "died", 2, 1.0)
    with pytest.raises(ValueError, match="unknown failure kind"):
        roster.retire(0, "slow", 2, 1.0)
    with pytest.raises(ValueError, match="no replacement is starting"):
        roster.join(1)  # only a started replacement joins
    roster.begin_replacement(1)
    new = roster.join(1)
    assert new == 2 and roster.group_of[new] == 1 and roster.alive(1) and roster.replacements == 1
    roster.begin_replacement(1)
    assert roster.join(1) == 3  # ids are never reused


def test_losing_every_sampler_is_an_error_that_names_what_was_lost():
    roster = SamplerRoster([1, 1])
    roster.retire(0, "died", 5, 2.0)
    roster.require_any()  # one left
    roster.retire(1, "hung", 6, 30.0)
    with pytest.raises(NoSamplerLeft, match=r"replica 0 of group 0 died, replica 1 of group 1 hung"):
        roster.require_any()


def test_a_replacement_still_starting_keeps_the_run_alive_until_it_fails():
    roster = SamplerRoster([1])
    roster.retire(0, "died", 5, 2.0)
    roster.begin_replacement(0)
    roster.require_any()  # nothing serves, but a replacement is on its way: the learner waits for it
    assert roster.metrics()["sampler_replacements/starting"] == 1
    roster.abandon_replacement(0)
    assert roster.metrics()["sampler_replacements/starting"] == 0 and roster.replacements == 0
    with pytest.raises(NoSamplerLeft):
        roster.require_any()
    with pytest.raises(ValueError, match="no replacement is starting"):
        roster.abandon_replacement(0)


def test_the_books_continue_across_a_resume_with_every_replica_started_afresh():
    roster = SamplerRoster([1, 1])
    roster.retire(1, "died", 5, 2.0)
    roster.begin_replacement(1)
    roster.join(1)
    roster.begin_replacement(0)  # still starting at the checkpoint: not restored (a resume starts every replica)
    resumed = SamplerRoster([1, 1])
    resumed.load_state_dict(roster.state_dict())
    assert resumed.live_groups() == [0, 1] and resumed.replacements == 1
    assert [(f.group, f.kind, f.learner_version) for f in resumed.failures] == [(1, "died", 5)]
    assert resumed.metrics()["sampler_failures"] == 1 and sum(resumed.starting.values()) == 0
    fresh = SamplerRoster([2])
    fresh.load_state_dict({})  # a checkpoint from before elastic samplers
    assert fresh.failures == [] and fresh.replacements == 0
