"""Adaptive γ: choose each round's number of drafts to maximise expected tokens per second.

With per-token acceptance α (drafts accepted independently, as in Leviathan et al.), a
round with γ drafts emits E(γ) = (1 − α^(γ+1)) / (1 − α) tokens on average and costs
γ·c_draft + c_verify(γ) seconds, so the controller picks

    γ* = argmax_{γ_min <= γ <= γ_max}  E(γ) / (γ·c_draft + c_verify(γ))

from exponentially decayed estimates of α and of the costs, measured each round. The
verify cost is modelled as a + b·γ, fitted by decayed least squares over the rounds'
(γ, seconds): on a CPU a 9-token verify costs ~1.5x a 1-token one, and a constant
c_verify would overrate long rounds. While the recent rounds all had the same γ the
slope is unknown and taken as 0. c_draft is what the client waited for per draft: with
the drafter's speculation cache, only the part left on the critical path.
α is estimated from the accepted prefixes: a round that accepted a of k drafts saw a
successes and, when a < k, one failure (the maximum-likelihood estimate for a geometric
prefix). Until the costs are measured the controller proposes γ_max.

Acceptance comes in bursts when the drafter copies (an n-gram drafter inside a quoted
passage accepts everything, outside it almost nothing), which one decayed α averages
away. So α is also kept per state of a two-state Markov chain, "the last round accepted
every draft" or "it rejected one", each state's estimate shrunk towards the pooled α
(`prior_weight` pseudo-trials of it) so that a rarely visited state borrows strength; the
next γ uses the current state's α. With independent acceptance both states estimate the
same α and nothing changes; with bursts the controller runs long rounds inside a copy
and short ones outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ): expected tokens emitted by one round (accepted drafts + the bonus / recovered)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveGamma:
    gamma_min: int = 1
    gamma_max: int = 8
    decay: float = 0.8  # weight of the past in each estimate; lower reacts faster
    prior_alpha: float = 0.8
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    markov: bool = True  # condition α on whether the last round accepted every draft
    _successes: float = 0.0
    _trials: float = 0.0
    # per state (0: the last round rejected a draft, 1: it accepted all): decayed [successes, trials]
    _by_state: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0], [0.0, 0.0]])
    _state: int = 1
    _c_draft: float | None = None  # seconds per drafted token
    # decayed sums over rounds of 1, γ, γ², t, γ·t (t = verify seconds): a least-squares fit of t = a + b·γ
    _v: list[float] = field(default_factory=lambda: [0.0] * 5)

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"need 0 <= gamma_min <= gamma_max, got {self.gamma_min}, {self.gamma_max}")
        self._successes = self.prior_alpha * self.prior_weight
        self._trials = self.prior_weight

    @property
    def pooled_alpha(self) -> float:
        return self._successes / self._trials if self._trials else self.prior_alpha

    @property
    def alpha(self) -> float:
        """The acceptance expected in the next round (the current state's, with `markov`)."""
        pooled = self.pooled_alpha
        if not self.markov:
            return pooled
        successes, trials = self._by_state[self._state]
        return (successes + self.prior_weight * pooled) / (trials + self.prior_weight)

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Record one round: `accepted` of `proposed` drafts, and its measured costs."""
        if proposed <= 0:
            return
        failures = 1 if accepted < proposed else 0
        self._successes = self.decay * self._successes + accepted
        self._trials = self.decay * self._trials + accepted + failures
        counts = self._by_state[self._state]
        counts[0] = self.decay * counts[0] + accepted
        counts[1] = self.decay * counts[1] + accepted + failures
        self._state = 1 - failures
        per_token = draft_s / proposed
        self._c_draft = per_token if self._c_draft is None else self.decay * self._c_draft + (1 - self.decay) * per_token
        g = float(proposed)
        self._v = [self.decay * s + x for s, x in zip(self._v, (1.0, g, g * g, verify_s, g * verify_s))]

    def verify_cost(self) -> tuple[float, float]:
        """(a, b) of the verify cost a + b·γ in seconds; b = 0 until γ has varied."""
        w, sg, sgg, st, sgt = self._v
        det = w * sgg - sg * sg
        b = max(0.0, (w * sgt - sg * st) / det) if w > 0 and det > 1e-6 * w * w else 0.0
        a = max(0.0, (st - b * sg) / w) if w > 0 else 0.0
        return a, b

    def next_gamma(self, limit: int | None = None) -> int:
        """The γ with the highest expected tokens per second, within [gamma_min, min(gamma_max, limit)]."""
        hi = self.gamma_max if limit is None else max(self.gamma_min, min(self.gamma_max, limit))
        if self._c_draft is None:
            return hi
        alpha = self.alpha
        a, b = self.verify_cost()

        def rate(g: int) -> float:
            return expected_tokens(alpha, g) / (g * (self._c_draft + b) + a)

        return max(range(self.gamma_min, hi + 1), key=rate)
