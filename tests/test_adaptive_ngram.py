"""Unit tests of the n-gram proposer and the adaptive-γ controller (pure logic)."""

from __future__ import annotations

import random

import pytest

from specdec.adaptive import AdaptiveGamma, ServingCosts, expected_tokens
from specdec.ngram import ngram_propose
from specdec.serving import EngineLoad


def test_ngram_prefers_the_longest_recent_match():
    seq = [1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    # suffix 1 2 3 recurs at 0 (followed by 9 9): longer match wins over "2 3" at 5 (followed by 7 7)
    assert ngram_propose(seq, 2) == [9, 9]
    assert ngram_propose(seq, 2, n_max=2) == [7, 7]  # only bigrams: the most recent "2 3"
    assert ngram_propose([4, 5, 6], 3) == []  # nothing recurs
    assert ngram_propose([4, 5, 4], 5) == [5, 4]  # stops at the end of the sequence
    assert ngram_propose(seq, 0) == []


def test_expected_tokens_formula():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_controller_stays_in_bounds_and_tracks_acceptance_changes():
    """Synthetic rounds: acceptance 0.95 for 60 rounds, then 0.2: γ starts high and falls."""
    rng = random.Random(0)
    ctl = AdaptiveGamma(gamma_min=1, gamma_max=8)
    assert ctl.next_gamma() == 8  # no costs yet
    history = []
    for rnd in range(120):
        alpha = 0.95 if rnd < 60 else 0.2
        g = ctl.next_gamma()
        assert 1 <= g <= 8
        accepted = 0
        while accepted < g and rng.random() < alpha:
            accepted += 1
        ctl.update(g, accepted, draft_s=0.01 * g, verify_s=0.05)
        history.append(g)
    assert min(history[40:60]) >= 6  # high acceptance, cheap drafts: long rounds
    assert max(history[100:]) <= 3  # after the drop it shortens the rounds
    assert ctl.alpha < 0.5
    assert ctl.next_gamma(limit=2) <= 2


def test_controller_matches_brute_force_optimum():
    ctl = AdaptiveGamma(gamma_min=1, gamma_max=8, decay=0.0)
    ctl.update(4, 2, draft_s=0.04, verify_s=0.1)  # alpha = 2/3, c_draft 0.01, c_verify 0.1
    alpha = 2 / 3
    best = max(range(1, 9), key=lambda g: expected_tokens(alpha, g) / (0.01 * g + 0.1))
    assert ctl.next_gamma() == best


def test_controller_fits_a_verify_cost_that_grows_with_gamma():
    """Verify costs 0.05 + 0.02·γ: a constant-cost model would pick a longer round than the optimum."""
    ctl = AdaptiveGamma(gamma_min=1, gamma_max=8, decay=0.95)
    alpha = 0.8
    for rnd in range(40):
        g = 1 + rnd % 8  # rounds of every length, as acceptance changes would produce
        ctl.update(g, round(alpha * g), draft_s=0.005 * g, verify_s=0.05 + 0.02 * g)
    a, b = ctl.verify_cost()
    assert a == pytest.approx(0.05, rel=1e-6) and b == pytest.approx(0.02, rel=1e-6)
    est = ctl.alpha
    best = max(range(1, 9), key=lambda g: expected_tokens(est, g) / (0.005 * g + 0.05 + 0.02 * g))
    flat = max(range(1, 9), key=lambda g: expected_tokens(est, g) / (0.005 * g + 0.05 + 0.02 * 4.5))
    assert ctl.next_gamma() == best
    assert best < flat  # the fit matters here


def _acceptance_world(seed: int, n: int, bursty: bool, alpha: float = 0.8) -> list[bool]:
    """Whether a draft at each output position would be accepted. Bursty: a hidden regime,
    copy (α 0.97, runs of ~30 tokens) or novel (α 0.1, runs of ~20), as an n-gram drafter sees."""
    rng = random.Random(seed)
    copy, world = False, []
    for _ in range(n):
        if bursty:
            if rng.random() < (1 / 30 if copy else 1 / 20):
                copy = not copy
            world.append(rng.random() < (0.97 if copy else 0.1))
        else:
            world.append(rng.random() < alpha)
    return world


def _tokens_per_s(world: list[bool], choose, update, c_draft: float = 0.001, a: float = 0.05,
                  b: float = 0.004) -> float:
    """Rounds over a fixed world (common random numbers: every controller faces the same
    acceptances), costing γ·c_draft + a + b·γ each."""
    pos, seconds = 0, 0.0
    while pos < len(world) - 16:
        g = choose()
        k = 0
        while k < g and world[pos + k]:
            k += 1
        pos += k + 1
        seconds += g * c_draft + a + b * g
        update(g, k, g * c_draft, a + b * g)
    return pos / seconds


def _compare(world: list[bool]) -> tuple[float, float, float]:
    """(markov, pooled, best fixed γ in 1..8) tokens/s."""
    rates = []
    for markov in (True, False):
        ctl = AdaptiveGamma(gamma_min=1, gamma_max=8, markov=markov)
        rates.append(_tokens_per_s(world, ctl.next_gamma, ctl.update))
    best_fixed = max(_tokens_per_s(world, lambda g=g: g, lambda *_: None) for g in range(1, 9))
    return rates[0], rates[1], best_fixed


def test_markov_controller_exploits_bursty_acceptance():
    """Copy bursts (an n-gram drafter): conditioning α on the last round's outcome runs long
    rounds inside a burst and short ones outside, beating one pooled α and every fixed γ."""
    for seed in range(3):
        markov, pooled, best_fixed = _compare(_acceptance_world(seed, 5000, bursty=True))
        assert markov > 1.02 * pooled, (seed, markov, pooled)
        assert markov > 1.08 * best_fixed, (seed, markov, best_fixed)
    ctl = AdaptiveGamma(gamma_min=1, gamma_max=8, decay=0.9)
    for _ in range(10):  # bursts: a full round is mostly followed by full rounds, a rejection by rejections
        for _ in range(4):
            ctl.update(8, 8, 0.008, 0.08)
        ctl.update(8, 0, 0.008, 0.08)
        for _ in range(4):
            ctl.update(1, 0, 0.001, 0.05)
        ctl.update(1, 1, 0.001, 0.05)
    ctl.update(8, 0, 0.008, 0.08)
    assert ctl.next_gamma() <= 2  # after a rejection
    ctl.update(1, 1, 0.001, 0.05)
    assert ctl.next_gamma() >= 6  # after a full acceptance


def test_markov_controller_costs_nothing_under_independent_acceptance():
    for alpha in (0.3, 0.6, 0.8, 0.95):
        markov, pooled, best_fixed = _compare(_acceptance_world(1, 5000, bursty=False, alpha=alpha))
        assert markov >= 0.99 * pooled, (alpha, markov, pooled)
        assert markov >= 0.95 * best_fixed, (alpha, markov, best_fixed)


def _deterministic_schedule(accepted_of: list[int], draft_s: float, verify_s: float,
                            costs: ServingCosts | None) -> list[int]:
    """γ per round of a seeded generation's controller whose round i accepts accepted_of[i] drafts
    (at most the γ it proposed), with the given timings and load model."""
    ctl = AdaptiveGamma(gamma_min=0, gamma_max=8, deterministic=True)
    if costs is not None:
        ctl.attach(costs)
    gammas = []
    for accepted in accepted_of:
        g = ctl.next_gamma()
        gammas.append(g)
        ctl.update(g, min(g, accepted), draft_s=draft_s * g, verify_s=verify_s)
    return gammas


def test_deterministic_controller_ignores_timings_load_the_cap_and_other_generations():
    """Same acceptance record, everything else different: a fast idle host vs a slow one whose
    verifier reports 8 sessions, asks for no drafts, and whose other generations accepted nothing."""
    rng = random.Random(3)
    record = [rng.choice([0, 1, 2, 8]) for _ in range(60)]
    loaded = ServingCosts()
    for _ in range(20):
        loaded.observe_verify(EngineLoad(running_sessions=8, step_rows=8, step_tokens=72, step_ms=350.0,
                                         speculation_disabled=True), latency_s=0.4)
        loaded.observe_draft(EngineLoad(running_sessions=8, step_rows=8, step_ms=250.0), latency_s=0.3, steps=1)
        loaded.observe_acceptance(8, 0)
    assert loaded.ready() and loaded.disabled
    idle = _deterministic_schedule(record, draft_s=0.001, verify_s=0.02, costs=None)
    assert _deterministic_schedule(record, draft_s=0.2, verify_s=0.4, costs=loaded) == idle
    assert any(g > 0 for g in idle)  # it speculated although the loaded verifier asked for no drafts


def test_deterministic_controller_still_adapts_to_acceptance():
    """Long rounds while every draft is accepted; γ 0 with a probe every probe_every + 1 rounds
    while none is (α below DETERMINISTIC_DRAFT_COST's break-even of ~0.15)."""
    high = _deterministic_schedule([8] * 20, draft_s=0.01, verify_s=0.05, costs=None)
    assert 0 < high[0] < 8 and min(high[1:]) == 8  # the prior α 0.8, then the record
    low = _deterministic_schedule([0] * 60, draft_s=0.01, verify_s=0.05, costs=None)
    assert low[0] == high[0] and low[1] < low[0] and 0 in low[:6]
    ctl = AdaptiveGamma(gamma_min=0, gamma_max=8, deterministic=True)
    tail = low[20:]
    assert set(tail) == {0, ctl.probe_gamma}
    probes = [i for i, g in enumerate(tail) if g]
    assert all(b - a == ctl.probe_every + 1 for a, b in zip(probes, probes[1:]))


def test_a_shared_gpu_caps_adaptive_drafting_under_load_as_the_cpu_cap_does():
    """Drafter and verifier time-slicing one GPU (ServingCosts.shared_gpu_cap 2): a session
    alone drafts; from two sessions on, counted by the client or reported by the verifier, an
    adaptive controller drafts nothing and probes nothing, as under the verifier's
    --speculative-disable-by-batch-size; a seeded (deterministic) schedule is unaffected."""
    costs = ServingCosts()
    costs.shared_gpu_cap = 2
    costs.begin()
    ctl = AdaptiveGamma(gamma_min=0, gamma_max=8)
    ctl.attach(costs)
    seeded = AdaptiveGamma(gamma_min=0, gamma_max=8, deterministic=True)
    seeded.attach(costs)
    assert not costs.disabled and ctl.next_gamma() > 0
    costs.begin()  # a second generation of this client
    assert costs.disabled and [ctl.next_gamma() for _ in range(40)] == [0] * 40
    assert seeded.next_gamma() > 0
    costs.end()
    assert not costs.disabled
    costs.observe_verify(EngineLoad(running_sessions=3, step_rows=3, step_tokens=3, step_ms=5.0), latency_s=0.006)
    assert costs.disabled  # other clients' sessions on the verifier count too
    without = ServingCosts()  # separate devices: no cap
    without.observe_verify(EngineLoad(running_sessions=3, step_rows=3, step_tokens=3, step_ms=5.0), latency_s=0.006)
    assert not without.disabled
