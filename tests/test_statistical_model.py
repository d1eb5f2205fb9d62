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
    """Processed next-token distributions of target (p) and drafter (q) after prompt + prefix
    (a prefix holds at most one token), computed in batches over the prompt's KV cache and
    cached; `rows` turns prefixes into row indices of the stacked `P`, `Q` [K, V]."""

    def __init__(self, target, drafter, prompt_ids):
        self.target, self.drafter, self.prompt = target, drafter, prompt_ids
        self.p, self.q = {}, {}
        self._index: dict = {}
        self.P = self.Q = torch.empty(0)

    def fill(self, prefixes):
        todo = sorted({tuple(x) for x in prefixes} - self.p.keys())
        assert all(len(pre) <= 1 for pre in todo)
        for i in range(0, len(todo), 256):
            chunk = todo[i : i + 256]
            lp, lq = self._next_logits(self.target, chunk), self._next_logits(self.drafter, chunk)
            for pre, a, b in zip(chunk, logits_to_probs(lp, PARAMS), logits_to_probs(lq, PARAMS)):
                self.p[pre], self.q[pre] = a, b

    def _next_logits(self, lm, chunk) -> torch.Tensor:
        """[len(chunk), V] logits after prompt + each prefix: the prompt runs once, then each
        one-token prefix is one query over a copy of the prompt's cache."""
        with torch.inference_mode():
            prompt = lm.model(torch.tensor([self.prompt]), use_cache=True)
            out = prompt.logits[:, -1].float().repeat(len(chunk), 1)  # the empty prefix's rows
            ones = [i for i, pre in enumerate(chunk) if pre]
            if ones:
                cache = prompt.past_key_values
                cache.batch_repeat_interleave(len(ones))
                tokens = torch.tensor([[chunk[i][0]] for i in ones])
                out[ones] = lm.model(tokens, past_key_values=cache).logits[:, -1].float()
            return out

    def rows(self, prefixes) -> torch.Tensor:
        """Row indices of `prefixes` in P and Q, stacking the rows filled since the last call
        (dicts keep insertion order)."""
        new = list(self.p)[len(self._index) :]
        if new:
            self._index.update({k: len(self._index) + i for i, k in enumerate(new)})
            self.P = torch.cat([self.P, torch.stack([self.p[k] for k in new])])
            self.Q = torch.cat([self.Q, torch.stack([self.q[k] for k in new])])
        return torch.tensor([self._index[pre] for pre in prefixes])


def _draw(dists: torch.Tensor, rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token from each row dists[rows[i]] ([K, V], [n]) by inverse CDF, 500 rows at a time
    (torch.multinomial costs ~1 ms a row over V = 49,152; it took most of the test's time)."""
    out = []
    for s in range(0, len(rows), 500):
        cdf = dists[rows[s : s + 500]].double().cumsum(-1)  # [b, V]
        u = torch.rand(len(cdf), 1, generator=gen, dtype=torch.float64)
        out.append(torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0])  # the first i with cdf[i] > u
    return torch.cat(out)


def _two_tokens(d: _Dists, gen: torch.Generator, sampler, n: int = N) -> collections.Counter:
    """Simulate speculative decoding of two tokens, gamma = 2, n times."""
    d.fill([()])
    x1 = torch.multinomial(d.q[()], n, replacement=True, generator=gen)
    d.fill([(a,) for a in x1.tolist()])
    empty, after_x1 = d.rows([()])[0], d.rows([(a,) for a in x1.tolist()])
    x2 = _draw(d.Q, after_x1, gen)
    pairs = collections.Counter()
    pending = []  # rows that emitted one token: a second round decides token 2
    for s in range(0, n, 500):
        b = min(500, n - s)
        first = after_x1[s : s + b]
        p = d.P[torch.stack([empty.expand(b), first, empty.expand(b)], 1)]  # [b, 3, V]
        q = d.Q[torch.stack([empty.expand(b), first], 1)]  # [b, 2, V]
        drafts = torch.stack([x1[s : s + b], x2[s : s + b]], 1)
        draws = torch.rand(b, 3, 2, generator=gen, dtype=torch.float64)
        out = sampler(p, drafts, q, torch.full((b,), 2), draws)
        for toks, emitted in zip(out.output_token_ids.tolist(), out.num_emitted.tolist()):
            if emitted >= 2:
                pairs[(toks[0], toks[1])] += 1
            else:
                pending.append(toks[0])
    d.fill([(a,) for a in pending])
    after_a = d.rows([(a,) for a in pending])
    x = _draw(d.Q, after_a, gen)
    for s in range(0, len(pending), 500):  # round 2: gamma = 1 from prompt + [a]
        idx = after_a[s : s + 500]
        p, q = d.P[torch.stack([idx, idx], 1)], d.Q[idx][:, None]  # [b, 2, V], [b, 1, V]
        draws = torch.rand(len(idx), 2, 2, generator=gen, dtype=torch.float64)
        out = sampler(p, x[s : s + len(idx), None], q, torch.ones(len(idx), dtype=torch.long), draws)
        for a, t in zip(pending[s : s + 500], out.output_token_ids[:, 0].tolist()):
            pairs[(a, t)] += 1
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


class _SyntheticDists(_Dists):
    """Small-vocabulary stand-in with the same interface, for an exact joint check."""

    def __init__(self, v: int, gen: torch.Generator):
        super().__init__(None, None, [])
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
