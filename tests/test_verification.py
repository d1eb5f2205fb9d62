"""Unit tests of the pure verification math (synthetic distributions, no model)."""

from __future__ import annotations

import collections

import pytest
import torch

from specdec.sampling import sample_inverse_cdf
from specdec.verification import PLACEHOLDER_TOKEN_ID, greedy_verify, rejection_sample
from tests.conftest import chi_square_pvalue


def _draws(gen: torch.Generator, b: int, k: int) -> torch.Tensor:
    """[b, k + 1, 2] float64 uniforms: acceptance draws and token picks."""
    return torch.rand(b, k + 1, 2, generator=gen, dtype=torch.float64)


def _fixed(accept_u: list[float], pick_u: list[float]) -> torch.Tensor:
    """Hand-set draws for one row: [1, K + 1, 2]."""
    return torch.tensor([list(zip(accept_u + [0.0], pick_u))], dtype=torch.float64)


def test_greedy_accepts_matching_prefix_then_emits_target_token():
    target_argmax = torch.tensor([[3, 5, 7, 9], [3, 5, 7, 9]])
    drafts = torch.tensor([[3, 5, 8], [3, 5, 7]])
    out = greedy_verify(target_argmax, drafts, torch.tensor([3, 3]))
    assert out.num_accepted.tolist() == [2, 3]
    assert out.output_token_ids.tolist() == [[3, 5, 7, PLACEHOLDER_TOKEN_ID], [3, 5, 7, 9]]
    assert out.num_emitted.tolist() == [3, 4]


def test_greedy_ragged_rows_stop_at_their_own_draft_count():
    target_argmax = torch.tensor([[1, 2, 3], [1, 2, 3]])
    drafts = torch.tensor([[1, -1], [1, 2]])
    out = greedy_verify(target_argmax, drafts, torch.tensor([1, 0]))
    # Row 0 accepts its single draft and takes the bonus at index 1; row 1 has no drafts.
    assert out.output_token_ids.tolist() == [[1, 2, -1], [1, -1, -1]]
    assert out.num_accepted.tolist() == [1, 0]


def test_rejection_accepts_when_u_times_q_below_p_without_division():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # [1, 2, 3]
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # draft token 0 with q=1, p=0.5
    accept = rejection_sample(p, torch.tensor([[0]]), q, torch.tensor([1]), _fixed([0.49], [0.5, 0.5]))
    reject = rejection_sample(p, torch.tensor([[0]]), q, torch.tensor([1]), _fixed([0.51], [0.5, 0.5]))
    assert accept.output_token_ids.tolist() == [[0, 2]]  # bonus from p at the next position
    # Rejected: the residual (p - q)+ is all on token 1.
    assert reject.output_token_ids.tolist() == [[1, -1]]
    assert reject.num_accepted.tolist() == [0]


def test_draft_with_zero_target_probability_is_always_rejected():
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    q = torch.tensor([[[1.0, 0.0]]])
    out = rejection_sample(p, torch.tensor([[0]]), q, torch.tensor([1]), _fixed([0.0], [0.5, 0.5]))
    assert out.num_accepted.tolist() == [0]
    assert out.output_token_ids[0, 0].item() == 1


def _random_dists(gen, b, k, v, sharp=3.0):
    return torch.softmax(torch.randn(b, k, v, generator=gen) * sharp, dim=-1)


def _simulate(p_rows, q_rows, n, gen, sampler=rejection_sample, ids_only=False):
    """Draw n one-round samples for a fixed context: returns counts of the first emitted token
    and of the (first, second) pair when two are emitted. p_rows: [K+1, V], q_rows: [K, V]."""
    k, v = q_rows.shape
    q = q_rows.expand(n, k, v)
    drafts = q_rows.argmax(-1).expand(n, k) if ids_only else torch.multinomial(
        q.reshape(-1, v), 1, generator=gen).reshape(n, k)
    out = sampler(p_rows.expand(n, k + 1, v), drafts, None if ids_only else q, torch.full((n,), k), _draws(gen, n, k))
    return collections.Counter(out.output_token_ids[:, 0].tolist())


def _wrong_sampler(p, drafts, q, num_draft, draws):
    """Deliberately wrong: on rejection resample from p instead of (p - q)+."""
    out = rejection_sample(p, drafts, q, num_draft, draws)
    rows = torch.arange(p.shape[0])
    idx = out.num_accepted
    wrong = sample_inverse_cdf(p[rows, idx], draws[rows, idx, 1])
    fixed = out.output_token_ids.clone()
    rejected = idx < num_draft
    fixed[rows[rejected], idx[rejected]] = wrong[rejected]
    return type(out)(fixed, out.num_accepted, out.num_emitted)


@pytest.mark.parametrize("ids_only", [False, True], ids=["dense_q", "one_hot_q"])
def test_first_token_follows_target_distribution(ids_only):
    """H0: the first emitted token ~ p_1. N = 40,000 samples, V = 12, chi-square, seed 0."""
    gen = torch.Generator().manual_seed(0)
    v, k, n = 12, 3, 40_000
    p = _random_dists(gen, 1, k + 1, v)[0]
    q = _random_dists(gen, 1, k, v)[0]
    counts = _simulate(p, q, n, gen, ids_only=ids_only)
    expected = {t: float(p[0, t]) for t in range(v)}
    assert chi_square_pvalue(counts, expected, n) > 0.001
    # Power: the same test rejects the drafter's own distribution and a wrong sampler.
    if not ids_only:
        assert chi_square_pvalue(counts, {t: float(q[0, t]) for t in range(v)}, n) < 0.001
    wrong = _simulate(p, q, n, gen, sampler=_wrong_sampler, ids_only=ids_only)
    assert chi_square_pvalue(wrong, expected, n) < 0.001


def test_batch_rows_are_independent_of_each_other():
    """Rows with different distributions in one ragged batch each follow their own p."""
    gen = torch.Generator().manual_seed(1)
    v, k, n = 8, 2, 20_000
    p = _random_dists(gen, 2, k + 1, v)
    q = _random_dists(gen, 2, k, v)
    rows = torch.arange(2 * n) % 2  # interleave two requests
    pp, qq = p[rows], q[rows]
    drafts = torch.multinomial(qq.reshape(-1, v), 1, generator=gen).reshape(2 * n, k)
    num_draft = torch.where(rows == 0, 2, 1)
    drafts[:, 1] = torch.where(rows == 0, drafts[:, 1], -1)
    out = rejection_sample(pp, drafts, qq, num_draft, _draws(gen, 2 * n, k))
    assert (out.num_accepted <= num_draft).all()
    for r in range(2):
        first = collections.Counter(out.output_token_ids[rows == r, 0].tolist())
        assert chi_square_pvalue(first, {t: float(p[r, 0, t]) for t in range(v)}, n) > 0.001
