"""Continuous batching and the session lifecycle: the slot forward, real servers, real model."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import threading
import time

import grpc
import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from client.launcher import start_service
from specdec.models import Row
from specdec.sampling import SamplingParams
from specdec.slot_forward import SlotForward, check_matches_reference, rms_norm, rotate, signed_sin
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from tests.conftest import rss_mb, target_only_outputs

PROMPTS = [
    "The capital of France is", "def add(a, b):", "Once upon a time", "The best way to learn is",
    "Water boils at", "My favourite book is", "In the year 2050,", "The recipe needs",
]


def test_slot_forward_matches_transformers_prefill_and_incremental(target_lm):
    ids = target_lm.tokenizer("Speculative decoding drafts tokens and verifies them in one pass.",
                              add_special_tokens=False).input_ids
    assert check_matches_reference(target_lm.model, target_lm.slots, ids, atol=1e-4) < 1e-4
    slot = target_lm.slots.new_slot()
    head = target_lm.slots.forward([Row(slot, ids[:4], 4)])
    tail = target_lm.slots.forward([Row(slot, ids[4:], len(ids) - 4)])
    with torch.inference_mode():
        ref = target_lm.model(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(torch.cat([head, tail]), ref, atol=1e-3)
    assert slot.length == len(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_norm_and_rotary_equal_the_eager_ops_bit_for_bit(target_lm, dtype):
    """The slot forward's fused RMSNorm and its roll-based rotary are pure speed-ups: the
    same numbers as the model's own modules, for every dtype a model can load in."""
    norm = type(target_lm.model.model.norm)(576, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(rms_norm(norm, x), norm(x))
    q = torch.randn(7, 9, 64, generator=gen).to(dtype)
    cos, sin = torch.randn(2, 7, 1, 64, generator=gen).to(dtype)
    assert torch.equal(rotate(q, cos, signed_sin(sin)), q * cos + rotate_half(q) * sin)  # transformers' own


def test_rows_of_one_batch_equal_their_solo_forwards(target_lm):
    fwd: SlotForward = target_lm.slots
    seqs = [target_lm.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS[:3]]
    solo = []
    for s in seqs:
        slot = fwd.new_slot()
        fwd.forward([Row(slot, s[:-1], 1)])
        solo.append(fwd.forward([Row(slot, s[-1:], 1)]))
    slots = [fwd.new_slot() for _ in seqs]
    # Ragged: one row prefills its whole prompt while the others decode one token.
    for slot, s in zip(slots[1:], seqs[1:]):
        fwd.forward([Row(slot, s[:-1], 1)])
    batched = fwd.forward([Row(slots[0], seqs[0], 1)] + [Row(sl, s[-1:], 1) for sl, s in zip(slots[1:], seqs[1:])])
    for i in range(3):
        assert torch.allclose(batched[i], solo[i][0], atol=1e-3)
        assert int(batched[i].argmax()) == int(solo[i][0].argmax())


def test_a_reused_slot_leaks_no_state_between_sessions(target_lm):
    """A session that starts in a slot another session filled produces its solo output."""
    fwd: SlotForward = target_lm.slots
    a = target_lm.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    b = target_lm.tokenizer(PROMPTS[1], add_special_tokens=False).input_ids
    fresh = fwd.forward([Row(fwd.new_slot(), b, len(b))])
    slot = fwd.new_slot()
    fwd.forward([Row(slot, a * 3, 1)])  # fill more positions than b will use
    slot.length = 0  # the session store's truncate / reuse
    reused = fwd.forward([Row(slot, b, len(b))])
    assert torch.equal(reused, fresh)


def _stats(address: str, role: str):
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch) if role == "verifier" else pb_grpc.DrafterStub(ch)
        return stub.GetStats(pb.StatsRequest(), timeout=10)


def test_32_concurrent_generations_equal_their_solo_greedy_outputs(client, verifier_proc):
    """Greedy: 32 speculative generations at once equal 8 of them run alone, and the target-only
    outputs of the other 24 (run at once too)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (#{i})" for i in range(32)]
    solo = {p: client.generate(p, params, num_speculative_tokens=3).token_ids for p in prompts[:8]}
    solo.update(zip(prompts[8:], target_only_outputs(client, prompts[8:], params)))
    before = _stats(verifier_proc.address, "verifier")
    barrier = threading.Barrier(32)

    def run(p):
        barrier.wait()
        return client.generate(p, params, num_speculative_tokens=3)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, prompts))
    after = _stats(verifier_proc.address, "verifier")
    for p, r in zip(prompts, results):
        assert r.token_ids == solo[p], p
    requests = after.requests - before.requests
    batches = after.batches - before.batches
    assert requests >= 32 and batches < requests  # rounds of different sessions shared forwards
    print(f"verifier: {requests} requests in {batches} batches (mean batch {requests / batches:.1f})")


def test_seeded_sampling_is_independent_of_batch_composition(client):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = client.generate(PROMPTS[2], params, num_speculative_tokens=3).token_ids
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=12) for s in range(7)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(client.generate, PROMPTS[(i + 3) % 8], sp, num_speculative_tokens=2)
                 for i, sp in enumerate(others)]
        mine = pool.submit(client.generate, PROMPTS[2], params, num_speculative_tokens=3)
        assert mine.result().token_ids == alone
        assert all(f.result().token_ids for f in noise)


def test_abandoned_sessions_expire_and_memory_returns():
    """1,000 sessions opened and abandoned (every tenth with a prefill): after the TTL the live
    count is 0 and the verifier's RSS is within 10% of its baseline."""
    svc = start_service("verifier", ["--session-ttl-s", "5", "--max-sessions", "1000", "--max-model-len", "256",
                                     "--log-level", "WARNING"], threads=1)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            stub = pb_grpc.VerifierStub(ch)
            greedy = pb.SamplingParams(temperature=0.0)
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id  # warm up allocator and kernels
            stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=list(range(100, 140)), sampling=greedy))
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            gc.collect()
            baseline = rss_mb(svc.proc.pid)
            opened = set()
            for i in range(1000):
                sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
                opened.add(sid)
                if i % 10 == 0:
                    stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=[100 + i % 50] * 8,
                                                 sampling=greedy))
            peak = stub.GetStats(pb.StatsRequest())
            peak_rss = rss_mb(svc.proc.pid)
            assert len(opened) == 1000 and peak.live_sessions > 0  # (the oldest may already have expired)
            deadline = time.monotonic() + 30
            while stub.GetStats(pb.StatsRequest()).live_sessions and time.monotonic() < deadline:
                time.sleep(0.5)
            final = stub.GetStats(pb.StatsRequest())
            after = rss_mb(svc.proc.pid)
        assert final.live_sessions == 0 and final.kv_bytes == 0
        print(f"RSS baseline {baseline:.0f} MiB, with {peak.live_sessions} live sessions {peak_rss:.0f} MiB "
              f"(KV reserved {peak.kv_bytes / 2**20:.0f} MiB), after expiry {after:.0f} MiB")
        assert after <= baseline * 1.10
    finally:
        svc.stop()


def test_resource_exhausted_when_every_session_is_busy_and_eviction_otherwise():
    """A full verifier refuses a new session while the only one has a call in flight, and
    for --evict-after-idle-s after it (a generation between rounds); then evicts it."""
    svc = start_service("verifier", ["--max-sessions", "1", "--evict-after-idle-s", "1", "--log-level", "WARNING"],
                        threads=1)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            stub = pb_grpc.VerifierStub(ch)
            greedy = pb.SamplingParams(temperature=0.0)
            a = stub.OpenSession(pb.OpenSessionRequest()).session_id
            long_prompt = [100 + i % 300 for i in range(1500)]  # a prefill long enough to be in flight
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                busy = pool.submit(stub.Verify, pb.VerifyRequest(session_id=a, append_token_ids=long_prompt,
                                                                 sampling=greedy))
                time.sleep(0.3)
                with pytest.raises(grpc.RpcError) as err:
                    stub.OpenSession(pb.OpenSessionRequest())
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert busy.result().kv_length == len(long_prompt)
            with pytest.raises(grpc.RpcError) as err:  # a's call ended just now: not idle long enough
                stub.OpenSession(pb.OpenSessionRequest())
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "within 1 s" in err.value.details()
            time.sleep(1.1)
            b = stub.OpenSession(pb.OpenSessionRequest()).session_id  # a is idle now: evicted
            with pytest.raises(grpc.RpcError) as err:
                stub.Verify(pb.VerifyRequest(session_id=a, truncate_to=len(long_prompt), append_token_ids=[5],
                                             sampling=greedy))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "evicted" in err.value.details()
            assert stub.Verify(pb.VerifyRequest(session_id=b, append_token_ids=[1, 2, 3],
                                                sampling=greedy)).kv_length == 3
            assert stub.GetStats(pb.StatsRequest()).evictions == 1
    finally:
        svc.stop()


def test_onednn_linears_match_the_mkl_path_greedily(target_lm):
    """--cpu-linear onednn (prepacked oneDNN float32 linears, the CPU default) computes the
    same model as MKL: logits within 1e-3 and the same greedy continuation over 12 steps."""
    from specdec.models import CausalLM, ModelSpec

    assert target_lm.spec.cpu_linear == ("onednn" if torch.backends.mkldnn.is_available() else "mkl")
    mkl = CausalLM(ModelSpec(dtype="float32", cpu_linear="mkl"))
    ids = target_lm.tokenizer("A short story about a lighthouse keeper:", add_special_tokens=False).input_ids
    outs = []
    for lm in (target_lm, mkl):
        slot, seq = lm.new_cache(), list(ids)
        logits = lm.forward(seq, slot, logits_to_keep=len(seq))
        first = logits
        for _ in range(12):
            seq.append(int(logits[-1].argmax()))
            logits = lm.forward(seq[-1:], slot, logits_to_keep=1)
        outs.append((first, seq))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-3)
    assert outs[0][1] == outs[1][1]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn) in this torch")
def test_onednn_linears_run_a_bounded_set_of_row_counts_with_the_same_output():
    """oneDNN builds and caches a primitive per input shape: prompts of every length grew a
    verifier by +343 MB over 900 requests (flat with MKL). Row counts past 16 are padded to a
    bounded set, for at most 1/8 more work; the padding never changes a real row's output."""
    from specdec.models import OneDNNLinear, onednn_rows

    shapes = {onednn_rows(m) for m in range(1, 257)}
    assert len(shapes) <= 16 + 8 * 4 + 1
    assert all(m <= onednn_rows(m) <= m * 9 / 8 for m in range(1, 4097))  # at most 1/8 more work
    assert [onednn_rows(m) for m in (1, 16, 17, 45, 64, 65, 250)] == [1, 16, 18, 48, 64, 72, 256]
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    fast = OneDNNLinear(linear)
    for rows in (1, 5, 17, 63, 65, 200):
        x = torch.randn(rows, 96)
        with torch.no_grad():
            assert torch.allclose(fast(x), linear(x), atol=1e-5), rows
            assert fast(x.view(1, rows, 96)).shape == (1, rows, 40)


def test_evicted_session_is_reprefilled_and_the_output_is_unchanged(drafter_proc):
    """--max-sessions 2 and another client opening a session every 2 ms: while the drafter
    drafts, our verifier session is idle and the least recently used, so it is evicted, gets
    NOT_FOUND 'evicted', re-opens, re-prefills the committed tokens, and the greedy output
    equals the undisturbed one. (The rounds run ahead of the caller, so idle time between
    rounds has to come from the rounds themselves: here, the drafts.)"""
    from client.speculative import SpeculativeClient

    # --evict-after-idle-s 0: any session without a call in flight may go (the default spares
    # those idle less than 2 s, which a generation between its rounds always is).
    svc = start_service("verifier", ["--max-sessions", "2", "--evict-after-idle-s", "0", "--log-level", "WARNING"],
                        threads=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        with SpeculativeClient(svc.address, drafter=drafter_proc.address, num_speculative_tokens=4) as c:
            expected = c.generate(PROMPTS[4], params, target_only=True).token_ids
            stop = threading.Event()

            def churn():
                with grpc.insecure_channel(svc.address) as ch:
                    stub = pb_grpc.VerifierStub(ch)
                    while not stop.is_set():
                        try:
                            stub.OpenSession(pb.OpenSessionRequest(), timeout=10)
                        except grpc.RpcError:
                            pass  # RESOURCE_EXHAUSTED while both sessions are busy
                        time.sleep(0.002)

            churner = threading.Thread(target=churn)
            churner.start()
            try:
                chunks = list(c.stream(PROMPTS[4], params))
            finally:
                stop.set()
                churner.join()
            result = chunks[-1].result
            assert result.token_ids == expected
            assert result.verifier_recoveries >= 1
            assert _stats(svc.address, "verifier").evictions >= 1
    finally:
        svc.stop()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bfloat16_prefill_twin_writes_the_models_own_slot(dtype):
    """--prefill-dtype bfloat16: rows of >= 3 tokens run through a bfloat16 copy and write
    the model's own slot; 1-token rows use its own weights; logits stay close to its own. A
    float32 model's linears are prepacked for oneDNN on a CPU: the copy was made of those
    and failed the start ("Cannot access storage of OpaqueTensorImpl")."""
    from specdec.models import CausalLM, ModelSpec

    plain = CausalLM(ModelSpec(dtype=dtype))
    twin = CausalLM(ModelSpec(dtype=dtype, prefill_dtype="bfloat16"))
    assert plain.prefill_slots is None and twin.prefill_slots is not None
    ids = twin.tokenizer(PROMPTS[0] + " and the capital of Spain is", add_special_tokens=False).input_ids
    slot = twin.new_cache()
    long = twin.forward(ids, slot, logits_to_keep=1)
    assert slot.data.dtype == getattr(torch, dtype) and slot.length == len(ids)
    step = twin.forward([int(long[-1].argmax())], slot, logits_to_keep=1)
    ref_slot = plain.new_cache()
    ref_long = plain.forward(ids, ref_slot, logits_to_keep=1)
    ref_step = plain.forward([int(long[-1].argmax())], ref_slot, logits_to_keep=1)
    for a, b in ((long, ref_long), (step, ref_step)):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_a_timed_out_call_leaves_its_session_consistent(verifier_proc):
    """A Verify whose client deadline expires mid-prefill still completes on the server;
    the session then serves a normal call (truncated as the client asks) with the right
    KV length, and closing it leaves no session behind."""
    with grpc.insecure_channel(verifier_proc.address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        greedy = pb.SamplingParams(temperature=0.0)
        live_before = stub.GetStats(pb.StatsRequest()).live_sessions
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        prompt = [100 + i % 400 for i in range(1200)]
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=greedy), timeout=0.05)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 60
        while True:  # the abandoned call still holds the session until its batch finishes
            try:
                r = stub.Verify(pb.VerifyRequest(session_id=sid, truncate_to=0, append_token_ids=prompt[:10],
                                                 sampling=greedy), timeout=60)
                break
            except grpc.RpcError as busy:
                assert busy.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
                time.sleep(0.2)
        assert r.kv_length == 10
        alone = stub.OpenSession(pb.OpenSessionRequest()).session_id
        ref = stub.Verify(pb.VerifyRequest(session_id=alone, append_token_ids=prompt[:10], sampling=greedy))
        assert list(r.output_token_ids) == list(ref.output_token_ids)
        for s in (sid, alone):
            stub.CloseSession(pb.CloseSessionRequest(session_id=s))
        assert stub.GetStats(pb.StatsRequest()).live_sessions <= live_before  # (older leftovers may expire)


def test_a_distribution_without_mass_fails_its_own_request_alone(target_lm, monkeypatch):
    """Behind the request checks (which refuse the parameters known to leave no token): a
    processed distribution that is NaN sampled id V. The verifier answered it as a token and
    the drafter appended it, so its next forward failed every request of the batch. Now that
    request alone fails, its session is cropped back, and its batch mates are answered. The NaN
    is injected into one request's processing (min_tokens routes it through its own call)."""
    import drafter_service.engine as drafter_module
    import verifier_service.engine as verifier_module
    from drafter_service.engine import DrafterEngine
    from specdec.errors import SpecDecError
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifyCall, VerifierEngine

    poisoned = SamplingParams(temperature=1.0, seed=666, min_tokens=1)
    for module in (drafter_module, verifier_module):
        real = module.process_logits

        def nan_for_poisoned(logits, params, *args, _real=real, **kwargs):
            out = _real(logits, params, *args, **kwargs)
            return torch.full_like(out, float("nan")) if params == poisoned else out

        monkeypatch.setattr(module, "process_logits", nan_for_poisoned)
    ids = target_lm.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    good = SamplingParams(temperature=1.0, seed=1)
    drafter = DrafterEngine(target_lm.spec, EngineConfig(speculation_slots=0, max_draft_tokens=4), lm=target_lm)
    try:
        long, bad, fine = (drafter.open_session() for _ in range(3))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            # The long prefill holds the engine while the other two queue: they share a batch.
            first = pool.submit(drafter.draft, long, 0, ids * 40, 2, good)
            time.sleep(0.05)
            outs = [pool.submit(drafter.draft, sid, 0, ids, 4, p) for sid, p in ((bad, poisoned), (fine, good))]
            assert len(first.result().draft_token_ids) == 2 and len(outs[1].result().draft_token_ids) == 4
            with pytest.raises(SpecDecError, match="no token with probability > 0"):
                outs[0].result()
        assert drafter.sessions._sessions[bad].length == 0  # cropped back to its truncate_to
        assert len(drafter.draft(bad, 0, ids, 3, good).draft_token_ids) == 3
    finally:
        drafter.shutdown()
    verifier = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0), lm=target_lm)
    try:
        bad, fine = verifier.open_session(), verifier.open_session()
        outs = verifier.verify_batch([VerifyCall(bad, 0, ids, [], None, poisoned),
                                      VerifyCall(fine, 0, ids, [], None, good)])
        assert isinstance(outs[0], SpecDecError) and "no token with probability > 0" in str(outs[0])
        assert outs[1].kv_length == len(ids) and 0 <= outs[1].output_token_ids[0] < target_lm.vocab_size
        assert verifier.sessions._sessions[bad].length == 0
    finally:
        verifier.shutdown()


def test_a_kv_budget_of_two_sessions_is_what_the_verifier_reports_and_admits(target_lm):
    """--kv-budget-mb of 2.5 sessions' slots: GetModelInfo's max_sessions is 2, not
    --max-sessions' 256 (a full server's refusal and the gateway's advice cited 256)."""
    from specdec.errors import ResourceExhausted
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifierEngine

    slot_mib = target_lm.slots.new_slot_bytes() / 2**20
    verifier = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0, kv_budget_mb=2.5 * slot_mib,
                                                           evict_after_idle_s=60), lm=target_lm)
    try:
        assert verifier.info.max_sessions == 2
        first, second = verifier.open_session(), verifier.open_session()
        with pytest.raises(ResourceExhausted, match="2 live, max 2"):  # both just opened: none idle long enough
            verifier.open_session()
        for sid in (first, second):
            verifier.close_session(sid)
    finally:
        verifier.shutdown()


def test_an_unknown_session_is_refused_before_its_proposal_is_decoded(target_lm, monkeypatch):
    """Decoding made a dense [K, V] q of any proposal: 5,000 VerifyBatch entries of 182 bytes
    each (a sparse top-1 proposal, an unknown session) cost the verifier 16.7 s."""
    import verifier_service.engine as verifier_module
    from specdec.errors import SessionNotFound
    from specdec.proposals import SPARSE, ProposalBuilder, ProposalFormat
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifyCall, VerifierEngine

    decoded = []
    real = verifier_module.decode_draft_q
    monkeypatch.setattr(verifier_module, "decode_draft_q", lambda *a, **k: decoded.append(1) or real(*a, **k))
    vocab = target_lm.vocab_size
    builder = ProposalBuilder(ProposalFormat(kind=SPARSE, top_n=1), vocab)
    draft = [builder.sample(torch.full((vocab,), 1.0 / vocab), 0.5, 7)]
    proposal = builder.build()
    verifier = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0), lm=target_lm)
    try:
        sampled = SamplingParams(temperature=1.0, seed=1)
        outs = verifier.verify_batch([VerifyCall("no-such-session", 0, [1, 2], draft, proposal, sampled)] * 50)
        assert all(isinstance(o, SessionNotFound) for o in outs) and not decoded
        sid = verifier.open_session()
        assert verifier.verify_batch([VerifyCall(sid, 0, [1, 2], draft, proposal, sampled)])[0].kv_length >= 2
        assert decoded  # a live session's proposal is decoded as before
    finally:
        verifier.shutdown()


def _draft_together(drafter, calls: list[tuple]) -> list:
    """Each (prompt, params[, format]) drafts γ 4 in a fresh session, all released at once
    from threads so that their rows can share the drafter's steps."""
    sids = [drafter.open_session() for _ in calls]
    barrier = threading.Barrier(len(calls))

    def draft(i: int):
        barrier.wait()
        prompt, *sampling = calls[i]
        return drafter.draft(sids[i], 0, prompt, 4, *sampling)

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(draft, range(len(calls))))


def test_sampled_drafts_of_rows_sharing_a_step_are_what_each_row_drafts_alone(target_lm):
    """8 seeded sampled sessions draft γ 4 at once: rows that share their sampling parameters
    and wire format are processed, drawn and turned into wire rows as one stack. Each row's
    drafts must be those it gets alone (so a seed's output does not depend on its batch
    mates), for dense, half-precision dense and sparse proposals, beside a penalised row that
    goes alone and a greedy row; its proposal the same up to float rounding (a batched forward
    and a sum over [R, V] round differently from one row's on a CPU), and each draft has mass
    under the proposal sent with it."""
    from drafter_service.engine import DrafterEngine
    from specdec.proposals import DENSE, IDS_ONLY, SPARSE, ProposalFormat, decode_proposal
    from specdec.serving import EngineConfig

    hot = SamplingParams(temperature=1.0, seed=11)
    shaped = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=12)
    cases = [(hot, ProposalFormat(DENSE)), (dataclasses.replace(hot, seed=13), ProposalFormat(DENSE)),
             (hot, ProposalFormat(DENSE, "bfloat16")), (shaped, ProposalFormat(SPARSE, top_n=8)),
             (dataclasses.replace(shaped, seed=14), ProposalFormat(SPARSE, top_n=8)),
             (dataclasses.replace(hot, repetition_penalty=1.3), ProposalFormat(SPARSE, top_n=8)),
             (SamplingParams(temperature=0.0), ProposalFormat(IDS_ONLY)), (shaped, ProposalFormat(DENSE, "float16"))]
    prompts = [target_lm.tokenizer(PROMPTS[i % 3], add_special_tokens=False).input_ids for i in range(len(cases))]
    drafter = DrafterEngine(target_lm.spec, EngineConfig(speculation_slots=0, max_draft_tokens=4), lm=target_lm)
    try:
        together = _draft_together(drafter, [(prompts[i], *cases[i]) for i in range(len(cases))])
        batches = drafter.snapshot_stats()["batches"]
        alone = [drafter.draft(drafter.open_session(), 0, prompts[i], 4, *cases[i]) for i in range(len(cases))]
    finally:
        drafter.shutdown()
    assert batches <= len(cases) - 1  # rows shared steps
    vocab = target_lm.vocab_size
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.draft_token_ids == b.draft_token_ids, i
        assert (a.proposal.kind, a.proposal.dtype, a.proposal.shape) == (b.proposal.kind, b.proposal.dtype,
                                                                           b.proposal.shape), i
        if a.proposal.kind != IDS_ONLY:
            qa, qb = decode_proposal(a.proposal, 4, vocab), decode_proposal(b.proposal, 4, vocab)
            assert torch.allclose(qa, qb, rtol=1e-2, atol=1e-5), (i, float((qa - qb).abs().max()))
            assert bool((qa[torch.arange(4), a.draft_token_ids] > 0).all()), i
    assert len({tuple(out.draft_token_ids) for out in together[:2]}) == 2  # the seeds matter (power)


def test_greedy_drafts_of_rows_sharing_a_step_are_each_rows_own_continuation(target_lm):
    """6 sessions draft γ 4 at once (one step's rows): greedy rows take one argmax over the
    step's stacked logits, a row with a repetition penalty goes through the processors alone.
    Each row's drafts must be its own greedy continuation (transformers, full forwards; the
    penalised row: the drafts it gets alone), whatever row it had in the stack."""
    from drafter_service.engine import DrafterEngine
    from specdec.serving import EngineConfig

    greedy, penalised = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.3)
    prompts = [target_lm.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS[:6]]
    params = [penalised if i == 2 else greedy for i in range(6)]
    drafter = DrafterEngine(target_lm.spec, EngineConfig(speculation_slots=0, max_draft_tokens=4), lm=target_lm)
    try:
        together = [list(out.draft_token_ids) for out in _draft_together(drafter, list(zip(prompts, params)))]
        alone = list(drafter.draft(drafter.open_session(), 0, prompts[2], 4, penalised).draft_token_ids)
        batches = drafter.snapshot_stats()["batches"]
    finally:
        drafter.shutdown()
    for i, ids in enumerate(prompts):
        if i == 2:
            assert together[i] == alone
            continue
        seq = list(ids)
        with torch.inference_mode():
            for _ in range(4):
                seq.append(int(target_lm.model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert together[i] == seq[len(ids):], i
    assert batches <= len(prompts) - 1  # rows shared steps (7 requests)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_mode_reports_the_processed_or_the_raw_distribution(target_lm, mode):
    """vLLM's --logprobs-mode: a greedy round with a repetition penalty that accepts its 3 drafts
    (the penalized argmax continuation) reports each of its 4 tokens' logprobs under the
    penalized distribution (processed, our default) or the model's own (raw, vLLM V1's default:
    a plain transformers forward's log_softmax); the tokens are the same either way."""
    from specdec.sampling import process_logits
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifierEngine, VerifyCall

    engine = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0, logprobs_mode=mode), lm=target_lm)
    try:
        prompt = target_lm.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
        params = SamplingParams(temperature=0.0, repetition_penalty=1.8, logprobs=3)
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(4):  # the penalized greedy continuation, one token at a time
                last = target_lm.model(torch.tensor([seq])).logits[0, -1:].float()
                seq.append(int(process_logits(last, params, engine.token_context(seq, len(prompt))).argmax()))
            logits = target_lm.model(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:].float()  # [4, V]
        drafts = seq[len(prompt):-1]
        sid = engine.open_session()
        out = engine.verify_call(VerifyCall(sid, 0, prompt, drafts, None, params, len(prompt)))
        processed = torch.log(process_logits(logits, params, engine.token_context(prompt, len(prompt)), drafts))
    finally:
        engine.shutdown()
    assert out.output_token_ids == seq[len(prompt):] and out.num_accepted == 3
    emitted = torch.tensor(out.output_token_ids)
    raw = torch.log_softmax(logits, dim=-1)[torch.arange(4), emitted]
    reported = torch.tensor([e.logprob for e in out.logprobs])
    assert not torch.allclose(raw, processed[torch.arange(4), emitted], atol=1e-2)  # the modes differ here
    if mode == "raw_logprobs":
        assert torch.allclose(reported, raw, atol=1e-4), (reported, raw)
        assert [e.top_token_ids for e in out.logprobs] == logits.topk(3).indices.tolist()
    else:
        assert torch.allclose(reported, processed[torch.arange(4), emitted], atol=1e-4)


def test_decode_steps_rounds_equal_single_steps_and_stop_where_the_generation_would(target_lm):
    """A target-only round of decode_steps = 6 gives the tokens (and logprobs) of six one-step
    rounds: greedy, and sampled with a seed, penalties and top-k (the draws are keyed by
    position). It stops right after a stop_token_id, rows that decode share steps with each
    other and with a plain round, and bad values are refused before any session is touched."""
    from specdec.errors import InvalidArgument
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifierEngine, VerifyCall

    engine = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0), lm=target_lm)
    prompt = target_lm.tokenizer("The quick brown fox jumps over the lazy dog. Then").input_ids
    try:
        for params in (SamplingParams(temperature=0.0, logprobs=2),
                       SamplingParams(temperature=0.9, top_k=50, seed=7, repetition_penalty=1.3, logprobs=1)):
            one = engine.open_session()
            out = engine.verify_call(VerifyCall(one, 0, prompt, [], None, params, len(prompt)))
            stepped, lps, single_ms = list(out.output_token_ids), list(out.logprobs), []
            for _ in range(5):
                out = engine.verify_call(VerifyCall(one, len(prompt) + len(stepped) - 1, stepped[-1:], [], None, params,
                                                    len(prompt)))
                stepped += out.output_token_ids
                lps += out.logprobs
                single_ms.append(out.load.device_ms)
            many = engine.open_session()
            first = engine.verify_call(VerifyCall(many, 0, prompt, [], None, params, len(prompt)))
            out = engine.verify_call(VerifyCall(many, len(prompt), first.output_token_ids, [], None, params,
                                                len(prompt), decode_steps=5))
            assert first.output_token_ids + out.output_token_ids == stepped, params
            assert out.kv_length == len(prompt) + len(stepped) - 1 and out.num_accepted == 0
            # the round's engine time is its five steps' (it was the last step's alone)
            assert out.load.step_ms == pytest.approx(out.load.device_ms + out.load.host_ms, rel=1e-3)
            assert out.load.device_ms > 2.5 * min(single_ms), (out.load.device_ms, single_ms)
            assert [e.logprob for e in first.logprobs + out.logprobs] == pytest.approx([e.logprob for e in lps],
                                                                                       abs=1e-5)
        greedy = SamplingParams(temperature=0.0)
        sids = [engine.open_session() for _ in range(3)]
        heads = [engine.verify_call(VerifyCall(s, 0, prompt, [], None, greedy, len(prompt))).output_token_ids
                 for s in sids]
        batches = engine.scheduler.stats.batches
        outs = engine.verify_batch([VerifyCall(sids[0], len(prompt), heads[0], [], None, greedy, len(prompt),
                                               decode_steps=8),
                                    VerifyCall(sids[1], len(prompt), heads[1], [], None, greedy, len(prompt),
                                               decode_steps=0),
                                    VerifyCall(sids[2], len(prompt), heads[2], [], None, greedy, len(prompt),
                                               decode_steps=8)])
        assert [len(o.output_token_ids) for o in outs] == [8, 1, 8]
        assert outs[0].output_token_ids == outs[2].output_token_ids
        assert engine.scheduler.stats.batches - batches <= 9  # 8 steps, rows together (+1: a late arrival)
        decoded = outs[0].output_token_ids
        stop = SamplingParams(temperature=0.0, stop_token_ids=[decoded[3]])
        sid = engine.open_session()
        engine.verify_call(VerifyCall(sid, 0, prompt, [], None, stop, len(prompt)))
        out = engine.verify_call(VerifyCall(sid, len(prompt), heads[0], [], None, stop, len(prompt), decode_steps=8))
        assert out.output_token_ids == decoded[:decoded.index(decoded[3]) + 1]
        for steps, drafts, field in ((65, [], "decode_steps"), (-1, [], "decode_steps"), (4, [5], "decode_steps")):
            with pytest.raises(InvalidArgument) as err:
                engine.verify_call(VerifyCall(sid, 0, prompt, drafts, None, greedy, len(prompt), decode_steps=steps))
            assert err.value.field == field
        assert engine.sessions._sessions[sid].length == out.kv_length == len(prompt) + len(out.output_token_ids)  # untouched
    finally:
        engine.shutdown()


def test_decode_steps_stop_at_eos_past_min_tokens_at_the_context_end_and_a_cancel_restores_the_session(target_lm):
    """EOS (biased to win) is masked until min_tokens outputs exist, then ends the round, unless
    ignore_eos; a round stops where the context ends; a round whose caller leaves mid-way fails
    at its next step and its session is cropped back to its truncate_to."""
    from specdec.errors import CallCancelled
    from specdec.models import CausalLM, ModelSpec
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifierEngine, VerifyCall

    engine = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0), lm=target_lm)
    eos = engine.info.eos_token_ids[0]
    prompt = target_lm.tokenizer("The quick brown fox").input_ids
    try:
        sid = engine.open_session()
        head = engine.verify_call(VerifyCall(sid, 0, prompt, [], None, SamplingParams(temperature=0.0),
                                             len(prompt))).output_token_ids
        # outputs so far: 1 (head); min_tokens 3 masks EOS for the 2nd and 3rd, the 4th is EOS and ends it
        params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3)
        out = engine.verify_call(VerifyCall(sid, len(prompt), head, [], None, params, len(prompt), decode_steps=6))
        assert len(out.output_token_ids) == 3 and eos not in out.output_token_ids[:2], out.output_token_ids
        assert out.output_token_ids[2] == eos
        # ignore_eos: EOS is neither masked nor a stop, so the round runs its 6 steps
        out = engine.verify_call(VerifyCall(sid, len(prompt), head, [], None, params.replace(ignore_eos=True),
                                            len(prompt), decode_steps=6))
        assert out.output_token_ids == [eos] * 6
        calls = iter([True, True])  # alive for the first two steps' checks, then the caller is gone
        with pytest.raises(CallCancelled):
            engine.verify_call(VerifyCall(sid, len(prompt), head, [], None, SamplingParams(temperature=0.0),
                                          len(prompt), decode_steps=6), alive=lambda: next(calls, False))
        assert engine.sessions._sessions[sid].length == len(prompt)  # cropped back: no token of the round kept
    finally:
        engine.shutdown()

    short = CausalLM(ModelSpec(dtype="float32", max_model_len=len(prompt) + 4))
    engine = VerifierEngine(short.spec, EngineConfig(speculation_slots=0), lm=short)
    try:
        sid = engine.open_session()
        head = engine.verify_call(VerifyCall(sid, 0, prompt, [], None, SamplingParams(temperature=0.0),
                                             len(prompt))).output_token_ids
        out = engine.verify_call(VerifyCall(sid, len(prompt), head, [], None, SamplingParams(temperature=0.0),
                                            len(prompt), decode_steps=8))
        assert len(out.output_token_ids) == 4 and out.kv_length == short.max_context  # the context is full
    finally:
        engine.shutdown()
