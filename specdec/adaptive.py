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

Under load (`ServingCosts`, shared by all generations of a client): the costs a session
measures for itself hide what its drafts cost everyone else. Its verify waits for a batch
full of the other sessions' drafts whether or not it sends its own, so each session alone
would always find speculation worth it, even when all of them together would be faster
without. So the services report, with every answer, the engine step that served it
(`EngineLoad`: rows, tokens, milliseconds) and how many sessions are running (B); the client
fits each engine's step cost against step size (verifier: seconds = a + b·tokens; drafter:
seconds = a + b·rows) and chooses the γ that maximises goodput when every running session
uses it (SmartSpec, arXiv 2406.14066):

    rate(γ) = E(γ) / (o_d + γ·T_d(B) + o_v + T_v(B·(γ + 1)))     rate(0) = k / (o_v + k·T_v(B))

o_d, o_v are what a call costs beyond its engine steps (gRPC, serialization), measured as
latency minus reported engine time; k is the target-only steps a round without drafts runs
(`decode_steps`: one call for k tokens, so its overhead is shared by k of them). The terms
add up because on a shared host the two engines take turns on the cores (with separate
devices this is the latency of one round,
and the overlap between sessions is a bonus the model does not count). γ = 0 wins when
batched drafting and wide verifies cost more than they save; sessions then run target-only
rounds, and every `probe_every` of them one short round re-measures α and the drafter, so
the estimates never go stale (a probe is skipped where the drafter would first have to
prefill the whole sequence: that is no cheap probe). Speculation resumes when the load
drops without one: the model is evaluated at the B the verifier reports every round. A verifier that
reports `speculation_disabled` (its operator's cap) gets γ = 0 without probes; so does a client
whose drafter and verifier time-slice one GPU once it runs `shared_gpu_cap` sessions there (the
CPU cap's reason, on a GPU: on an H200 a copy drafter beside the verifier made each 2.7 ms verify
step 26 ms at concurrency 8, 0.70x of target-only).

A seeded request (`deterministic`) must give the same output alone or under load, and which
positions are verified as drafts and which are sampled as bonus tokens decides which of its
position-keyed draws are used. So its γ follows from its own rounds only: the same α estimates
(prior, decay, Markov state), the rate E(γ) / (1 + γ·DETERMINISTIC_DRAFT_COST) with that fixed
nominal cost, and the count-based probes; never timings, the load model, the verifier's cap or
other generations' acceptance. It still adapts (γ 0 below α ~0.15, γ_max near α 1) but gives
up goodput under load: it drafts where the load model would have chosen γ = 0.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ): expected tokens emitted by one round (accepted drafts + the bonus / recovered)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class LinearCost:
    """Decayed least-squares fit of seconds = a + b·x (x: tokens or rows of an engine step).
    Until x has varied the slope is unknown: then b = a / prior_doubling, the prior that
    the step costs twice as much `prior_doubling` units further on."""

    def __init__(self, decay: float = 0.95, prior_doubling: float = 32.0) -> None:
        self.decay = decay
        self.prior_doubling = prior_doubling
        self._s = [0.0] * 5  # decayed sums of 1, x, x², t, x·t

    @property
    def weight(self) -> float:
        return self._s[0]

    def add(self, x: float, t: float) -> None:
        d, (w, sx, sxx, st, sxt) = self.decay, self._s  # every round of every generation adds one
        self._s = [d * w + 1.0, d * sx + x, d * sxx + x * x, d * st + t, d * sxt + x * t]

    def fit(self) -> tuple[float, float]:
        w, sx, sxx, st, sxt = self._s
        if w <= 0:
            return 0.0, 0.0
        det = w * sxx - sx * sx
        if det > 1e-6 * w * w * max(1.0, sx / w) ** 2:  # x varied enough to see a slope
            b = max(0.0, (w * sxt - sx * st) / det)
            return max(0.0, (st - b * sx) / w), b
        mean_x, mean_t = sx / w, st / w
        # t = a + a·x / prior_doubling through the observed mean
        a = mean_t / (1.0 + mean_x / self.prior_doubling)
        return a, a / self.prior_doubling

    def __call__(self, x: float) -> float:
        a, b = self.fit()
        return a + b * x


class ServingCosts:
    """What a client has learnt about its services under the current load, shared by all
    its generations (thread-safe): each engine's step cost against step size, the per-call
    overheads, the running sessions B, and the acceptance of recent generations (the prior
    of a new one). Fed by every round's `EngineLoad` reports."""

    MIN_DRAFT_SAMPLES = 1.0  # decayed weight of draft-step samples before the model is used
    MIN_VERIFY_SAMPLES = 1.0

    def __init__(self, decay: float = 0.9, decode_steps: int = 1) -> None:
        self.decay = decay
        self.decode_steps = max(1, decode_steps)  # target-only steps of a γ = 0 round (its k)
        self.verify = LinearCost(decay, prior_doubling=32.0)  # seconds per verifier step vs its tokens
        self.draft = LinearCost(decay, prior_doubling=8.0)  # seconds per drafter step vs its rows
        self.verify_overhead = 0.0  # seconds per Verify call beyond the engine step
        self.draft_overhead = 0.0  # seconds per Draft call beyond its engine steps
        self.reported_running = 1  # sessions running on the verifier (B), as it last reported
        self.local_running = 0  # this client's generations in flight on it (begin / end)
        self.verifier_disabled = False  # the verifier asks for no drafts (--speculative-disable-by-batch-size)
        # Drafter and verifier on one GPU (two processes time-slice it): no drafts from this many
        # running sessions on; 0 = no such cap (separate devices, or CPUs: the verifier's cap)
        self.shared_gpu_cap = 0
        self._alpha = [0.0, 0.0]  # decayed [accepted, trials] of all generations
        self._zero_rounds = 0  # γ = 0 rounds of all generations since the last probe
        self._probe_backoff = 1  # probes that found γ 0 still right space the next ones out (x2, up to x8)
        self.probe_owed = False  # a probe chosen where the drafter held nothing: the next round to draft runs it
        self._lock = threading.Lock()

    @property
    def disabled(self) -> bool:
        """No drafts now: the verifier's operator cap, or this client's own on a shared GPU."""
        return self.verifier_disabled or 0 < self.shared_gpu_cap <= self.running

    @property
    def running(self) -> int:
        """B: what the verifier reported, at least this client's own generations in flight (which
        it knows before any reply: sessions that start together see each other at once)."""
        return max(self.reported_running, self.local_running)

    def begin(self) -> None:
        with self._lock:
            self.local_running += 1

    def end(self) -> None:
        with self._lock:
            self.local_running = max(0, self.local_running - 1)

    def ready(self) -> bool:
        with self._lock:
            return self.verify.weight >= self.MIN_VERIFY_SAMPLES and self.draft.weight >= self.MIN_DRAFT_SAMPLES

    def observe_verify(self, load, latency_s: float, fit: bool = True, steps: int = 1) -> None:
        """load: the verifier's EngineLoad for one call; fit: the call ran no chunked prefill, so
        its cost and overhead are a sample of the model; steps: the engine steps it ran (a round
        of several decode steps reports their summed time, and the last step's tokens)."""
        with self._lock:
            self.reported_running = max(1, load.running_sessions)
            self.verifier_disabled = load.speculation_disabled
            if fit and load.step_tokens > 0:
                # Target-only rounds of several steps are samples too: without them, once γ 0 won
                # only probes fed the fit (3 tokens wide), and a slope misread from a few of them
                # kept γ at 0 at concurrency 1 for whole generations
                self.verify.add(load.step_tokens, load.step_ms / 1e3 / max(1, steps))
                over = max(0.0, latency_s - load.step_ms / 1e3 - load.queue_ms / 1e3)
                self.verify_overhead = self._mix(self.verify_overhead, over, self.verify.weight)

    def observe_draft(self, load, latency_s: float, steps: int) -> None:
        """load: the drafter's EngineLoad for a Draft that ran `steps` engine steps of one
        row each for this session (γ drafts, no long catch-up)."""
        if steps <= 0 or load.step_rows <= 0:
            return
        with self._lock:
            step_s = load.step_ms / 1e3
            self.draft.add(load.step_rows, step_s)
            over = max(0.0, latency_s - steps * step_s - load.queue_ms / 1e3)
            self.draft_overhead = self._mix(self.draft_overhead, over, self.draft.weight)

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        with self._lock:
            failures = 1 if accepted < proposed else 0
            self._alpha = [self.decay * self._alpha[0] + accepted, self.decay * self._alpha[1] + accepted + failures]

    def probe_due(self, every: int) -> bool:
        """Count one γ = 0 round of any generation; True for every (every + 1)-th, a probe. Shared:
        a client whose generations are each shorter than `every` rounds must still probe, or
        estimates learnt under other conditions (a busy host) would keep γ at 0 for good."""
        with self._lock:
            self._zero_rounds += 1
            if self._zero_rounds > every * self._probe_backoff:
                self._zero_rounds = 0
                return True
            return False

    def count_zero_rounds(self, n: int) -> None:
        """n more γ = 0 rounds toward the next probe, without one being due now (the tokens past
        the first of a round of several decode steps)."""
        with self._lock:
            self._zero_rounds += n

    def probe_outcome(self, resumed: bool) -> None:
        """After a probe: speculation resumed (probes at the base rate again), or γ 0 held (the
        next probe comes twice as late, up to 8x: a useless drafter costs little to re-check)."""
        with self._lock:
            self._probe_backoff = 1 if resumed else min(8, 2 * self._probe_backoff)

    def alpha(self, default: float) -> float:
        with self._lock:
            return self._alpha[0] / self._alpha[1] if self._alpha[1] > 0 else default

    def round_s(self, gamma: int) -> float:
        """Seconds of one round per session when all B running sessions use `gamma`; for γ = 0, per
        token: a round of k decode steps pays its call's overhead once."""
        with self._lock:
            b = self.running
            if gamma == 0:
                return self.verify_overhead / self.decode_steps + self.verify(b)
            verify = self.verify_overhead + self.verify(b * (gamma + 1))
            return self.draft_overhead + gamma * self.draft(b) + verify

    def _mix(self, old: float, new: float, weight: float) -> float:
        return new if weight <= 1.0 else self.decay * old + (1 - self.decay) * new


# Deterministic mode's cost of one drafted token relative to a verify round: a drafter of
# about a tenth of the target's cost plus its call. A constant, so the choice of γ depends on
# acceptance alone: γ 0 below α ~0.15, up to γ_max when α is near 1.
DETERMINISTIC_DRAFT_COST = 0.15


@dataclass
class AdaptiveGamma:
    gamma_min: int = 1
    gamma_max: int = 8
    decay: float = 0.8  # weight of the past in each estimate; lower reacts faster
    prior_alpha: float = 0.8
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    markov: bool = True  # condition α on whether the last round accepted every draft
    costs: ServingCosts | None = None  # the client's load model: goodput under load (see the module doc)
    probe_every: int = 16  # after this many γ = 0 rounds, one short round re-measures
    probe_gamma: int = 2
    # A seeded request: γ follows from its own rounds only (acceptance, round count), never from
    # timings, load or other generations, so the same seed gives the same rounds, hence the
    # same draws and output, alone or under load. Costs are the nominal DETERMINISTIC_DRAFT_COST.
    deterministic: bool = False
    _successes: float = 0.0
    _trials: float = 0.0
    # per state (0: the last round rejected a draft, 1: it accepted all): decayed [successes, trials]
    _by_state: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0], [0.0, 0.0]])
    _state: int = 1
    _c_draft: float | None = None  # seconds per drafted token
    # decayed sums over rounds of 1, γ, γ², t, γ·t (t = verify seconds): a least-squares fit of t = a + b·γ
    _v: list[float] = field(default_factory=lambda: [0.0] * 5)
    _zero_rounds: int = 0  # γ = 0 rounds since the last probe (deterministic, or without a load model)
    probing: bool = False  # the last next_gamma was a probe, not the model's choice
    _probe_deferred: bool = False  # a probe waits for the drafter to catch up (defer_probe)
    _probed: bool = False  # a probe round ran: the next choice is its outcome

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"need 0 <= gamma_min <= gamma_max, got {self.gamma_min}, {self.gamma_max}")
        if self.costs is not None:
            self.attach(self.costs)
        self._successes = self.prior_alpha * self.prior_weight
        self._trials = self.prior_weight

    def attach(self, costs: ServingCosts) -> None:
        """Use `costs` as the load model; a generation that has not run a round yet starts
        from the acceptance of the client's recent generations (not a deterministic one: that
        prior depends on what else ran)."""
        self.costs = costs
        if self.deterministic:
            return
        if self._trials == self.prior_weight and self._successes == self.prior_alpha * self.prior_weight:
            self.prior_alpha = costs.alpha(self.prior_alpha)
            self._successes = self.prior_alpha * self.prior_weight

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
        """Record one round: `accepted` of `proposed` drafts, and its measured costs (a round
        without drafts gives the verify cost at γ = 0 only)."""
        if proposed <= 0:
            self._v = [self.decay * s + x for s, x in zip(self._v, (1.0, 0.0, 0.0, verify_s, 0.0))]
            return
        self._probed, self._probe_deferred = self.probing, False
        if self.probing and self.costs is not None and not self.deterministic:
            self.costs.probe_owed = False
        if self.costs is not None:
            self.costs.observe_acceptance(proposed, accepted)
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

    def note_decode_steps(self, tokens: int) -> None:
        """A γ = 0 round of several target-only steps emitted `tokens`: each past the first counts
        as a γ = 0 round toward the next probe, so probes stay every `probe_every` tokens (counted
        in rounds, they came every 16 rounds of 4 tokens, and 10-token generations had none)."""
        if tokens <= 1:
            return
        if self.costs is not None and not self.deterministic:
            self.costs.count_zero_rounds(tokens - 1)
        else:
            self._zero_rounds += tokens - 1

    def defer_probe(self) -> None:
        """The probe just chosen cannot draft yet (the drafter holds nothing of this sequence
        and catches up in the background): later rounds run it, once they can draft. Without
        this, estimates that said γ 0 would stand for good, since only drafting rounds update them.
        Owed on the load model (any generation's next round may run it: this one may end first),
        except in a deterministic schedule, which keeps to its own rounds."""
        if self.costs is not None and not self.deterministic:
            self.costs.probe_owed = True
        else:
            self._probe_deferred = True

    def verify_cost(self) -> tuple[float, float]:
        """(a, b) of the verify cost a + b·γ in seconds; b = 0 until γ has varied."""
        w, sg, sgg, st, sgt = self._v
        det = w * sgg - sg * sg
        b = max(0.0, (w * sgt - sg * st) / det) if w > 0 and det > 1e-6 * w * w else 0.0
        a = max(0.0, (st - b * sg) / w) if w > 0 else 0.0
        return a, b

    def best_gamma(self, hi: int) -> int:
        """The model's choice in [gamma_min, hi], without probes or bookkeeping (so a client can
        ask, before its first round, whether this generation will want drafts at all)."""
        alpha = self.alpha
        if self.deterministic:
            def rate(g: int) -> float:
                return expected_tokens(alpha, g) / (1.0 + g * DETERMINISTIC_DRAFT_COST)

            return max(range(self.gamma_min, max(self.gamma_min, hi) + 1), key=rate)
        if self.costs is not None and self.costs.disabled:
            return self.gamma_min
        if self.costs is not None and self.costs.ready():
            costs = self.costs

            def rate(g: int) -> float:
                return expected_tokens(alpha, g) / max(costs.round_s(g), 1e-9)
        elif self._c_draft is None:
            return max(self.gamma_min, hi)
        else:
            a, b = self.verify_cost()

            def rate(g: int) -> float:
                return expected_tokens(alpha, g) / max(g * (self._c_draft + b) + a, 1e-9)

        return max(range(self.gamma_min, max(self.gamma_min, hi) + 1), key=rate)

    def next_gamma(self, limit: int | None = None) -> int:
        """The γ with the highest expected tokens per second, within [gamma_min, min(gamma_max, limit)]:
        goodput of all running sessions with a load model (`costs`), else this session's own rate."""
        hi = self.gamma_max if limit is None else max(self.gamma_min, min(self.gamma_max, limit))
        if self.costs is not None and self.costs.disabled and not self.deterministic:
            self.probing = False  # a probe chosen before the cap is over: its rounds are no probe's
            return self.gamma_min
        best = self.best_gamma(hi)
        self.probing = False
        if self._probed and self.costs is not None and not self.deterministic:
            self.costs.probe_outcome(resumed=best > 0)
        self._probed = False
        if best > 0 or hi == 0:
            self._zero_rounds = 0
            return best
        shared = self.costs is not None and not self.deterministic
        if self._probe_deferred or (shared and self.costs.probe_owed):  # a probe waited for a drafter
            self.probing = True
            return min(self.probe_gamma, hi)
        if self.costs is not None and not self.deterministic:  # counted over the client's generations
            due = self.costs.probe_due(self.probe_every)
        else:  # a deterministic schedule follows from this generation's own rounds
            self._zero_rounds += 1
            due = self._zero_rounds > self.probe_every
            if due:
                self._zero_rounds = 0
        if due:  # a cheap probe keeps α and the draft cost current
            self.probing = True
            return min(self.probe_gamma, hi)
        return 0
