"""VerifyBatch, the batched front: many sessions' rounds in one call, against a real verifier
process. Each entry must behave exactly as the same round sent as a unary Verify, and fail
alone."""

from __future__ import annotations

import threading

import grpc
import pytest

from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 314, 2115, 314, 260, 3773, 30], [1, 2683, 314, 253, 1345, 28, 19, 1114, 30],
           [1, 7306, 2213, 314, 3217, 16, 5347, 28, 16, 3773, 30]]
ROUNDS = 6


@pytest.fixture(scope="module")
def stub(verifier_proc):
    with grpc.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.VerifierStub(channel)


def _drafts(round_index: int, i: int) -> list[int]:
    """Fixed junk drafts: greedy verification rejects most of them, exercising the crop."""
    return [(97 * (round_index + 1) + 13 * i + j) % 4000 + 100 for j in range(2)]


def _run(stub, sampling: pb.SamplingParams, batched: bool) -> list[list[int]]:
    """ROUNDS rounds of every prompt (its own session), unary or all in one VerifyBatch a round."""
    sids = [stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in PROMPTS]
    committed = [list(p) for p in PROMPTS]
    kv = [0] * len(PROMPTS)
    try:
        for rnd in range(ROUNDS):
            reqs = [pb.VerifyRequest(session_id=sid, truncate_to=kv[i], append_token_ids=committed[i][kv[i]:],
                                     draft_token_ids=_drafts(rnd, i), sampling=sampling,
                                     proposal=pb.Proposal(kind=pb.IDS_ONLY, shape=[2]))
                    for i, sid in enumerate(sids)]
            if batched:
                reply = stub.VerifyBatch(pb.VerifyBatchRequest(requests=reqs), timeout=60)
                assert [r.code for r in reply.results] == [0] * len(reqs), [r.message for r in reply.results]
                outs = [r.response for r in reply.results]
            else:
                outs = [stub.Verify(r, timeout=60) for r in reqs]
            for i, out in enumerate(outs):
                committed[i] += list(out.output_token_ids)
                kv[i] = out.kv_length
                assert kv[i] == len(committed[i]) - 1
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    return [c[len(p):] for c, p in zip(committed, PROMPTS)]


@pytest.mark.parametrize("sampling", [pb.SamplingParams(temperature=0.0),
                                      pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_batched_rounds_are_token_identical_to_unary_rounds(stub, sampling):
    unary = _run(stub, sampling, batched=False)
    batched = _run(stub, sampling, batched=True)
    assert batched == unary
    assert all(len(out) >= ROUNDS for out in unary)  # every round emitted at least one token


def test_batched_greedy_rounds_follow_target_only_decoding(stub):
    """Drafts or not, greedy output is the target's own argmax chain: γ 0 rounds are the reference."""
    greedy = pb.SamplingParams(temperature=0.0)
    sids = [stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in PROMPTS]
    reference = []
    try:
        for sid, prompt in zip(sids, PROMPTS):
            seq, kv = list(prompt), 0
            for _ in range(3 * ROUNDS):
                out = stub.Verify(pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=seq[kv:],
                                                   sampling=greedy), timeout=60)
                seq.append(out.output_token_ids[0])
                kv = out.kv_length
            reference.append(seq[len(prompt):])
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    batched = _run(stub, greedy, batched=True)
    for ref, got in zip(reference, batched):
        n = min(len(ref), len(got))
        assert got[:n] == ref[:n]


def test_a_bad_entry_fails_alone_and_leaves_its_session_consistent(stub, verifier_proc):
    greedy = pb.SamplingParams(temperature=0.0)
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    good, bad = (stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in range(2))
    try:
        first = stub.VerifyBatch(pb.VerifyBatchRequest(requests=[
            pb.VerifyRequest(session_id=good, append_token_ids=PROMPTS[0], sampling=greedy),
            pb.VerifyRequest(session_id=bad, append_token_ids=PROMPTS[1], sampling=greedy)]), timeout=60)
        assert [r.code for r in first.results] == [0, 0]
        bad_kv = first.results[1].response.kv_length
        last = list(first.results[1].response.output_token_ids)
        reply = stub.VerifyBatch(pb.VerifyBatchRequest(requests=[
            pb.VerifyRequest(session_id=good, truncate_to=first.results[0].response.kv_length,
                             append_token_ids=list(first.results[0].response.output_token_ids), sampling=greedy),
            # an id outside the vocabulary: INVALID_ARGUMENT, before its session is touched
            pb.VerifyRequest(session_id=bad, truncate_to=bad_kv, append_token_ids=last,
                             draft_token_ids=[info.vocab_size + 5], sampling=greedy),
            pb.VerifyRequest(session_id="no-such-session", append_token_ids=[1], sampling=greedy),
            # truncating past the cache: OUT_OF_RANGE
            pb.VerifyRequest(session_id=bad, truncate_to=bad_kv + 50, append_token_ids=last, sampling=greedy),
            # a malformed proposal kind: INVALID_ARGUMENT while converting the entry
            pb.VerifyRequest(session_id=bad, truncate_to=bad_kv, append_token_ids=last, draft_token_ids=[5],
                             proposal=pb.Proposal(kind=77), sampling=pb.SamplingParams(temperature=1.0))]),
            timeout=60)
        codes = [grpc.StatusCode.OK.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0],
                 grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.OUT_OF_RANGE.value[0],
                 grpc.StatusCode.INVALID_ARGUMENT.value[0]]
        assert [r.code for r in reply.results] == codes
        assert "outside" in reply.results[1].message and "proposal.kind" in reply.results[4].message
        assert reply.results[0].response.output_token_ids  # the good entry proceeded
        # The failed session is where its client left it: the same round again succeeds.
        again = stub.Verify(pb.VerifyRequest(session_id=bad, truncate_to=bad_kv, append_token_ids=last,
                                             sampling=greedy), timeout=60)
        assert again.kv_length == bad_kv + len(last)
    finally:
        for sid in (good, bad):
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_a_disconnected_batch_client_loses_only_its_own_sessions(stub, verifier_proc):
    """Client A's batch (long prompts) is cancelled by its deadline mid-call while client B runs
    batched rounds on the same server: B's output is exactly what it is alone."""
    greedy = pb.SamplingParams(temperature=0.0)
    alone = _run(stub, greedy, batched=True)
    errors: list[BaseException] = []

    def client_a() -> None:
        with grpc.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS) as channel:
            a = pb_grpc.VerifierStub(channel)
            sids = [a.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in range(4)]
            long_prompt = [(7 * j) % 4000 + 100 for j in range(700)]
            try:
                a.VerifyBatch(pb.VerifyBatchRequest(requests=[
                    pb.VerifyRequest(session_id=sid, append_token_ids=long_prompt, sampling=greedy) for sid in sids]),
                    timeout=0.05)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    errors.append(exc)
            # A's channel closes here with its sessions open: the server's TTL reaps them.

    t = threading.Thread(target=client_a)
    t.start()
    beside = _run(stub, greedy, batched=True)
    t.join(60)
    assert not errors
    assert beside == alone


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_batching_client_generates_what_a_unary_client_does(verifier_proc, drafter_proc, params):
    """SpeculativeClient(batch_verify=True): 4 concurrent generations share VerifyBatch calls;
    each output equals the same request's through unary calls (fixed γ, so the rounds match)."""
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
               "Why is the sky blue?"]
    sp = SamplingParams(max_tokens=16, **params)

    def run(batch: bool) -> list[list[int]]:
        with SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address, num_speculative_tokens=3,
                               batch_verify=batch) as c:
            outs: list[list[int] | None] = [None] * len(prompts)

            def one(i: int) -> None:
                outs[i] = c.generate(prompts[i], sp).token_ids

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert bool(c._batchers) == batch  # the batched run did go through a VerifyBatcher
            return outs

    unary, batched = run(False), run(True)
    assert all(unary)
    assert batched == unary


def test_one_step_mixes_dense_proposals_ids_only_drafts_and_plain_decodes(stub):
    """Sampled rows of every proposal form in one batch: a dense q, an ids-only draft and no
    draft at all (an empty draft list once made the step's one-hot fill fail for everyone)."""
    import numpy as np

    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    sampling = pb.SamplingParams(temperature=1.0, seed=3)
    sids = [stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in range(3)]
    try:
        first = stub.VerifyBatch(pb.VerifyBatchRequest(requests=[
            pb.VerifyRequest(session_id=sid, append_token_ids=p, sampling=sampling) for sid, p in zip(sids, PROMPTS)]),
            timeout=60)
        assert [r.code for r in first.results] == [0, 0, 0]
        q = np.full((2, info.vocab_size), 1.0 / info.vocab_size, dtype=np.float32)  # uniform: any draft has mass
        entries = []
        for i, (sid, r) in enumerate(zip(sids, first.results)):
            req = pb.VerifyRequest(session_id=sid, truncate_to=r.response.kv_length,
                                   append_token_ids=list(r.response.output_token_ids), sampling=sampling)
            if i == 0:
                req.draft_token_ids.extend([500, 600])
                req.proposal.CopyFrom(pb.Proposal(kind=pb.DENSE, dtype=pb.FLOAT32, shape=[2, info.vocab_size],
                                                  probs=q.tobytes()))
            elif i == 1:
                req.draft_token_ids.extend([700])
                req.proposal.CopyFrom(pb.Proposal(kind=pb.IDS_ONLY, shape=[1]))
            entries.append(req)
        reply = stub.VerifyBatch(pb.VerifyBatchRequest(requests=entries), timeout=60)
        assert [r.code for r in reply.results] == [0, 0, 0], [r.message for r in reply.results]
        assert [len(r.response.output_token_ids) >= 1 for r in reply.results] == [True] * 3
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_the_batcher_falls_back_to_unary_calls_on_a_verifier_without_verify_batch(verifier_proc):
    """An older verifier answers VerifyBatch with UNIMPLEMENTED: the batcher then sends unary
    Verify calls, and the rounds give what direct unary calls give. The old server here is a
    real gRPC server that implements Verify only, relaying to the real verifier."""
    from concurrent import futures

    from client.batching import VerifyBatcher

    upstream_channel = grpc.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS)
    upstream = pb_grpc.VerifierStub(upstream_channel)

    class OldVerifier(pb_grpc.VerifierServicer):  # VerifyBatch left unimplemented
        def Verify(self, request, context):
            return upstream.Verify(request, timeout=60)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_VerifierServicer_to_server(OldVerifier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    batcher = VerifyBatcher(pb_grpc.VerifierStub(channel))
    greedy = pb.SamplingParams(temperature=0.0)

    def rounds(verify) -> list[int]:
        sid = upstream.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id
        try:
            seq, kv = list(PROMPTS[0]), 0
            for _ in range(4):  # the prompt, then 3 short appends (the batcher's own path)
                out = verify(pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=seq[kv:],
                                              sampling=greedy), 60)
                seq += list(out.output_token_ids)
                kv = out.kv_length
            return seq[len(PROMPTS[0]):]
        finally:
            upstream.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)

    try:
        via_batcher = rounds(batcher.verify)
        assert batcher._unary  # it found out, and went on unary
        direct = rounds(lambda req, timeout: upstream.Verify(req, timeout=timeout))
    finally:
        batcher.close()
        channel.close()
        server.stop(0)
        upstream_channel.close()
    assert via_batcher == direct and len(direct) == 4
