"""Unit tests of sampling params, logits processing, proposals and the session store."""

from __future__ import annotations

import collections
import math
import signal
import threading
import time

import pytest
import torch

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound
from specdec.proposals import DENSE, IDS_ONLY, SPARSE, ProposalBuilder, ProposalFormat, decode_proposal
from specdec.sampling import SamplingParams, logits_to_probs, position_uniforms, process_logits, sample_inverse_cdf
from specdec_rpc.adapters import sampling_from_pb, sampling_to_pb
from specdec.sessions import SessionStore
from tests.conftest import chi_square_pvalue


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("temperature", 1e308), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
     ("max_tokens", 0), ("seed", -2**63 - 1), ("seed", 2**64),
     ("stop", ("ok", "\ud800"))],  # a lone surrogate (JSON's "\ud800"): a stop string that never matches
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


@pytest.mark.parametrize("field,value", [
    ("temperature", True), ("temperature", "0.5"), ("ignore_eos", "no"), ("include_stop_str_in_output", None),
    ("stop", 5), ("top_p", float("nan"))])
def test_wrong_types_are_refused_as_value_errors_naming_the_field(field, value):
    """vLLM's SamplingParams raises ValueError: `except ValueError` catches ours too."""
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert isinstance(err.value, InvalidArgument) and err.value.field == field


def test_vllms_none_defaults_and_numpy_scalars_are_taken():
    """Code that forwards vLLM's keyword arguments sends stop, stop_token_ids and logit_bias as
    None; numpy's float32 is a number (its value as float32 is what the wire carries anyway),
    and numpy's bool a flag."""
    import numpy as np

    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None) == SamplingParams()
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None  # vLLM's "up to the context"
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float32(0.9), max_tokens=np.int64(4))
    assert type(params.temperature) is float and params.temperature == 0.5 and params.max_tokens == 4
    assert sampling_from_pb(sampling_to_pb(params)).top_p == params.top_p
    flags = SamplingParams(ignore_eos=np.bool_(True), include_stop_str_in_output=np.bool_(False))
    assert flags.ignore_eos is True and flags.include_stop_str_in_output is False  # a mask's element, as bool


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) and SamplingParams(top_k=-1).top_k == 0


def test_a_negative_seed_is_its_uint64_bit_pattern_as_vllm_takes_int64_seeds():
    assert SamplingParams(seed=-5).seed == 2**64 - 5 and SamplingParams(seed=-2**63).seed == 2**63
    assert SamplingParams(seed=-5) == SamplingParams(seed=2**64 - 5) != SamplingParams(seed=5)


def test_logit_bias_and_allowed_token_ids_are_applied_to_the_raw_logits_as_vllm():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])  # [N=2, V=5]
    before = logits.clone()
    params = SamplingParams(temperature=0.0, logit_bias={0: 10.0, 3: -1.5, 7: 5.0}, allowed_token_ids=[3, 0, 2, 9])
    out = process_logits(logits, params)
    assert torch.equal(logits, before)  # the caller's logits (a view of the model's output) are never written
    expected = torch.tensor([[11.0, -math.inf, 3.0, 0.5, -math.inf], [10.0, -math.inf, 2.0, 1.5, -math.inf]])
    assert torch.allclose(out, torch.softmax(expected, dim=-1))  # ids 7 and 9 are past V: skipped
    sampled = process_logits(logits, params.replace(temperature=2.0))
    assert torch.allclose(sampled, torch.softmax(expected / 2.0, dim=-1))
    # A dict and its pairs are one value: hashable, equal, and they survive the wire.
    assert SamplingParams(logit_bias={3: 1.0, 1: 2.0}) == SamplingParams(logit_bias=[(1, 2.0), (3, 1.0)])
    sent = params.replace(max_tokens=None)  # (max_tokens is the client's: it does not travel)
    assert sampling_from_pb(sampling_to_pb(sent)) == sent and hash(sampling_from_pb(sampling_to_pb(sent))) == hash(sent)
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).allowed_token_ids is None


@pytest.mark.parametrize("temperature", [0.0, 0.01, 0.5, 1.0])
def test_a_bias_near_float32s_maximum_saturates_instead_of_overflowing(temperature):
    """A bias of 3e38 is a valid float32; divided by a temperature below 1 the logit was inf
    and the softmax NaN, and the request failed INTERNAL on both services."""
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    out = process_logits(logits, SamplingParams(temperature=temperature, logit_bias={2: 3e38, 1: -3e38}))
    assert torch.isfinite(out).all() and int(out.argmax()) == 2
    if temperature > 0:  # a distribution: all its mass on the biased token
        assert float(out[0, 2]) == 1.0 and float(out[0, 1]) == 0.0


@pytest.mark.parametrize("field,kwargs", [
    ("logit_bias", {"logit_bias": {-1: 1.0}}), ("logit_bias", {"logit_bias": {1: float("nan")}}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}), ("logit_bias", {"logit_bias": [(1, 1.0), (1, 2.0)]}),
    ("logit_bias", {"logit_bias": 3}), ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [2**31]}), ("allowed_token_ids", {"allowed_token_ids": 5}),
])
def test_invalid_token_filters_name_the_field(field, kwargs):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_top_k_keeps_exactly_k_tokens():
    probs = logits_to_probs(torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]]), SamplingParams(top_k=2))
    assert (probs > 0).nonzero()[:, 1].tolist() == [1, 2]
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingParams(top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    probs = logits_to_probs(logits, SamplingParams(min_p=0.4))
    assert probs[0, 2] == 0 and probs[0, 1] > 0


def test_position_uniforms_depend_only_on_seed_stream_and_position():
    u1 = position_uniforms(7, 2, [10, 11])
    u2 = position_uniforms(7, 2, [11])
    assert u1.shape == (2, 2) and torch.equal(u1[1:], u2)
    assert not torch.equal(u2, position_uniforms(8, 2, [11]))
    assert not torch.equal(u2, position_uniforms(7, 1, [11]))
    assert ((u1 >= 0) & (u1 < 1)).all()


def test_counter_uniforms_are_uniform_and_independent():
    """H0: 40,000 draws (one seed, consecutive positions, both slots) ~ U[0, 1) with
    independent slots: a KS test per slot, and slot correlation near 0."""
    from scipy import stats

    u = position_uniforms(2024, 2, list(range(40_000)))
    for slot in (0, 1):
        assert stats.kstest(u[:, slot].numpy(), "uniform").pvalue > 0.001
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.02
    assert stats.kstest((u[:, 0] * 0.9).numpy(), "uniform").pvalue < 0.001  # power


def test_inverse_cdf_never_returns_a_token_without_mass():
    dist = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    edges = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(dist.expand(5, 5), edges).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("kind,dtype", [(DENSE, "float32"), (DENSE, "float16"), (DENSE, "bfloat16"),
                                        (SPARSE, "float32"), (SPARSE, "float16")])
def test_proposal_round_trip_matches_what_the_drafter_sampled_from(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    v = 50
    probs = torch.softmax(torch.randn(3, v, generator=gen), -1)
    builder = ProposalBuilder(ProposalFormat(kind=kind, dtype=dtype, top_n=8), v)
    tokens = [builder.sample(probs[i], float(torch.rand(1, generator=gen)), int(probs[i].argmax()))
              for i in range(3)]
    q = decode_proposal(builder.build(), 3, v)
    assert q.shape == (3, v)
    for i, t in enumerate(tokens):
        assert q[i, t] > 0  # every draft token has mass under the proposal sent
    if kind == SPARSE:
        assert ((q > 0).sum(-1) <= 8).all()


@pytest.mark.parametrize("kind,dtype", [(DENSE, "float32"), (DENSE, "bfloat16"), (SPARSE, "float32"),
                                        (SPARSE, "float16"), (IDS_ONLY, "float32")])
def test_proposing_rows_at_once_gives_each_row_what_it_gets_alone(kind, dtype):
    """ProposalBuilder.propose_rows (the drafter's stacked rows) against propose row by row on
    the same distributions and draws: the same tokens, the same wire rows (up to the rounding
    of a sum over [R, N] against one over [N]), and each token has mass in its row."""
    gen = torch.Generator().manual_seed(1)
    r, v = 6, 300
    probs = torch.softmax(torch.randn(r, v, generator=gen) * 3, -1)
    u = torch.rand(r, generator=gen, dtype=torch.float64)
    fmt = ProposalFormat(kind=kind, dtype=dtype, top_n=16)
    stacked = [ProposalBuilder(fmt, v) for _ in range(r)]
    tokens = ProposalBuilder.propose_rows(stacked, probs, u, probs.argmax(dim=-1))
    for i in range(r):
        alone = ProposalBuilder(fmt, v)
        assert int(tokens[i]) == int(alone.propose(probs[i], u[i], probs[i].argmax())), i
        stacked[i].commit(int(tokens[i]))
        alone.commit(int(tokens[i]))
        a, b = stacked[i].build(), alone.build()
        assert (a.kind, a.shape, a.token_ids) == (b.kind, b.shape, b.token_ids), i
        if kind != IDS_ONLY:
            qa, qb = decode_proposal(a, 1, v), decode_proposal(b, 1, v)
            assert torch.allclose(qa, qb, rtol=1e-2, atol=1e-6) and float(qa[0, int(tokens[i])]) > 0, i
            if kind == DENSE and dtype == "float32":
                assert a.probs == b.probs
    assert len(set(tokens.tolist())) > 1  # different rows, different draws (power)


def test_sparse_drafts_are_distributed_as_the_sent_proposal():
    """H0: a sparse-proposal draft token ~ the decoded q. N = 20,000, V = 30, top-N 6."""
    gen = torch.Generator().manual_seed(3)
    v, n = 30, 20_000
    probs = torch.softmax(torch.randn(v, generator=gen) * 2, -1)
    counts = collections.Counter()
    builder = ProposalBuilder(ProposalFormat(kind=SPARSE, top_n=6), v)
    for _ in range(n):
        counts[builder.sample(probs, float(torch.rand(1, generator=gen)), 0)] += 1
    q = decode_proposal(builder.build(), n, v)[0]
    q = q / q.sum()
    assert chi_square_pvalue(counts, {t: float(q[t]) for t in range(v)}, n) > 0.001
    assert chi_square_pvalue(counts, {t: float(probs[t]) for t in range(v)}, n) < 0.001  # power


def test_ids_only_proposal_is_the_argmax():
    builder = ProposalBuilder(ProposalFormat(kind=IDS_ONLY), 5)
    assert builder.sample(torch.full((5,), 0.2), 0.5, argmax=3) == 3
    assert decode_proposal(builder.build(), 1, 5) is None


def test_malformed_proposal_bytes_are_invalid_argument():
    builder = ProposalBuilder(ProposalFormat(kind=DENSE), 4)
    builder.sample(torch.full((4,), 0.25), 0.5, 0)
    good = builder.build()
    bad = type(good)(kind=good.kind, dtype=good.dtype, shape=good.shape, probs=good.probs[:-2])
    with pytest.raises(InvalidArgument, match="proposal.probs"):
        decode_proposal(bad, 1, 4)
    with pytest.raises(InvalidArgument, match="proposal.shape"):
        decode_proposal(good, 2, 4)
    with pytest.raises(InvalidArgument, match=r"\[1, V\] with 1 <= V <= 3"):
        decode_proposal(good, 1, 3)  # wider than the verifier's head
    for shape in ((4, 2**62), (16, 2**60), (2, 2**63 - 1), (1, -4)):  # np.prod wrapped the first two to 0 elements
        empty = type(good)(kind=good.kind, dtype=good.dtype, shape=shape, probs=b"")
        with pytest.raises(InvalidArgument, match="proposal"):
            decode_proposal(empty, shape[0], 4)


def test_a_sparse_row_that_repeats_an_id_is_invalid_argument():
    """A sparse row is a top-N set: [5, 5] with 0.5 each has no single q(5) (a hunt sent one)."""
    builder = ProposalBuilder(ProposalFormat(kind=SPARSE, top_n=2), 8)
    builder.sample(torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0]), 0.7, 5)
    good = builder.build()
    assert decode_proposal(good, 1, 8)[0, 5] == pytest.approx(0.5)
    twice = type(good)(kind=good.kind, dtype=good.dtype, shape=good.shape, probs=good.probs,
                       token_ids=torch.tensor([[5, 5]], dtype=torch.int32).numpy().tobytes())
    with pytest.raises(InvalidArgument, match="distinct within a row") as err:
        decode_proposal(twice, 1, 8)
    assert err.value.field == "proposal.token_ids"


def test_a_dense_proposal_of_a_smaller_head_gives_the_ids_past_it_probability_zero():
    """A drafter whose LM head is padded to fewer rows (one tokenizer): its [K, V_d] proposal is
    read as [K, V] with zeros past V_d, and its row sums (which the sampler divides by) unchanged."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 6, generator=gen), -1)
    builder = ProposalBuilder(ProposalFormat(kind=DENSE), 6)
    for i in range(2):
        builder.sample(probs[i], 0.5, int(probs[i].argmax()))
    q = decode_proposal(builder.build(), 2, 9)
    assert q.shape == (2, 9) and torch.equal(q[:, 6:], torch.zeros(2, 3))
    assert torch.allclose(q[:, :6], probs) and torch.allclose(q.sum(-1), torch.ones(2))


def test_a_batchs_sparse_proposals_cross_compact_and_equal_their_dense_rows():
    """The verifier's q [B, K, V] from sparse proposals of different top-N, one-hot (ids-only)
    rows and a greedy row, built from [B, K, N] ids + probs, equals each row's own dense q
    (a dense proposal in the batch takes the dense path; same values), and the row sums are
    the ones each request computed."""
    from types import SimpleNamespace

    from specdec.proposals import decode_draft_q
    from verifier_service.engine import VerifierEngine

    gen = torch.Generator().manual_seed(0)
    v = 40

    def proposal(kind, k, top_n=8):
        builder = ProposalBuilder(ProposalFormat(kind=kind, top_n=top_n), v)
        probs = torch.softmax(torch.randn(k, v, generator=gen) * 3, -1)
        drafts = [builder.sample(probs[i], float(torch.rand(1, generator=gen)), int(probs[i].argmax()))
                  for i in range(k)]
        return SimpleNamespace(q=decode_draft_q(builder.build(), k, v), draft_token_ids=drafts)

    one_hot = SimpleNamespace(q=None, draft_token_ids=[3, 9])
    greedy = SimpleNamespace(q=None, draft_token_ids=[])
    engine = SimpleNamespace(lm=SimpleNamespace(vocab_size=v))
    sparse = [proposal(SPARSE, 4, 8), one_hot, proposal(SPARSE, 3, 2), greedy, proposal(SPARSE, 1, 40)]
    for reqs in (sparse, sparse + [proposal(DENSE, 2)]):
        assert (reqs[0].q.ids is not None) and (reqs[-1].q.ids is None) == (len(reqs) == 6)
        q, q_sums = VerifierEngine._draft_probs(engine, reqs, 4, torch.device("cpu"))
        assert q.shape == (len(reqs), 4, v) and q_sums.shape == (len(reqs), 4)
        for i, r in enumerate(reqs):
            kb = len(r.draft_token_ids)
            if r.q is None:
                expected, sums = torch.zeros(kb, v), torch.ones(kb)
                expected[torch.arange(kb), r.draft_token_ids] = 1.0
            else:
                expected, sums = r.q.dense(v), r.q.sums
            assert torch.equal(q[i, :kb], expected) and torch.equal(q_sums[i, :kb], sums), (i, len(reqs))
            assert bool((q[i, torch.arange(kb), r.draft_token_ids] > 0).all())


class _FakeCache:
    def __init__(self):
        self.length = 0


def _store(**kw):
    def crop(cache, n):
        cache.length = min(cache.length, n)
    return SessionStore(_FakeCache, crop, **kw)


def _open_with_length(store, n):
    """A session whose cache holds n tokens."""
    s = store.open()
    with store.use(s.session_id, 0) as sess:
        sess.cache.length = sess.length = n
    return s


def test_truncate_beyond_length_is_out_of_range_and_session_survives():
    store = _store()
    s = _open_with_length(store, 5)
    with pytest.raises(OutOfRange):
        with store.use(s.session_id, 6):
            pass
    with store.use(s.session_id, 3) as sess:
        assert sess.length == 3 and sess.cache.length == 3


def test_failed_call_restores_truncated_length():
    store = _store()
    s = _open_with_length(store, 8)
    with pytest.raises(RuntimeError):
        with store.use(s.session_id, 4) as sess:
            sess.cache.length = sess.length = 12
            raise RuntimeError("forward failed")
    with store.use(s.session_id, 4) as sess:
        assert sess.length == 4 and sess.cache.length == 4


def test_concurrent_use_of_one_session_is_refused():
    store = _store()
    s = store.open()
    with store.use(s.session_id, 0):
        with pytest.raises(SessionBusy):
            with store.use(s.session_id, 0):
                pass


def test_session_cap_ttl_and_unknown_ids():
    now = [0.0]
    store = _store(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    a = store.open()
    now[0] = 1.0
    b = store.open()
    now[0] = 2.0
    with store.use(a.session_id, 0), store.use(b.session_id, 0):  # both have a call in flight
        with pytest.raises(ResourceExhausted, match="call in flight"):
            store.open()
    now[0] = 3.0
    with store.use(b.session_id, 0):
        pass  # b is now the most recently used
    # a's last call ended 1 s ago: a generation between rounds, not evicted (the new one queues)
    with pytest.raises(ResourceExhausted, match="was opened or had a call within 2 s; retry later"):
        store.open()
    now[0] = 4.5  # a idle 2.5 s, b 1.5 s: a is evicted to admit c
    store.open()
    assert len(store) == 2 and store.evictions == 1
    with pytest.raises(SessionNotFound, match="evicted"):
        with store.use(a.session_id, 0):
            pass
    now[0] = 15.0
    assert store.expire_idle() == 2 and len(store) == 0
    with pytest.raises(SessionNotFound, match="expired"):
        with store.use(b.session_id, 0):
            pass
    with pytest.raises(SessionNotFound, match="unknown"):
        store.close("nope")


def test_kv_budget_evicts_least_recently_used_and_refuses_oversized_sessions():
    now = [0.0]
    store = SessionStore(_FakeCache, lambda c, n: None, kv_budget_bytes=250, cache_bytes=lambda c: 100,
                         clock=lambda: now[0])
    first = store.open()
    now[0] = 1.0
    store.open()
    now[0] = 2.0
    store.open()  # 300 > 250: the least recently used (first) makes room
    assert len(store) == 2 and store.kv_bytes() == 200 and store.evictions == 1
    with pytest.raises(SessionNotFound, match="evicted"):
        store.close(first.session_id)
    tiny = SessionStore(_FakeCache, lambda c, n: None, kv_budget_bytes=50, cache_bytes=lambda c: 100)
    with pytest.raises(ResourceExhausted, match="kv-budget-mb"):
        tiny.open()


def test_a_full_slot_pool_hands_a_waiting_open_the_slot_a_finishing_call_returns():
    """A session closed while its call is in flight keeps its KV slot until that call ends (its
    last reference). A new session's open on a full server (acquire with a wait) gets the slot
    once it returns, also when only a garbage collection frees it (a reference cycle, as a
    traceback's frames make); without a wait, or past it, the refusal names what holds them."""
    import gc

    from specdec.slot_forward import SlotPool

    pool = SlotPool(1, num_layers=1, num_kv_heads=1, max_len=4, head_dim=2, dtype=torch.float32, device="cpu")
    held = [pool.acquire()]
    with pytest.raises(ResourceExhausted, match="closed sessions whose calls have not ended yet"):
        pool.acquire()
    threading.Timer(0.2, held.clear).start()  # the in-flight call ends
    slot = pool.acquire(wait_s=10)
    assert slot.index == 0 and pool.free_slots == 0
    gc.disable()  # only acquire's own collection may free it
    try:
        cycle: dict = {"slot": slot}
        cycle["cycle"] = cycle
        del slot, cycle
        assert pool.free_slots == 0
        assert pool.acquire(wait_s=10).index == 0
    finally:
        gc.enable()
    kept = pool.acquire(wait_s=10)
    start = time.monotonic()
    with pytest.raises(ResourceExhausted):
        pool.acquire(wait_s=0.3)
    assert time.monotonic() - start >= 0.3 and kept.index == 0


def test_concurrent_opens_into_a_full_store_each_evict_an_idle_session_from_a_pool_of_cap_plus_one():
    """A slot pool holds max_sessions + 1 slots (the fast path's): a slot frees when its last
    reference dies, as SlotPool's do. With the store full of idle sessions, 4 opens at once must
    each evict one and be admitted; each takes its slot a moment before it is admitted, which
    is the window where another open found the pool empty."""
    import weakref

    free = [0, 1, 2, 3]  # max_sessions 3, + 1

    class Slot:
        pass

    def acquire():
        if not free:
            raise ResourceExhausted("all KV slots of the pool are in use")
        slot = Slot()
        weakref.finalize(slot, free.append, free.pop(0))
        time.sleep(0.05)  # the window between taking a slot and admitting the session
        return slot

    store = SessionStore(acquire, lambda c, n: None, max_sessions=3, evict_after_idle_s=0.0)
    old = [store.open() for _ in range(3)]
    del old
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(_try(store.open))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [type(r).__name__ for r in results] == ["Session"] * 4, results
    results.clear()  # the fourth eviction's victim was one of these: its slot frees with it
    assert len(store) == 3 and store.evictions == 4 and len(free) == 1


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test reports what each thread got
        return exc


def test_batched_counter_draws_equal_per_row_draws_and_are_uniform():
    """The verifier draws a whole step at once: counter_uniforms over [B] seeds and [B, K + 1]
    positions. Each row equals that request's own position_uniforms (a seed reproduces whatever
    its batch mates), and H0: the 2,000 x 5 x 2 draws ~ U[0, 1), chi-square over 20 bins; a
    0.95-scaled copy must be rejected (power)."""
    from scipy import stats

    from specdec.sampling import counter_uniforms, seed_tensor

    seeds = [(2**64 - 1 - 7919 * i) if i % 2 else 31 * i for i in range(2000)]  # both halves of uint64
    first = torch.randint(0, 4000, (2000,), generator=torch.Generator().manual_seed(0))
    u = counter_uniforms(seed_tensor(seeds), 2, first[:, None] + torch.arange(5)[None, :])  # [2000, 5, 2]
    for i in (0, 1, 999, 1999):
        assert torch.equal(u[i], position_uniforms(seeds[i], 2, list(range(int(first[i]), int(first[i]) + 5))))
    counts = torch.histc(u.flatten().float(), bins=20, min=0, max=1).numpy()
    assert stats.chisquare(counts).pvalue > 0.001
    biased = torch.histc((u.flatten() * 0.95).float(), bins=20, min=0, max=1).numpy()
    assert stats.chisquare(biased).pvalue < 0.001


def test_an_engine_thread_that_stops_fails_every_request_at_once_and_says_so():
    """An error outside a batch (here the batching wait's `expected` callback; in the field,
    `--max-wait-ms inf` overflowing queue.get) ended the engine thread silently: the
    requests it held and every later one waited for ever, and the server answered health
    checks SERVING. Now they fail with EngineStopped (UNAVAILABLE: a client tries another
    replica), `stopped` is set, and run_until_signal drains and returns exit status 1."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from specdec.batching import BatchPolicy, BatchScheduler
    from specdec.errors import EngineStopped
    from specdec_rpc.adapters import STATUS_OF, run_until_signal

    calls = []

    def expected() -> int:
        calls.append(1)
        raise OverflowError("timestamp out of range for platform time_t")

    def run_batch(items):
        for it in items:
            it.future.set_result(it.payload)

    sched = BatchScheduler(run_batch, BatchPolicy(max_batch_size=8, max_wait_ms=50), expected=expected)
    assert [f.result(10) for f in sched.submit_many([1, 2])] == [1, 2]  # the first batch waits for nothing
    held = sched.submit_many([3, 4])  # a batch of 2 came before: this one waits, and `expected` fails
    assert sched.stopped.wait(10) and calls
    for f in held + sched.submit_many([5]):
        with pytest.raises(EngineStopped, match="OverflowError"):
            f.result(10)
    assert STATUS_OF[EngineStopped] == grpc.StatusCode.UNAVAILABLE
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert run_until_signal(server, 0.1, sched.stopped) == 1  # returns at once: the engine stopped before
    finally:  # it installs the service's handlers: give pytest its Ctrl-C back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("cap", [1, 4])
def test_carried_rows_and_new_arrivals_never_exceed_the_batch_size(cap):
    """Rows that stay in the batch (decode_steps rounds, prompt chunks) open the next batch and
    new items join only up to --max-batch-size: each step took one more queued item beside a
    full carried batch, and that one was carried too (batches of 4, 5, 6, 7 at a cap of 4). A
    full carried batch then stopped the engine (read as the shutdown marker) at a cap of 1."""
    from specdec.batching import BatchPolicy, BatchScheduler

    sizes: list[int] = []
    steps_left: dict[int, int] = {}

    def run_batch(items):
        sizes.append(len(items))
        carried = []
        for it in items:
            steps_left[it.payload] = steps_left.get(it.payload, 4) - 1
            if steps_left[it.payload]:
                carried.append(it)
            else:
                it.future.set_result(it.payload)
        return carried

    sched = BatchScheduler(run_batch, BatchPolicy(max_batch_size=cap, max_wait_ms=0))
    try:
        assert sorted(f.result(10) for f in sched.submit_many(list(range(10)))) == list(range(10))
        assert not sched.stopped.is_set()
    finally:
        sched.shutdown()
    assert max(sizes) == cap and sum(sizes) == 40, sizes  # every item ran its 4 steps, never more than cap at once


def test_the_engine_waits_for_unary_stragglers_but_not_for_a_clients_step_message():
    """After a batch of several, a lone unary call waits (max_wait_ms) for the other running
    sessions' calls to share its step; a row of a client's step message (VerifyBatch /
    VerifyStream: `gathered`) waits at most a tenth of the last step (here ~0: the steps are
    instant), since that client sends its other rows after its turnaround."""
    from specdec.batching import BatchPolicy, BatchScheduler

    batches: list[list[str]] = []
    gate = threading.Event()

    def run_batch(items):
        batches.append([it.payload for it in items])
        if items[0].payload == "gate":
            gate.wait(10)
        for it in items:
            it.future.set_result(it.payload)

    sched = BatchScheduler(run_batch, BatchPolicy(max_batch_size=8, max_wait_ms=1000), expected=lambda: 8)
    try:
        def step(first: str, second: str, gathered: bool) -> None:
            gate.clear()
            held = sched.submit_many(["gate"], gathered=True)
            while ["gate"] not in batches[-1:]:
                time.sleep(0.01)
            # Queued together behind the gate: one batch of 2, after which the wait applies.
            for f in held + sched.submit_many(["warm-1", "warm-2"], gathered=True):
                gate.set()
                f.result(10)
            assert batches[-1] == ["warm-1", "warm-2"]
            futures = sched.submit_many([first], gathered=gathered)
            time.sleep(0.2)  # well inside the 1 s wait
            futures += sched.submit_many([second], gathered=gathered)
            for f in futures:
                f.result(10)

        step("unary-a", "unary-b", gathered=False)
        step("step-a", "step-b", gathered=True)
    finally:
        sched.shutdown()
    assert ["unary-a", "unary-b"] in batches  # the lone call waited for the next one
    assert ["step-a"] in batches and ["step-b"] in batches  # the message's row went at once


def test_max_model_len_above_the_models_positions_serves_the_model_and_says_so(caplog):
    """--max-model-len above max_position_embeddings serves the model's positions with a
    warning naming both (vLLM refuses it outright); below, it is the context as asked."""
    from types import SimpleNamespace

    from specdec.models import ModelSpec, _max_context

    config = SimpleNamespace(max_position_embeddings=1024)
    with caplog.at_level("WARNING", logger="specdec.models"):
        assert _max_context(config, ModelSpec(max_model_len=512)) == 512
        assert not caplog.records
        assert _max_context(config, ModelSpec(max_model_len=4096)) == 1024
    assert "--max-model-len 4096 is above the model's 1024 positions" in caplog.text


def test_engines_share_a_device_on_cpus_or_one_gpu_uuid():
    """The client overlaps a drafter's prefill with the verifier's first round only on separate
    devices: two processes on one GPU time-slice it, as two on one host share its cores."""
    from client.speculative import shares_device
    from specdec.serving import ModelInfo

    def info(device: str, uuid: str = "") -> ModelInfo:
        return ModelInfo(role="r", model="m", vocab_size=8, eos_token_ids=(0,), max_context=64,
                         tokenizer_fingerprint="f", tokenizer_source="s", dtype="float32", device=device,
                         max_draft_tokens=4, device_uuid=uuid)

    gpu_a, gpu_b = "GPU-0c3e0f2a-aaaa", "GPU-7d1b9e44-bbbb"
    assert shares_device(info("cpu"), info("cpu"))
    assert shares_device(info("cuda", gpu_a), info("cuda:0", gpu_a))  # the index may differ per process
    assert not shares_device(info("cuda", gpu_a), info("cuda", gpu_b))
    assert not shares_device(info("cuda", gpu_a), info("cpu"))
    assert not shares_device(info("cuda"), info("cuda"))  # a server before device_uuid: not known to share
    assert not shares_device(None, info("cpu"))  # no drafter
    # Adaptive γ's own cap (as the verifier's CPU default) applies where they time-slice a GPU only.
    from client.speculative import SHARED_GPU_DISABLE_BY_BATCH_SIZE, shared_gpu_cap

    assert shared_gpu_cap(info("cuda", gpu_a), info("cuda:0", gpu_a)) == SHARED_GPU_DISABLE_BY_BATCH_SIZE
    assert shared_gpu_cap(info("cuda", gpu_a), info("cuda", gpu_b)) == 0
    assert shared_gpu_cap(info("cpu"), info("cpu")) == 0 and shared_gpu_cap(None, info("cuda", gpu_a)) == 0
    from specdec_rpc.adapters import model_info_from_pb, model_info_to_pb

    assert model_info_from_pb(model_info_to_pb(info("cuda", gpu_a))) == info("cuda", gpu_a)  # on the wire too


def test_a_local_model_folders_tokenizer_source_is_absolute(tmp_path, monkeypatch):
    """A service started with a relative --model told clients to load the tokenizer from that
    relative path: a client running from another directory then looked for a hub id of that
    name. A folder is sent as its absolute path; a hub id and the embedded model as given."""
    from specdec.models import EMBEDDED, ModelSpec, tokenizer_source

    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    assert tokenizer_source(ModelSpec(model="tiny")) == str((tmp_path / "tiny").resolve())
    (tmp_path / "tiny" / "m.gguf").write_bytes(b"")  # a GGUF file given by its relative path: the same
    assert tokenizer_source(ModelSpec(model="tiny/m.gguf")) == str((tmp_path / "tiny" / "m.gguf").resolve())
    assert tokenizer_source(ModelSpec(model="HuggingFaceTB/SmolLM2-135M-Instruct")) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert tokenizer_source(ModelSpec()) == EMBEDDED


def test_list_flags_take_vllms_json_lists_or_commas():
    """--allowed-origins and its kin: vLLM takes a JSON list ('[]' allows none); a comma-separated
    list reads better in an environment variable. Empty entries are refused by name."""
    import argparse

    from specdec.argtypes import string_list

    parse = string_list("--allowed-origins")
    assert parse('["https://a.example", "https://b.example"]') == ("https://a.example", "https://b.example")
    assert parse("https://a.example, https://b.example") == ("https://a.example", "https://b.example")
    assert parse("[]") == () and parse("*") == ("*",)
    for bad in ("a,,b", "[1]", '[""]', "[x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--allowed-origins"):
            parse(bad)
