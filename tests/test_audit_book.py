"""The audit's parts below verl: which trajectories are audited, the thresholds, one examination, the verdicts.

Synthetic samplers over a real (random) distribution: an honest one draws its tokens from the claimed distribution
and reports its log-probs to float32 rounding; liars report stale log-probs, shifted or scaled ones, greedy tokens,
or tokens of another distribution with honestly recomputed log-probs. Every liar is quarantined within the audits
the closed forms of :mod:`gepo_plugin.hetero.audit.sequential` give; the honest one never, over 300 audits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gepo_plugin.hetero.audit.book import LOG_PROBS, SAMPLING, SamplerAudits
from gepo_plugin.hetero.audit.examine import examine
from gepo_plugin.hetero.audit.pit import processed_logprobs
from gepo_plugin.hetero.audit.selection import AuditSelection
from gepo_plugin.hetero.audit.sequential import audits_to_quarantine_a_constant_liar
from gepo_plugin.hetero.audit.thresholds import FLOAT32_TAU, calibrated_tau, derived_tau, trusted_needed

ALPHA, P0 = 1e-3, 0.01
TOKENS, VOCAB = 24, 64


def test_the_audited_share_and_the_uniforms_come_from_the_secret_alone():
    selection = AuditSelection(0.1, secret=b"k" * 32)
    picks = [selection.audited("s1", f"r{i}") for i in range(20_000)]
    assert abs(sum(picks) / 20_000 - 0.1) < 4 * math.sqrt(0.1 * 0.9 / 20_000)
    again = AuditSelection(0.1, secret=b"k" * 32)
    assert [again.audited("s1", f"r{i}") for i in range(2_000)] == picks[:2_000]  # reproducible with the secret
    other = AuditSelection(0.1)  # a fresh secret: other decisions
    assert [other.audited("s1", f"r{i}") for i in range(2_000)] != picks[:2_000]
    assert [selection.audited("s2", f"r{i}") for i in range(2_000)] != picks[:2_000]  # per sampler
    u = selection.uniforms("s1", "r0", 50_000)
    assert abs(u.mean() - 0.5) < 0.01 and np.array_equal(u, again.uniforms("s1", "r0", 50_000))
    assert not np.array_equal(u[:10], selection.uniforms("s1", "r1", 10))
    with pytest.raises(ValueError, match="fraction"):
        AuditSelection(1.5)


def test_the_calibrated_threshold_is_exceeded_by_an_honest_trajectory_at_most_p0_at_the_stated_confidence():
    p0, confidence = 0.01, 0.99
    m = trusted_needed(p0, confidence)
    assert (1 - p0) ** m <= 1 - confidence < (1 - p0) ** (m - 1)  # the smallest such m
    assert calibrated_tau([1.0] * (m - 1), p0, confidence, 2.0) is None  # not enough trusted ones yet
    rng = np.random.default_rng(0)
    # 4,000 calibrations on honest differences (log-normal, bf16-like): the exceedance probability of tau
    gaps = rng.lognormal(mean=-6.0, sigma=0.7, size=(4_000, m))
    from math import erf, log, sqrt

    taus = [calibrated_tau(row, p0, confidence, 1.0) for row in gaps]
    exceed = np.asarray([0.5 * (1 - erf((log(t) + 6.0) / (0.7 * sqrt(2)))) for t in taus])
    assert (exceed > p0).mean() <= (1 - confidence) + 3 * math.sqrt(0.01 * 0.99 / 4_000), (exceed > p0).mean()
    assert derived_tau("float32") == FLOAT32_TAU and derived_tau("bfloat16") is None


def _sampler(kind: str, logits: torch.Tensor, generator: torch.Generator):
    """(tokens, claimed log-probs) of one trajectory from a sampler of the given kind."""
    claimed_dist = processed_logprobs(logits, 1.0)
    if kind == "another model":  # tokens of another distribution, log-probs honestly recomputed under the claimed
        other = processed_logprobs(logits + 1.5 * torch.randn(logits.shape, generator=generator), 1.0)
        tokens = torch.multinomial(other.exp(), 1, generator=generator).squeeze(-1)
    elif kind == "greedy":
        tokens = claimed_dist.argmax(-1)
    else:
        tokens = torch.multinomial(claimed_dist.exp(), 1, generator=generator).squeeze(-1)
    logprobs = claimed_dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    rounding = 1e-6 * (torch.rand(logprobs.shape, generator=generator, dtype=torch.float64) - 0.5)
    if kind == "stale weights":  # its distribution is one optimiser step away: log-probs off by ~1e-2
        stale = processed_logprobs(logits + 0.05 * torch.randn(logits.shape, generator=generator), 1.0)
        logprobs = stale.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    elif kind == "shifted":
        logprobs = logprobs + 0.01
    elif kind == "scaled":
        logprobs = logprobs * 1.02
    return tokens, (logprobs + rounding).float()


def _run(kind: str, audits: int, seed: int) -> tuple[SamplerAudits, int]:
    generator = torch.Generator().manual_seed(seed)
    selection = AuditSelection(1.0, secret=b"s" * 32)
    book = SamplerAudits("far", ALPHA, P0)
    for audit in range(1, audits + 1):
        logits = 2.0 * torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64)
        tokens, claimed = _sampler(kind, logits, generator)
        request = f"r{audit}"
        seen = examine(request, 3, logits, tokens, claimed, selection.uniforms("far", request, TOKENS), 1.0)
        if book.record(seen, FLOAT32_TAU) is not None:
            return book, audit
    return book, 0


def test_an_honest_sampler_is_never_quarantined_over_300_audits():
    book, quarantined_at = _run("honest", 300, seed=1)
    assert quarantined_at == 0 and book.verdict is None
    assert book.audits == 300 and book.failures == 0 and book.largest_gap < FLOAT32_TAU / 10
    assert book.metrics()["log_e/sampling"] < math.log(1 / ALPHA)


@pytest.mark.parametrize(
    ("kind", "test", "within"),
    [
        # every audit disagrees: exactly the closed form's audits
        ("stale weights", LOG_PROBS, audits_to_quarantine_a_constant_liar(P0, ALPHA)),
        ("shifted", LOG_PROBS, audits_to_quarantine_a_constant_liar(P0, ALPHA)),
        ("scaled", LOG_PROBS, audits_to_quarantine_a_constant_liar(P0, ALPHA)),
        # honest log-probs of dishonest tokens: the PITs of 24 tokens an audit (over 30 seeds: greedy always 2
        # audits; another model 5 to 37, 19 on average)
        ("greedy", SAMPLING, 4),
        ("another model", SAMPLING, 40),
    ],
)
def test_every_liar_is_quarantined_by_its_test_within_the_stated_audits(kind, test, within):
    book, quarantined_at = _run(kind, 200, seed=2)
    assert 0 < quarantined_at <= within, (kind, quarantined_at)
    assert test == SAMPLING or quarantined_at > 1  # one disagreeing trajectory never quarantines
    verdict = book.verdict
    assert verdict.test == test and verdict.audits == quarantined_at and verdict.log_e_value >= verdict.log_threshold
    assert "remote sampler 'far' quarantined" in verdict.message() and f"request r{quarantined_at}" in verdict.message()
    honest = examine("x", 3, torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), torch.tensor([math.log(0.5)]),
                     np.zeros(1), 1.0)  # fmt: skip
    assert honest.max_gap < 1e-7 and book.record(honest, FLOAT32_TAU) is verdict  # a verdict is final


def test_a_saved_book_continues_exactly_where_it_stopped():
    """Differential: 20 audits straight, against 10, saved and restored into a new book, then the same 10."""
    straight, _ = _run("another model", 20, seed=3)
    generator = torch.Generator().manual_seed(3)
    selection = AuditSelection(1.0, secret=b"s" * 32)
    book = SamplerAudits("far", ALPHA, P0)
    for audit in range(1, 21):
        if audit == 11:
            state = book.state()
            book = SamplerAudits("far", ALPHA, P0)
            book.restore(state)
        logits = 2.0 * torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64)
        tokens, claimed = _sampler("another model", logits, generator)
        request = f"r{audit}"
        book.record(examine(request, 3, logits, tokens, claimed, selection.uniforms("far", request, TOKENS), 1.0),
                    FLOAT32_TAU)  # fmt: skip
        if book.verdict is not None:
            break
    assert book.state() == straight.state()
