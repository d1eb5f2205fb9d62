"""Every sampling mode is lossless on the pure sampler (synthetic logits, no model).

Each test simulates speculative decoding of the first two tokens with gamma = 1 (the
first round may emit one or two tokens; a second, target-only round completes the pair)
and checks the (t1, t2) joint against the target's exact processed distribution:

    H0: P(t1, t2) = p_0(t1) * p_1(t2 | t1),

where p_1 is computed with t1 in the history, so penalties and min_tokens are checked
at the position that depends on the draft. Chi-square over the 576 cells (V = 24), with
N = 20,000 samples, a fixed seed, p > 0.001 to pass; each test also shows power by
rejecting a deliberately wrong variant on samples of the same size.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specdec.proposals import DENSE, SPARSE, ProposalBuilder, ProposalFormat, decode_proposal
from specdec.sampling import (
    SamplingParams,
    TokenContext,
    apply_penalties_and_min_tokens,
    position_uniforms,
    process_logits,
    sample_inverse_cdf,
)
from specdec.verification import (
    PLACEHOLDER_TOKEN_ID,
    VerifyOutput,
    speculative_sample,
    speculative_sample_ragged,
    typical_acceptance_sample,
)
from tests.conftest import chi_square_pvalue

V, N = 24, 20_000
EOS = 0
HISTORY = [3, 5, 5, 7]  # prompt [3, 5], then outputs [5, 7]
PROMPT_LENGTH = 2


@dataclass(frozen=True)
class _Logits:
    """Raw logits of a target and a drafter: position 0, and position 1 given t1."""

    t0: torch.Tensor  # [V]
    t1: torch.Tensor  # [V (t1), V]
    d0: torch.Tensor  # [V]

    @staticmethod
    def make(seed: int) -> "_Logits":
        g = torch.Generator().manual_seed(seed)
        t0 = torch.randn(V, generator=g) * 2
        # The drafter is a noisy copy: acceptance ~0.6, so rejections are common.
        return _Logits(t0=t0, t1=torch.randn(V, V, generator=g) * 2, d0=t0 * 0.5 + torch.randn(V, generator=g))


def _ctx(history=HISTORY) -> TokenContext:
    return TokenContext(prefix=history, prompt_length=PROMPT_LENGTH, eos_token_ids=(EOS,))


def _target(params: SamplingParams, lg: _Logits, history_aware: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(p0 [V], p1 [V, V]): processed target distributions, p1[a] with a in the history."""
    rows = [process_logits(torch.stack([lg.t0, lg.t1[a]]), params, _ctx(), [a] if history_aware else [EOS])
            for a in range(V)]
    if not history_aware:  # the bug a wrong verifier would have: p1 blind to the draft it follows
        rows = [torch.stack([r[0], process_logits(lg.t1[a][None], params, _ctx())[0]]) for a, r in enumerate(rows)]
    return rows[0][0], torch.stack([r[1] for r in rows])


def _wire_q(params: SamplingParams, lg: _Logits, fmt: ProposalFormat) -> torch.Tensor:
    """The proposal exactly as the verifier decodes it from the wire: [V]."""
    q = process_logits(lg.d0[None], params, _ctx())[0]
    builder = ProposalBuilder(fmt, V)
    builder.sample(q, 0.5, int(q.argmax()))
    return decode_proposal(builder.build(), 1, V)[0]


def _draws(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    return torch.rand(n, k + 1, 2, generator=gen, dtype=torch.float64)  # [n, K + 1, 2]


def _wrong_residual(target, drafts, q, num_draft, draws, methods, *rest) -> VerifyOutput:
    """Deliberately wrong: on rejection resample from p instead of (p - q)+."""
    out = speculative_sample(target, drafts, q, num_draft, draws, methods, *rest)
    rows = torch.arange(target.shape[0])
    idx = out.num_accepted
    fixed = out.output_token_ids.clone()
    rejected = idx < num_draft
    resampled = sample_inverse_cdf(target[rows, idx], draws[rows, idx, 1])
    fixed[rows[rejected], idx[rejected]] = resampled[rejected]
    return VerifyOutput(fixed, out.num_accepted, out.num_emitted)


def _two_tokens(p0, p1, q, methods, gen, sampler=speculative_sample, n=N) -> torch.Tensor:
    """n two-token samples -> [n, 2]. p0: [V]; p1: [V, V]; q: [V] the wire proposal."""
    x = torch.multinomial(q / q.sum(), n, replacement=True, generator=gen)  # drafts, sampled from the wire q
    target = torch.stack([p0.expand(n, V), p1[x]], dim=1)  # [n, 2, V]
    out = sampler(target, x[:, None], q.expand(n, 1, V), torch.ones(n, dtype=torch.long), _draws(gen, n, 1), methods,
                  torch.full((n,), 0.09), torch.full((n,), 0.3))
    first = out.output_token_ids[:, 0]
    # Rows that emitted one token: a target-only round (zero drafts) decides the second.
    second_round = speculative_sample(p1[first][:, None], torch.empty(n, 0, dtype=torch.long), None,
                                      torch.zeros(n, dtype=torch.long), _draws(gen, n, 0), methods)
    second = torch.where(out.num_emitted >= 2, out.output_token_ids[:, 1], second_round.output_token_ids[:, 0])
    return torch.stack([first, second], dim=1)


def _pvalue(pairs: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> float:
    counts = collections.Counter(map(tuple, pairs.tolist()))
    exact = {(a, b): float(p0[a] * p1[a, b]) for a in range(V) for b in range(V)}
    return chi_square_pvalue(counts, exact, pairs.shape[0])


RANDOM_MODES = {
    "temperature_0.7": (SamplingParams(temperature=0.7), ProposalFormat(kind=DENSE)),
    "top_k_20": (SamplingParams(top_k=20), ProposalFormat(kind=DENSE)),
    "top_p_0.9": (SamplingParams(top_p=0.9), ProposalFormat(kind=DENSE)),
    "min_p_0.1": (SamplingParams(min_p=0.1), ProposalFormat(kind=DENSE)),
    "penalties": (SamplingParams(repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5),
                  ProposalFormat(kind=DENSE)),
    "sparse_top_8": (SamplingParams(), ProposalFormat(kind=SPARSE, top_n=8)),
    "float16_proposal": (SamplingParams(temperature=1.3), ProposalFormat(kind=DENSE, dtype="float16")),
}


@pytest.mark.parametrize("mode", list(RANDOM_MODES))
def test_two_token_joint_equals_processed_target_distribution(mode):
    params, fmt = RANDOM_MODES[mode]
    lg = _Logits.make(seed=11)
    p0, p1 = _target(params, lg)
    q = _wire_q(params, lg, fmt)
    pairs = _two_tokens(p0, p1, q, ["rejection"] * N, torch.Generator().manual_seed(1))
    assert _pvalue(pairs, p0, p1) > 0.001
    # Power: the wrong residual is rejected at the same sample size.
    wrong = _two_tokens(p0, p1, q, ["rejection"] * N, torch.Generator().manual_seed(1), sampler=_wrong_residual)
    assert _pvalue(wrong, p0, p1) < 0.001


def test_penalties_must_see_the_draft_before_each_position():
    """Power check specific to penalties: a verifier whose p_1 ignores t1 is rejected."""
    params = RANDOM_MODES["penalties"][0]
    lg = _Logits.make(seed=11)
    p0, p1 = _target(params, lg)
    _, p1_blind = _target(params, lg, history_aware=False)
    q = _wire_q(params, lg, ProposalFormat())
    blind = _two_tokens(p0, p1_blind, q, ["rejection"] * N, torch.Generator().manual_seed(2))
    assert _pvalue(blind, p0, p1) < 0.001


def test_greedy_emits_the_argmax_path_whatever_the_drafts():
    """temperature 0: the pair is the deterministic argmax path (with penalties applied)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    lg = _Logits.make(seed=11)
    p0, p1 = _target(params, lg)
    q = torch.softmax(lg.d0, -1)  # random drafts, so both accept and reject happen
    pairs = _two_tokens(p0, p1, q, ["greedy"] * N, torch.Generator().manual_seed(3))
    a = int(p0.argmax())
    assert (pairs[:, 0] == a).all() and (pairs[:, 1] == int(p1[a].argmax())).all()
    # Power: accepting every draft (a wrong greedy rule) breaks the path.
    wrong = _two_tokens(p0, p1, q, ["rejection"] * N, torch.Generator().manual_seed(3))
    assert not (wrong[:, 0] == a).all()


def test_mixed_greedy_and_random_rows_in_one_batch():
    """Even rows greedy, odd rows temperature 0.8, in one call: each follows its own law."""
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)
    lg = _Logits.make(seed=12)
    g0, g1 = _target(greedy, lg)
    r0, r1 = _target(rand, lg)
    q = _wire_q(rand, lg, ProposalFormat())
    n = 2 * N
    is_greedy = torch.arange(n) % 2 == 0
    methods = ["greedy" if g else "rejection" for g in is_greedy.tolist()]
    gen = torch.Generator().manual_seed(4)
    x = torch.multinomial(q, n, replacement=True, generator=gen)
    p0 = torch.where(is_greedy[:, None], g0, r0)  # [n, V]
    p1_of = lambda t: torch.where(is_greedy[:, None], g1[t], r1[t])  # noqa: E731
    target = torch.stack([p0, p1_of(x)], dim=1)
    out = speculative_sample(target, x[:, None], q.expand(n, 1, V), torch.ones(n, dtype=torch.long),
                             _draws(gen, n, 1), methods)
    first = out.output_token_ids[:, 0]
    second_round = speculative_sample(p1_of(first)[:, None], torch.empty(n, 0, dtype=torch.long), None,
                                      torch.zeros(n, dtype=torch.long), _draws(gen, n, 0), methods)
    second = torch.where(out.num_emitted >= 2, out.output_token_ids[:, 1], second_round.output_token_ids[:, 0])
    pairs = torch.stack([first, second], dim=1)
    a = int(g0.argmax())
    assert (pairs[is_greedy, 0] == a).all() and (pairs[is_greedy, 1] == int(g1[a].argmax())).all()
    assert _pvalue(pairs[~is_greedy], r0, r1) > 0.001
    # Power: the random rows are not distributed as the greedy rows' temperature-1 softmax.
    assert _pvalue(pairs[~is_greedy], g0, g1) < 0.001


def test_ragged_flat_layout_matches_padded_rows():
    """Three requests with 2, 0 and 3 drafts in vLLM's flat layout equal three solo calls."""
    gen = torch.Generator().manual_seed(5)
    counts = [2, 0, 3]
    p = [torch.softmax(torch.randn(k + 1, V, generator=gen) * 2, -1) for k in counts]
    q = [torch.softmax(torch.randn(k, V, generator=gen) * 2, -1) for k in counts]
    d = [torch.multinomial(qi, 1, generator=gen)[:, 0] if len(qi) else torch.empty(0, dtype=torch.long) for qi in q]
    draws = [_draws(gen, 1, k)[0] for k in counts]  # [K_i + 1, 2] each
    methods = ["rejection", "rejection", "rejection"]
    flat = speculative_sample_ragged(torch.cat(p), torch.cat(d), torch.tensor(counts).cumsum(0), torch.cat(q),
                                     torch.cat(draws), methods)
    assert flat.output_token_ids.shape == (3, 4)
    for i, k in enumerate(counts):
        solo = speculative_sample(p[i][None], d[i][None], q[i][None], torch.tensor([k]), draws[i][None],
                                  ["rejection"])
        n = int(solo.num_emitted[0])
        assert flat.output_token_ids[i, :n].tolist() == solo.output_token_ids[0, :n].tolist()
        assert (flat.output_token_ids[i, n:] == PLACEHOLDER_TOKEN_ID).all()
        assert int(flat.num_accepted[i]) == int(solo.num_accepted[0]) <= k


def test_seeded_draws_are_independent_of_batch_composition():
    """A request's output depends only on its seed and positions, not on its batch mates."""
    gen = torch.Generator().manual_seed(6)
    k = 3
    p = torch.softmax(torch.randn(3, k + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(3, k, V, generator=gen), -1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(3, k)
    draws = torch.stack([position_uniforms(seed, 2, list(range(40, 40 + k + 1))) for seed in (1, 2, 3)])
    alone = speculative_sample(p[1:2], d[1:2], q[1:2], torch.tensor([k]), draws[1:2], ["rejection"])
    batch = speculative_sample(p, d, q, torch.full((3,), k), draws, ["typical", "rejection", "greedy"],
                               torch.full((3,), 0.09), torch.full((3,), 0.3))
    assert torch.equal(batch.output_token_ids[1], alone.output_token_ids[0])
    reordered = speculative_sample(p[[2, 1, 0]], d[[2, 1, 0]], q[[2, 1, 0]], torch.full((3,), k), draws[[2, 1, 0]],
                                   ["rejection"] * 3)
    assert torch.equal(reordered.output_token_ids[1], alone.output_token_ids[0])


def _entropy(p: list[float]) -> float:
    return -sum(x * math.log(x + 1e-5) for x in p)


def test_typical_acceptance_matches_vllm_definition_by_hand():
    """accept x iff p(x) > min(threshold, alpha * exp(-H(p))), H with vLLM's log(p + 1e-5);
    a rejection emits argmax p; all accepted -> bonus sampled from p."""
    rows = [[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.2, 0.2, 0.6]]
    # Hand computation: thresholds are min(0.09, 0.3 e^{-H}) = 0.09, 0.09, 0.09 here
    # (0.3 e^{-H} = 0.1071, 0.2022, 0.1160).
    for row, expected in zip(rows, [0.1071, 0.2022, 0.1160]):
        assert math.isclose(0.3 * math.exp(-_entropy(row)), expected, abs_tol=1e-4)
    p = torch.tensor([rows + [[0.0, 0.0, 1.0]]])  # [1, 4, 3]: 3 draft positions + bonus
    # Drafts: p=0.2 (> 0.09, accept), p=0.05 (< 0.09, reject -> argmax 0), then never reached.
    out = typical_acceptance_sample(p, torch.tensor([[2, 1, 0]]), torch.tensor([3]), torch.full((1, 4, 2), 0.5))
    assert out.num_accepted.tolist() == [1]
    assert out.output_token_ids.tolist() == [[2, 0, -1, -1]]
    # All accepted: the bonus comes from p at the last row (a point mass on 2 here).
    out = typical_acceptance_sample(p, torch.tensor([[0, 0, 2]]), torch.tensor([3]), torch.full((1, 4, 2), 0.5))
    assert out.output_token_ids.tolist() == [[0, 0, 2, 2]] and out.num_accepted.tolist() == [3]
    # alpha binds when it is small: threshold = 0.1 * e^{-H([0.5,0.3,0.2])} = 0.0357 < 0.05.
    p2 = torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]])
    assert typical_acceptance_sample(p2, torch.tensor([[2]]), torch.tensor([1]), torch.full((1, 2, 2), 0.5),
                                     posterior_threshold=0.25, posterior_alpha=0.1).num_accepted.tolist() == [1]
    assert typical_acceptance_sample(p2, torch.tensor([[2]]), torch.tensor([1]), torch.full((1, 2, 2), 0.5),
                                     posterior_threshold=0.25, posterior_alpha=1.0).num_accepted.tolist() == [0]


def test_penalties_follow_vllm_formulas():
    """repetition divides positive / multiplies negative logits of seen tokens (prompt or
    output); frequency subtracts count * f and presence subtracts p for output tokens only."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    ctx = TokenContext(prefix=[1, 3, 3, 4], prompt_length=1, eos_token_ids=())  # prompt [1]; outputs [3, 3, 4]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties_and_min_tokens(logits, params, ctx, [])
    expected = [2.0, -1.0 * 2.0, 0.5, 1.0 / 2.0 - 2 * 0.5 - 0.25, 3.0 / 2.0 - 1 * 0.5 - 0.25]
    assert torch.allclose(out[0], torch.tensor(expected))


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    ctx = TokenContext(prefix=[9, 9, 9, 5, 6], prompt_length=3, eos_token_ids=(EOS,))  # 2 outputs so far
    params = SamplingParams(min_tokens=4, stop_token_ids=(2,))
    out = apply_penalties_and_min_tokens(torch.zeros(3, 6), params, ctx, [1, 1])
    # Rows decide outputs #3, #4, #5 (1-based): the first two are before min_tokens = 4.
    assert torch.isinf(out[:2, [EOS, 2]]).all() and torch.isfinite(out[2]).all()
    assert torch.isfinite(out[:, [1, 3, 4, 5]]).all()
    ignore = apply_penalties_and_min_tokens(torch.zeros(3, 6), params.replace(ignore_eos=True), ctx, [1, 1])
    assert torch.isfinite(ignore[:, EOS]).all() and torch.isinf(ignore[0, 2])


@pytest.mark.parametrize(
    "field,value",
    [("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("min_tokens", -1),
     ("logprobs", 21), ("acceptance_method", "nope"), ("posterior_threshold", 1.5), ("posterior_alpha", -0.1),
     ("temperature", float("nan")), ("top_p", float("inf")),
     # A Python caller's type slips: each names its field instead of failing later in a comparison.
     ("max_tokens", 1.5), ("max_tokens", True), ("seed", 1.5), ("seed", "7"), ("top_k", 2.0), ("logprobs", "1"),
     ("stop_token_ids", [1.0]), ("stop_token_ids", 5), ("stop", [1])],
)
def test_every_invalid_sampling_parameter_names_its_field(field, value):
    from specdec.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_integer_fields_take_numpy_integers_as_python_ints():
    params = SamplingParams(seed=np.uint64(7), max_tokens=np.int64(4), stop_token_ids=[np.int32(2)])
    assert (params.seed, params.max_tokens, params.stop_token_ids) == (7, 4, (2,))
    assert all(type(v) is int for v in (params.seed, params.max_tokens, *params.stop_token_ids))


def test_greedy_acceptance_method_requires_temperature_zero():
    from specdec.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="acceptance_method"):
        SamplingParams(temperature=0.5, acceptance_method="greedy")
    assert SamplingParams(temperature=0.0, acceptance_method="greedy").method == "greedy"
    assert SamplingParams(temperature=0.0, acceptance_method="typical").method == "greedy"
