"""Losslessness on the real model: the first two generated tokens of speculative sampling
follow the target's exact distribution (pure sampler on the real logits, >= 5,000 samples)."""

from __future__ import annotations

import collections

import pytest
import torch

from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verification import rejection_sample
from tests.conftest import chi_square_pvalue
from tests.test_verification import _wrong_sampler

PROMPT = "My favourite animal is the"
N = 5_000
PARAMS = SamplingParams(temperature=1.0)


class _Dists:
    """Processed next-token distributions of target (p) and drafter (q) after prompt + prefix,
    computed in batches and cached."""

    def __init__(self, target, drafter, prompt_ids):
        self.target, self.drafter, self.prompt = target, drafter, prompt_ids
        self.p, self.q = {}, {}

    def fill(self, prefixes):
        todo = sorted({tuple(x) for x in prefixes} - self.p.keys())
        for i in range(0, len(todo), 64):
            chunk = todo[i : i + 64]
            ids = torch.tensor([self.prompt + list(pre) for pre in chunk])
            with torch.inference_mode():
                lp = self.target.model(ids, logits_to_keep=1).logits[:, -1].float()
                lq = self.drafter.model(ids, logits_to_keep=1).logits[:, -1].float()
            for pre, a, b in zip(chunk, logits_to_probs(lp, PARAMS), logits_to_probs(lq, PARAMS)):
                self.p[pre], self.q[pre] = a, b


def _two_tokens(d: _Dists, gen: torch.Generator, sampler, n: int = N) -> collections.Counter:
    """Simulate speculative decoding of two tokens, gamma = 2, n times."""
    d.fill([()])
    x1 = torch.multinomial(d.q[()], n, replacement=True, generator=gen)
    d.fill([(int(a),) for a in x1])
    x2 = torch.stack([torch.multinomial(d.q[(int(a),)], 1, generator=gen)[0] for a in x1])
    pairs = collections.Counter()
    pending = []  # rows that emitted one token: a second round decides token 2
    for s in range(0, n, 500):
        rows = range(s, min(s + 500, n))
        p = torch.stack([torch.stack([d.p[()], d.p[(int(x1[i]),)], d.p[()]]) for i in rows])  # [b, 3, V]
        q = torch.stack([torch.stack([d.q[()], d.q[(int(x1[i]),)]]) for i in rows])  # [b, 2, V]
        drafts = torch.stack([x1[s : s + len(rows)], x2[s : s + len(rows)]], 1)
        draws = torch.rand(len(rows), 3, 2, generator=gen, dtype=torch.float64)
        out = sampler(p, drafts, q, torch.full((len(rows),), 2), draws)
        for r in range(len(rows)):
            toks = out.output_token_ids[r].tolist()
            if out.num_emitted[r] >= 2:
                pairs[(toks[0], toks[1])] += 1
            else:
                pending.append(toks[0])
    d.fill([(a,) for a in pending])
    for a in pending:  # round 2: gamma = 1 from prompt + [a]
        qa, pa = d.q[(a,)], d.p[(a,)]
        x = torch.multinomial(qa, 1, generator=gen)
        draws = torch.rand(1, 2, 2, generator=gen, dtype=torch.float64)
        out = sampler(torch.stack([pa, pa])[None], x[None], qa[None, None], torch.tensor([1]), draws)
        pairs[(a, int(out.output_token_ids[0, 0]))] += 1
    return pairs


@pytest.fixture(scope="module")
def dists(target_lm, int8_lm):
    prompt_ids = target_lm.tokenizer(PROMPT, add_special_tokens=False).input_ids
    return _Dists(target_lm, int8_lm, prompt_ids)


def _expected_pairs(d: _Dists) -> dict:
    top = torch.topk(d.p[()], 40).indices.tolist()
    d.fill([(a,) for a in top])
    out = {}
    for a in top:
        pa = float(d.p[()][a])
        cond = d.p[(a,)]
        for b in torch.nonzero(cond * pa * N >= 5).flatten().tolist():
            out[(a, b)] = pa * float(cond[b])
    return out


def test_first_two_tokens_follow_target_distribution(dists):
    """H0: (token1, token2) ~ p(t1) p(t2 | t1). N = 5,000, temperature 1, int8 drafter
    (acceptance ~0.5, so both the accept and the residual paths are exercised)."""
    gen = torch.Generator().manual_seed(99)
    pairs = _two_tokens(dists, gen, rejection_sample)
    assert sum(pairs.values()) == N
    expected = _expected_pairs(dists)
    assert len(expected) >= 10  # enough cells for a meaningful test
    assert chi_square_pvalue(pairs, expected, N) > 0.001


def test_wrong_residual_is_detected_with_the_same_samples(dists):
    """Power check: resampling from p instead of (p - q)+ on rejection is rejected at 0.001."""
    gen = torch.Generator().manual_seed(99)
    pairs = _two_tokens(dists, gen, _wrong_sampler)
    assert chi_square_pvalue(pairs, _expected_pairs(dists), N) < 0.001


def test_the_pair_disagrees_enough_to_exercise_rejections(dists):
    dists.fill([()])
    p, q = dists.p[()], dists.q[()]
    assert 0.5 * float((p - q).abs().sum()) > 0.05  # total variation: rejections happen


class _SyntheticDists:
    """Small-vocabulary stand-in with the same interface, for an exact joint check."""

    def __init__(self, v: int, gen: torch.Generator):
        class _M:
            vocab_size = v

        self.target = _M()
        self.p = {(): torch.softmax(torch.randn(v, generator=gen) * 2, -1)}
        self.q = {(): torch.softmax(torch.randn(v, generator=gen) * 2, -1)}
        for a in range(v):
            self.p[(a,)] = torch.softmax(torch.randn(v, generator=gen) * 2, -1)
            self.q[(a,)] = torch.softmax(torch.randn(v, generator=gen) * 2, -1)

    def fill(self, prefixes):
        pass


def test_two_token_process_is_exact_on_synthetic_distributions():
    """H0: (t1, t2) ~ p(t1) p(t2 | t1) over all 36 cells (V = 6), N = 30,000, seed 3."""
    d = _SyntheticDists(6, torch.Generator().manual_seed(5))
    pairs = _two_tokens(d, torch.Generator().manual_seed(3), rejection_sample, n=30_000)
    wrong = _two_tokens(d, torch.Generator().manual_seed(3), _wrong_sampler, n=30_000)
    exact = {(a, b): float(d.p[()][a] * d.p[(a,)][b]) for a in range(6) for b in range(6)}
    assert chi_square_pvalue(pairs, exact, 30_000) > 0.001
    assert chi_square_pvalue(wrong, exact, 30_000) < 0.001
