"""The batched front: many sessions' rounds in one VerifyBatch call, or in one message of a
VerifyStream, against a real verifier process. Each entry must behave exactly as the same round
sent as a unary Verify, and fail alone."""

from __future__ import annotations

import asyncio

import queue
import threading
import time

import grpc
import pytest

from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS
from tests.conftest import rss_mb, wait_for

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


class _Steps:
    """One client's steps through the batched front: a VerifyBatch call each ("batched"), or a
    message each on one VerifyStream ("stream"), whose reply must carry the step's tag."""

    def __init__(self, stub, front: str) -> None:
        self.stub, self.front, self.tag = stub, front, 0
        if front == "stream":
            self.outbox: queue.SimpleQueue = queue.SimpleQueue()
            self.replies = stub.VerifyStream(iter(self.outbox.get, None))

    def send(self, requests: list[pb.VerifyRequest]) -> None:
        self.tag += 1
        self.outbox.put(pb.VerifyBatchRequest(requests=requests, tag=self.tag))

    def __call__(self, requests: list[pb.VerifyRequest]) -> pb.VerifyBatchResponse:
        if self.front == "batched":
            return self.stub.VerifyBatch(pb.VerifyBatchRequest(requests=requests), timeout=60)
        self.send(requests)
        reply = next(self.replies)
        assert reply.tag == self.tag
        return reply

    def close(self) -> None:
        if self.front == "stream":
            self.outbox.put(None)  # half-close: the server ends the stream
            assert list(self.replies) == []  # nothing left unanswered


def _run(stub, sampling: pb.SamplingParams, front: str) -> list[list[int]]:
    """ROUNDS rounds of every prompt (its own session): unary calls, or all in one step a round."""
    sids = [stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in PROMPTS]
    committed = [list(p) for p in PROMPTS]
    kv = [0] * len(PROMPTS)
    steps = _Steps(stub, front) if front != "unary" else None
    try:
        for rnd in range(ROUNDS):
            reqs = [pb.VerifyRequest(session_id=sid, truncate_to=kv[i], append_token_ids=committed[i][kv[i]:],
                                     draft_token_ids=_drafts(rnd, i), sampling=sampling,
                                     proposal=pb.Proposal(kind=pb.IDS_ONLY, shape=[2]))
                    for i, sid in enumerate(sids)]
            if steps is not None:
                reply = steps(reqs)
                assert [r.code for r in reply.results] == [0] * len(reqs), [r.message for r in reply.results]
                outs = [r.response for r in reply.results]
            else:
                outs = [stub.Verify(r, timeout=60) for r in reqs]
            for i, out in enumerate(outs):
                committed[i] += list(out.output_token_ids)
                kv[i] = out.kv_length
                assert kv[i] == len(committed[i]) - 1
        if steps is not None:
            steps.close()
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    return [c[len(p):] for c, p in zip(committed, PROMPTS)]


@pytest.mark.parametrize("sampling", [pb.SamplingParams(temperature=0.0),
                                      pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_batched_rounds_are_token_identical_to_unary_rounds(stub, sampling):
    unary = _run(stub, sampling, "unary")
    assert _run(stub, sampling, "batched") == unary
    assert _run(stub, sampling, "stream") == unary
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
    for front in ("batched", "stream"):
        for ref, got in zip(reference, _run(stub, greedy, front)):
            n = min(len(ref), len(got))
            assert got[:n] == ref[:n]


@pytest.mark.parametrize("front", ["batched", "stream"])
def test_a_bad_entry_fails_alone_and_leaves_its_session_consistent(stub, verifier_proc, front):
    greedy = pb.SamplingParams(temperature=0.0)
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    good, bad = (stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in range(2))
    step = _Steps(stub, front)
    try:
        first = step([
            pb.VerifyRequest(session_id=good, append_token_ids=PROMPTS[0], sampling=greedy),
            pb.VerifyRequest(session_id=bad, append_token_ids=PROMPTS[1], sampling=greedy)])
        assert [r.code for r in first.results] == [0, 0]
        bad_kv = first.results[1].response.kv_length
        last = list(first.results[1].response.output_token_ids)
        reply = step([
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
                             proposal=pb.Proposal(kind=77), sampling=pb.SamplingParams(temperature=1.0))])
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
        step.close()  # a stream goes on after failed entries
    finally:
        for sid in (good, bad):
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


@pytest.mark.parametrize("client_a", ["batch-cancelled", "stream-disconnected", "stream-slow"])
def test_a_slow_or_disconnected_batch_client_loses_only_its_own_sessions(stub, verifier_proc, client_a):
    """Client A sends one step of long prompts, then (batch-cancelled) its VerifyBatch call
    passes its deadline mid-call, (stream-disconnected) it closes its channel with the step in
    flight, or (stream-slow) it reads no reply until the others are done. Meanwhile client B runs
    streamed rounds on the same server: B's output is exactly what it is alone. A's sessions are
    released all the same: a slow A gets its reply late, a gone A's sessions take calls again."""
    greedy = pb.SamplingParams(temperature=0.0)
    alone = _run(stub, greedy, "stream")
    long_prompt = [(7 * j) % 4000 + 100 for j in range(700)]
    a_channel = grpc.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS)
    a = pb_grpc.VerifierStub(a_channel)
    sids = [a.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id for _ in range(4)]
    step = [pb.VerifyRequest(session_id=sid, append_token_ids=long_prompt, sampling=greedy) for sid in sids]
    try:
        if client_a == "batch-cancelled":
            with pytest.raises(grpc.RpcError) as err:
                a.VerifyBatch(pb.VerifyBatchRequest(requests=step), timeout=0.05)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            a_steps = _Steps(a, "stream")
            a_steps.send(step)
            if client_a == "stream-disconnected":
                time.sleep(0.2)  # let the step reach the engine
                a_channel.close()
        beside = _run(stub, greedy, "stream")
        assert beside == alone
        if client_a == "stream-slow":
            reply = next(a_steps.replies)  # answered all along, read only now
            assert [r.code for r in reply.results] == [0] * 4
            assert all(r.response.kv_length == len(long_prompt) for r in reply.results)
            a_steps.close()
        # However A went, its sessions are let go once its step is done (a gone A's may still
        # be prefilling: FAILED_PRECONDITION, busy, until then): each takes a fresh prefill.
        give_up = time.monotonic() + 60
        for sid in sids:
            while True:
                try:
                    out = stub.Verify(pb.VerifyRequest(session_id=sid, truncate_to=0, append_token_ids=PROMPTS[0],
                                                       sampling=greedy), timeout=60)
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > give_up:
                        raise
                    time.sleep(0.1)
            assert out.kv_length == len(PROMPTS[0])
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        a_channel.close()


def test_a_stream_client_that_never_reads_is_no_longer_read_and_costs_the_server_bounded_memory(stub, verifier_proc):
    """A client sends 300 messages of 500 entries (unknown sessions: each fails at once) and
    reads no reply. The server used to begin every message as it arrived and keep its results
    until their replies were sent: 1 GB more per 300 such messages, without end. Now it stops
    reading once the stream's window of unanswered entries is full, and gRPC's flow control
    holds the client's sends. The server serves other clients throughout and after."""
    junk = pb.VerifyBatchRequest(requests=[pb.VerifyRequest(session_id=f"no-such-session-{i}", append_token_ids=[1])
                                           for i in range(500)])
    pulled = [0]

    def messages():
        for _ in range(300):
            pulled[0] += 1
            yield junk

    before = rss_mb(verifier_proc.proc.pid)
    replies = stub.VerifyStream(messages())  # never read
    try:
        last, give_up = -1, time.monotonic() + 30
        while pulled[0] != last and time.monotonic() < give_up:  # until the client can send no more
            last = pulled[0]
            time.sleep(2.0)
        grown = rss_mb(verifier_proc.proc.pid) - before
        # before: +504 MB after 238 messages read; now about 115 read (what the transport buffers)
        assert grown < 200, f"the server grew by {grown:.0f} MB after reading {pulled[0]} messages"
        assert _run(stub, pb.SamplingParams(temperature=0.0), "stream")  # others are served meanwhile
    finally:
        replies.cancel()


def test_a_message_past_the_entry_cap_is_refused_and_a_stream_ends_after_the_replies_before_it(stub, verifier_proc):
    """At most --max-sessions + 256 entries a message (a million bogus ones held the engine's
    checks 30 s): a VerifyBatch past it is INVALID_ARGUMENT naming the cap; on a stream the
    earlier message is answered, then the stream ends with that status."""
    cap = stub.GetModelInfo(pb.ModelInfoRequest()).max_sessions + 256
    entry = pb.VerifyRequest(session_id="no-such-session", append_token_ids=[1])
    with pytest.raises(grpc.RpcError) as err:
        stub.VerifyBatch(pb.VerifyBatchRequest(requests=[entry] * (cap + 1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {cap}" in err.value.details()
    assert len(stub.VerifyBatch(pb.VerifyBatchRequest(requests=[entry] * cap), timeout=60).results) == cap
    replies = stub.VerifyStream(iter([pb.VerifyBatchRequest(tag=1, requests=[entry]),
                                      pb.VerifyBatchRequest(tag=2, requests=[entry] * (cap + 1))]), timeout=30)
    first = next(replies)
    assert first.tag == 1 and first.results[0].code == grpc.StatusCode.NOT_FOUND.value[0]
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {cap}" in err.value.details()


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
            assert all(b._front == "stream" for b in (c._batchers or {}).values())  # on a VerifyStream
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


@pytest.mark.parametrize("knows", ["Verify", "VerifyBatch"])
def test_the_batcher_falls_back_on_an_older_verifier(verifier_proc, knows):
    """An older verifier answers VerifyStream (and VerifyBatch) with UNIMPLEMENTED: the batcher
    then sends VerifyBatch calls (or unary Verify calls), and the rounds give what direct unary
    calls give. The old server here is a real gRPC server that implements Verify (and
    VerifyBatch) only, relaying to the real verifier."""
    from concurrent import futures

    from client.batching import VerifyBatcher

    upstream_channel = grpc.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS)
    upstream = pb_grpc.VerifierStub(upstream_channel)

    class OldVerifier(pb_grpc.VerifierServicer):  # VerifyStream (and VerifyBatch) left unimplemented
        def Verify(self, request, context):
            return upstream.Verify(request, timeout=60)

        if knows == "VerifyBatch":
            def VerifyBatch(self, request, context):
                return upstream.VerifyBatch(request, timeout=60)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_VerifierServicer_to_server(OldVerifier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
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

    async def through_the_batcher() -> tuple[list[int], str]:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")  # the batcher lives on the client's event loop
        batcher = VerifyBatcher(pb_grpc.VerifierStub(channel))
        try:
            loop = asyncio.get_running_loop()
            # rounds() blocks: it runs on a worker thread and hands each round to this loop.
            tokens = await asyncio.to_thread(rounds, lambda req, timeout: asyncio.run_coroutine_threadsafe(
                batcher.verify(req, timeout), loop).result())
            return tokens, batcher._front
        finally:
            batcher.close()
            await channel.close()

    try:
        via_batcher, front = asyncio.run(through_the_batcher())
        assert front == ("unary" if knows == "Verify" else "batch")  # it found out and went on
        direct = rounds(lambda req, timeout: upstream.Verify(req, timeout=timeout))
    finally:
        server.stop(0)
        upstream_channel.close()
    assert via_batcher == direct and len(direct) == 4


def test_a_batched_round_past_its_deadline_fails_alone_and_the_stream_goes_on(verifier_proc, stub):
    """A round on the client's VerifyStream whose deadline passes before its step's reply fails
    DEADLINE_EXCEEDED at its deadline; the late reply is skipped, the stream stays up, and the
    session's next rounds (truncated to what the client knew) give the unary rounds' tokens."""
    from client.batching import VerifyBatcher

    greedy = pb.SamplingParams(temperature=0.0)
    prompt = PROMPTS[1]

    def reference() -> list[int]:
        sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id
        try:
            out = stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=greedy), timeout=60)
            seq = prompt + list(out.output_token_ids)
            for _ in range(4):
                out = stub.Verify(pb.VerifyRequest(session_id=sid, truncate_to=out.kv_length,
                                                   append_token_ids=seq[out.kv_length:], sampling=greedy), timeout=60)
                seq += list(out.output_token_ids)
            return seq
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)

    async def through_the_batcher() -> tuple[list[int], float, str]:
        channel = grpc.aio.insecure_channel(verifier_proc.address, options=CHANNEL_OPTIONS)
        batcher = VerifyBatcher(pb_grpc.VerifierStub(channel))
        sid = (await pb_grpc.VerifierStub(channel).OpenSession(pb.OpenSessionRequest(), timeout=30)).session_id
        try:
            first = await batcher.verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt,
                                                          sampling=greedy), 60)
            kv, seq = first.kv_length, prompt + list(first.output_token_ids)  # what the client knows
            t0 = time.monotonic()  # a step with 8 junk drafts, given 1 ms
            with pytest.raises(grpc.RpcError) as err:
                await batcher.verify(pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=seq[kv:],
                                                      draft_token_ids=[(37 * j) % 4000 + 100 for j in range(8)],
                                                      sampling=greedy), 0.001)
            waited = time.monotonic() - t0
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.5)  # the late reply arrives and is skipped
            for _ in range(4):
                out = await batcher.verify(pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=seq[kv:],
                                                            sampling=greedy), 60)
                seq = seq + list(out.output_token_ids)
                kv = out.kv_length
            return seq, waited, batcher._front
        finally:
            await pb_grpc.VerifierStub(channel).CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            batcher.close()
            await channel.close()

    live = stub.GetStats(pb.StatsRequest()).live_sessions
    seq, waited, front = asyncio.run(through_the_batcher())
    assert waited < 0.5  # failed at its own deadline, not at the step's reply or a default
    assert front == "stream"  # the stream was not given up for one late round
    assert seq == reference()
    assert stub.GetStats(pb.StatsRequest()).live_sessions == live


def test_astream_from_another_loop_matches_the_blocking_api_and_close_leaves_no_task(verifier_proc, drafter_proc):
    """The client's async API, from a caller's own event loop: four concurrent greedy
    generations give what `generate` gives; a caller that stops reading after two chunks ends
    its generation with both sessions closed; and close() leaves no task pending on the
    client's loop (a VerifyStream's reader and writer included)."""
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
               "Why is the sky blue?"]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    stub = pb_grpc.VerifierStub(grpc.insecure_channel(verifier_proc.address))

    def live() -> int:
        return stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions

    client = SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address, num_speculative_tokens=3,
                               batch_verify=True)
    try:
        blocking = [client.generate(p, sp).token_ids for p in prompts]
        before = live()

        async def caller() -> tuple[list[list[int]], int]:
            results = await asyncio.gather(*(client.agenerate(p, sp) for p in prompts))
            chunks = client.astream(prompts[0], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            async for i, _ in _aenumerate(chunks):
                if i == 1:
                    break
            await chunks.aclose()  # returns once the generation's sessions are closed
            return [r.token_ids for r in results], live()

        concurrent, after_stop = asyncio.run(caller())
        assert concurrent == blocking
        assert after_stop == before
        assert [b._front for b in client._batchers.values()] == ["stream"]
    finally:
        client.close()
    assert not asyncio.all_tasks(client._loop) and client._loop.is_closed()


async def _aenumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


def test_health_and_session_calls_answer_at_once_while_every_session_has_a_round_in_flight():
    """Each unary round holds a server worker until it is answered, queued and prefill steps
    included. With 2 x --max-batch-size + 8 workers and more sessions than that prefilling,
    health checks, GetStats and CloseSession queued behind their rounds (200 sessions: 6 s, a
    liveness probe's restart of a busy replica). The pool now has a worker per session it
    admits besides: they answer while the rounds are still running."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from client.launcher import start_service

    sessions = 16  # one round each, past the 2 x 1 + 8 + 1 workers of the old pool
    with start_service("verifier", ["--max-batch-size", "1", "--max-streams", "1", "--max-sessions", str(sessions),
                                    "--max-num-batched-tokens", "32", "--log-level", "WARNING"], threads=1) as verifier:
        channel = grpc.insecure_channel(verifier.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.VerifierStub(channel)
        sids = [stub.OpenSession(pb.OpenSessionRequest()).session_id for _ in range(sessions)]
        rounds = [stub.Verify.future(pb.VerifyRequest(session_id=sid, append_token_ids=[100 + i] * 600,
                                                      sampling=pb.SamplingParams(temperature=0.0)), timeout=300)
                  for i, sid in enumerate(sids)]
        try:
            wait_for(lambda: stub.GetStats(pb.StatsRequest(), timeout=60).forwards > 0, 60, "the first prefill step")
            answered = [health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status,
                        stub.GetStats(pb.StatsRequest(), timeout=5).live_sessions,
                        stub.CloseSession(pb.CloseSessionRequest(session_id=sids[-1]), timeout=5)]
            done = sum(r.done() for r in rounds)
            assert answered[:2] == [health_pb2.HealthCheckResponse.SERVING, sessions]
            # Queued behind them, the calls waited for 6 rounds (the 5 rounds queued first, then a worker).
            assert done <= 2, f"the calls answered only after {done} of {sessions} rounds"
        finally:
            for sid in sids[:-1]:  # the rest of their prefills is dropped
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=60)
            for r in rounds:
                r.exception(timeout=60)  # each one ends: answered, or closed in flight
            channel.close()


def test_streams_past_max_streams_are_refused_and_their_clients_send_verifybatch_calls():
    """Each VerifyStream holds a server worker for its life. Idle streams of ten clients took
    every worker of a `--max-batch-size 1` verifier (2 × 1 + 8), after which health checks,
    GetModelInfo and OpenSession all timed out. Streams are now capped (--max-streams) with
    workers of their own: past the cap a stream is refused RESOURCE_EXHAUSTED, the server keeps
    answering, and a batching client falls back to VerifyBatch calls with the same output."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from client.launcher import start_service
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with start_service("verifier", ["--max-batch-size", "1", "--max-streams", "2", "--log-level", "WARNING"],
                       threads=1) as verifier:
        channel = grpc.insecure_channel(verifier.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.VerifierStub(channel)
        outboxes = [queue.SimpleQueue() for _ in range(12)]  # more idle streams than the pool had workers
        streams = [stub.VerifyStream(iter(box.get, None)) for box in outboxes]
        try:
            # Which two are admitted is the server's arrival order, not the order they were opened
            # in: wait for 10 refusals (an admitted stream stays open, and `next` on it would wait).
            wait_for(lambda: sum(s.done() for s in streams) >= 10, 60, "10 streams refused")
            refused = [s for s in streams if s.done()]
            for s in refused:
                assert s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, s.details()
                assert "--max-streams" in s.details()
            time.sleep(0.5)
            assert len(refused) == sum(s.done() for s in streams) == 10  # the other 2 stay open
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with SpeculativeClient(verifier.address, batch_verify=True) as client:
                batched = client.generate("The capital of France is", greedy, target_only=True).token_ids
                assert {b._front for b in client._batchers.values()} == {"batch"}
            with SpeculativeClient(verifier.address) as client:
                assert client.generate("The capital of France is", greedy, target_only=True).token_ids == batched
        finally:
            for box, s in zip(outboxes, streams):
                box.put(None)
                s.cancel()
            channel.close()


def test_a_stream_answers_a_one_step_message_before_an_earlier_message_of_several_steps(stub):
    """Replies come as messages settle (matched by tag): a one-step round sent after a 12-step
    round of another session is answered after its one step, not after the other's twelve."""
    greedy = pb.SamplingParams(temperature=0.0, ignore_eos=True)
    prompt = [1, 504, 2365, 6354, 16438]
    sids, heads = [], []
    for _ in range(2):
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        heads.append(list(stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=greedy,
                                                       prompt_length=len(prompt))).output_token_ids))
        sids.append(sid)
    try:
        messages = [pb.VerifyBatchRequest(tag=1, requests=[pb.VerifyRequest(
                        session_id=sids[0], truncate_to=len(prompt), append_token_ids=heads[0], sampling=greedy,
                        prompt_length=len(prompt), decode_steps=12)]),
                    pb.VerifyBatchRequest(tag=2, requests=[pb.VerifyRequest(
                        session_id=sids[1], truncate_to=len(prompt), append_token_ids=heads[1], sampling=greedy,
                        prompt_length=len(prompt))])]
        replies = list(stub.VerifyStream(iter(messages), timeout=120))
        assert [r.tag for r in replies] == [2, 1]
        by_tag = {r.tag: r.results[0] for r in replies}
        assert [by_tag[t].code for t in (1, 2)] == [0, 0]
        assert len(by_tag[1].response.output_token_ids) == 12 and len(by_tag[2].response.output_token_ids) == 1
        assert by_tag[1].response.output_token_ids[0] == by_tag[2].response.output_token_ids[0]  # same prompt
    finally:
        for sid in sids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
