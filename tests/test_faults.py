"""Faults on real processes: a drafter killed mid-generation, a verifier restarted
mid-generation, and a fuzzer of malformed requests. The client's committed tokens are the
source of truth, so greedy outputs must come out token-identical to target-only decoding."""

from __future__ import annotations

import collections
import random
import struct
import threading
import time

import grpc
import pytest

from client.launcher import ServiceProcess, start_service, start_services
from client.speculative import GenerationResult, SpeculativeClient
from specdec.sampling import SamplingParams
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from tests.conftest import stream_concurrently, target_only_outputs, wait_for

pytestmark = pytest.mark.slow
ARGS = ["--max-draft-tokens", "8", "--log-level", "WARNING"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n", "Water boils at", "My favourite book is",
           "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _port(svc: ServiceProcess) -> int:
    return int(svc.address.rsplit(":", 1)[1])


def test_drafter_killed_during_8_generations_they_finish_target_only_and_speculation_resumes():
    verifier, drafter = start_services([("verifier", ARGS), ("drafter", ARGS)], threads=1)
    restarted = None
    try:
        with SpeculativeClient(verifier.address, drafter=drafter.address) as client:
            expected = target_only_outputs(client, PROMPTS, GREEDY)
            progress: collections.Counter = collections.Counter()
            results, threads = stream_concurrently(client, [(p, GREEDY) for p in PROMPTS], progress)
            # Kill once every generation has committed two rounds (the first never drafts), i.e.
            # all are mid-generation and have speculated.
            wait_for(lambda: len(progress) == len(PROMPTS) and min(progress.values()) >= 2, 120,
                     "two rounds of every generation")
            drafter.kill()  # SIGKILL
            for t in threads:
                t.join(180)
            assert all(isinstance(r, GenerationResult) for r in results), results
            assert [r.token_ids for r in results] == expected
            cut_off = [r for r in results if r.drafter_fallback_rounds > 0]
            assert cut_off, "no generation was still running when the drafter died"
            assert all(r.drafter_failures >= 1 for r in cut_off)
            assert sum(r.num_draft_tokens for r in results) > 0  # they speculated before the kill
            print(f"drafter kill: {len(cut_off)}/{len(results)} generations fell back; fallback rounds "
                  f"{[r.drafter_fallback_rounds for r in results]}; tokens compared {sum(map(len, expected))}")

            restarted = start_service("drafter", ARGS, port=_port(drafter), threads=1)
            later = None
            for _ in range(20):  # the client's channel reconnects within its 2 s backoff cap
                later = client.generate(PROMPTS[0], GREEDY, num_speculative_tokens=4)
                if later.num_draft_tokens > 0:
                    break
                time.sleep(0.5)
            assert later.num_draft_tokens > 0 and later.num_accepted_tokens > 0
            assert later.token_ids == expected[0]
    finally:
        for svc in (restarted, drafter, verifier):
            if svc is not None:
                svc.kill()


@pytest.mark.parametrize("batch_verify", [False, True], ids=["unary", "stream"])
def test_verifier_restarted_mid_generation_generations_complete_with_the_greedy_output(batch_verify):
    """With batch_verify the decode rounds ride one VerifyStream: the kill breaks it, its rounds
    fail UNAVAILABLE and recover as unary ones do, and the next steps open a new stream."""
    verifier, drafter = start_services([("verifier", ARGS), ("drafter", ARGS)], threads=1)
    restarted = None
    prompts = PROMPTS[:4]
    try:
        with SpeculativeClient(verifier.address, drafter=drafter.address, recovery_timeout_s=240,
                               batch_verify=batch_verify) as client:
            expected = target_only_outputs(client, prompts, GREEDY)
            progress: collections.Counter = collections.Counter()
            results, threads = stream_concurrently(client, [(p, GREEDY) for p in prompts], progress)
            wait_for(lambda: len(progress) == len(prompts), 120, "a first round of every generation")
            verifier.kill()
            restarted = start_service("verifier", ARGS, port=_port(verifier), threads=1)
            for t in threads:
                t.join(300)
            assert all(isinstance(r, GenerationResult) for r in results), results
            assert [r.token_ids for r in results] == expected
            recovered = [r for r in results if r.verifier_recoveries > 0]
            assert recovered, "no generation was still running when the verifier died"
            assert all(r.num_draft_tokens > 0 for r in results)  # the drafter kept drafting throughout
            assert [b._front for b in (client._batchers or {}).values()] == (["stream"] if batch_verify else [])
            print(f"verifier restart: recoveries {[r.verifier_recoveries for r in results]}; "
                  f"tokens compared {sum(map(len, expected))}")
    finally:
        for svc in (restarted, drafter, verifier):
            if svc is not None:
                svc.kill()


# ---- fuzzing -----------------------------------------------------------------------------

EXPECTED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB = 49152
INT32 = (-2**31, -1, 0, 1, 2**31 - 1)


class Fuzzer:
    """Malformed Draft / Verify / CloseSession requests from a seeded generator. A few are
    well-formed by chance (valid session, small lengths); they are answered OK."""

    def __init__(self, seed: int, sessions: dict[str, list[str]]) -> None:
        self.rng = random.Random(seed)
        self.sessions = sessions  # role -> ids of sessions this fuzzer owns

    def session_id(self, role: str) -> str:
        r = self.rng.random()
        if r < 0.45:
            return self.rng.choice(self.sessions[role])
        other = "verifier" if role == "drafter" else "drafter"
        return self.rng.choice([
            "", "x", self.rng.choice(self.sessions[other]), "\u00e9\u0000\ud7ff" * 3, "a" * 10_000,
            self.rng.choice(self.sessions[role])[:-1] + "A", "".join(self.rng.choices("abcXYZ019-_", k=24)),
        ])

    def int_(self, small: int) -> int:
        return self.rng.choice([self.rng.randint(-3, small), self.rng.randint(0, small), *INT32, 2**40, -2**40])

    def ids(self, n_max: int = 24) -> list[int]:
        r = self.rng.random()
        if r < 0.1:
            return []
        if r < 0.15:
            return [self.rng.randrange(VOCAB) for _ in range(self.rng.choice([3000, 9000]))]  # > max context
        ids = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, n_max))]
        if self.rng.random() < 0.4:
            ids[self.rng.randrange(len(ids))] = self.rng.choice([-1, VOCAB, VOCAB + 7, *INT32])
        return ids

    def float_(self, typical: float) -> float:
        return self.rng.choice([typical, 0.0, -1.0, 1e30, -1e-30, float("nan"), float("inf"), -float("inf"),
                                self.rng.uniform(-3, 3)])

    def sampling(self) -> pb.SamplingParams:
        msg = pb.SamplingParams()
        rng = self.rng
        if rng.random() < 0.3:
            return pb.SamplingParams(temperature=0.0)
        for name, typical in (("temperature", 0.8), ("top_p", 0.9), ("min_p", 0.05), ("repetition_penalty", 1.1),
                              ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("posterior_threshold", 0.09),
                              ("posterior_alpha", 0.3)):
            if rng.random() < 0.3:
                setattr(msg, name, self.float_(typical))
        for name in ("top_k", "min_tokens", "logprobs"):
            if rng.random() < 0.2:
                setattr(msg, name, rng.choice([*INT32, rng.randint(0, 100), 10**6]))
        if rng.random() < 0.2:
            msg.seed = rng.choice([0, 1, 2**64 - 1, rng.getrandbits(64)])
        if rng.random() < 0.15:
            msg.stop_token_ids.extend(self.ids(4))
        if rng.random() < 0.15:
            msg.acceptance_method = rng.choice([0, 1, 2, 3, 4, 99, -5])
        if rng.random() < 0.1:
            msg.ignore_eos = True
        return msg

    def proposal(self, k: int) -> pb.Proposal:
        rng = self.rng
        kind = rng.choice([pb.DENSE, pb.SPARSE_TOP_N, pb.IDS_ONLY, 0, 9, -3])
        dtype = rng.choice([pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, 0, 42])
        width = rng.choice([VOCAB, 8, 64, 0, VOCAB + 1])
        shape = rng.choice([[k, width], [k], [], [k + 1, width], [-1, width], [k, width, 2], [2**40, 2**40]])
        itemsize = 4 if dtype in (pb.FLOAT32, 0, 42) else 2
        n = max(0, k * width) if rng.random() < 0.6 else rng.randint(0, 5000)
        n = min(n, 4 * VOCAB)
        if rng.random() < 0.5:
            probs = rng.randbytes(n * itemsize)
        else:  # a plausible uniform distribution, right or wrong for the declared dtype and shape
            probs = struct.pack(f"<{n}f", *([1.0 / max(1, width)] * n))
        token_ids = rng.randbytes(rng.choice([0, 3, 12, min(n * 4, 200_000)]))
        return pb.Proposal(kind=kind, dtype=dtype, shape=shape, probs=probs, token_ids=token_ids)

    def request(self):
        """(role, method name, request message)."""
        rng = self.rng
        r = rng.random()
        if r < 0.05:
            role = rng.choice(["drafter", "verifier"])
            return role, "CloseSession", pb.CloseSessionRequest(session_id=self.session_id(role))
        if r < 0.5:
            fmt = pb.ProposalFormat(kind=rng.choice([0, 1, 2, 3, 7, -1]), dtype=rng.choice([0, 1, 2, 3, 9]),
                                    top_n=rng.choice([0, 1, 64, -5, VOCAB, 2**31 - 1]))
            return "drafter", "Draft", pb.DraftRequest(
                session_id=self.session_id("drafter"), truncate_to=self.int_(24), append_token_ids=self.ids(),
                num_draft_tokens=rng.choice([-1, 0, 1, 3, 8, 9, 1000, *INT32]), sampling=self.sampling(),
                proposal_format=fmt, prompt_length=self.int_(24))
        drafts = self.ids(12) if rng.random() < 0.7 else []
        req = pb.VerifyRequest(session_id=self.session_id("verifier"), truncate_to=self.int_(24),
                               append_token_ids=self.ids(), draft_token_ids=drafts, sampling=self.sampling(),
                               prompt_length=self.int_(24))
        if rng.random() < 0.7:
            req.proposal.CopyFrom(self.proposal(len(drafts)))
        return "verifier", "Verify", req


def test_fuzzed_malformed_requests_get_expected_codes_and_do_not_disturb_a_generation():
    """>= 1,000 malformed requests (fixed seeds) from two threads while a well-formed greedy
    generation runs: every error is one of EXPECTED_ERRORS (never INTERNAL / UNKNOWN), the
    servers stay up, and the generation is token-identical to the same one run alone. Bytes
    that are no protobuf at all get INVALID_ARGUMENT naming the method, on unary calls and as
    a stream's status."""
    verifier, drafter = start_services([("verifier", ARGS), ("drafter", ARGS)], threads=1)
    try:
        channels = {"verifier": grpc.insecure_channel(verifier.address),
                    "drafter": grpc.insecure_channel(drafter.address)}
        stubs = {"verifier": pb_grpc.VerifierStub(channels["verifier"]),
                 "drafter": pb_grpc.DrafterStub(channels["drafter"])}
        with SpeculativeClient(verifier.address, drafter=drafter.address) as client:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            alone = client.generate(PROMPTS[1], params, num_speculative_tokens=4)
            concurrent: dict = {}

            def well_formed() -> None:
                concurrent["result"] = client.generate(PROMPTS[1], params, num_speculative_tokens=4)

            codes: collections.Counter = collections.Counter()
            unexpected: list[str] = []
            lock = threading.Lock()

            def fuzz(seed: int, n: int) -> None:
                sessions = {role: [stubs[role].OpenSession(pb.OpenSessionRequest(), timeout=30).session_id
                                   for _ in range(3)] for role in stubs}
                fuzzer = Fuzzer(seed, sessions)
                for i in range(n):
                    role, method, req = fuzzer.request()
                    try:
                        getattr(stubs[role], method)(req, timeout=60)
                        code = grpc.StatusCode.OK
                    except grpc.RpcError as exc:
                        code = exc.code()
                        if code not in EXPECTED_ERRORS:
                            with lock:
                                unexpected.append(f"seed={seed} i={i} {role}.{method} {code.name} "
                                                  f"{exc.details()!r} request={str(req)[:400]!r}")
                    with lock:
                        codes[code.name] += 1
                    if method == "CloseSession" and code == grpc.StatusCode.OK:  # keep sessions to abuse
                        sessions[role][sessions[role].index(req.session_id)] = stubs[role].OpenSession(
                            pb.OpenSessionRequest(), timeout=30).session_id

            gen = threading.Thread(target=well_formed)
            fuzzers = [threading.Thread(target=fuzz, args=(seed, 520)) for seed in (1234, 5678)]
            for t in [gen, *fuzzers]:
                t.start()
            for t in [gen, *fuzzers]:
                t.join(600)
        print(f"fuzz replies: {dict(codes)}")
        assert sum(codes.values()) >= 1000
        assert not unexpected, unexpected[:5]
        garbage = b"\xff\xff\xff\xff"  # a truncated varint tag: no message of any type parses it
        identity = dict(request_serializer=None, response_deserializer=None)
        for role, method in (("verifier", "Verify"), ("verifier", "VerifyBatch"), ("verifier", "OpenSession"),
                             ("drafter", "Draft"), ("drafter", "CloseSession")):
            call = channels[role].unary_unary(f"/specdec.v1.{role.capitalize()}/{method}", **identity)
            with pytest.raises(grpc.RpcError) as err:
                call(garbage, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
            assert f"the {method} request is no valid protobuf message" in err.value.details()
        stream = channels["verifier"].stream_stream("/specdec.v1.Verifier/VerifyStream", **identity)
        replies = stream(iter([pb.VerifyBatchRequest(tag=7).SerializeToString(), garbage]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "VerifyStream request is no valid protobuf message" in err.value.details()
        assert verifier.proc.poll() is None and drafter.proc.poll() is None
        for role, stub in stubs.items():  # still serving
            assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).role == role
        assert concurrent["result"].token_ids == alone.token_ids
        for ch in channels.values():
            ch.close()
    finally:
        verifier.kill()
        drafter.kill()


class _FailingDrafter(pb_grpc.DrafterServicer):
    """A drafter that fails on its own after a few Drafts (INTERNAL, as a model it cannot
    serve does): a real drafter behind it answers everything else."""

    def __init__(self, upstream: str, good_drafts: int) -> None:
        self._channel = grpc.insecure_channel(upstream)
        self._stub = pb_grpc.DrafterStub(self._channel)
        self.good_drafts = good_drafts
        self.failed = 0

    def GetModelInfo(self, request, context):
        return self._stub.GetModelInfo(request)

    def OpenSession(self, request, context):
        return self._stub.OpenSession(request)

    def CloseSession(self, request, context):
        return self._stub.CloseSession(request)

    def Draft(self, request, context):
        if self.good_drafts > 0:
            self.good_drafts -= 1
            return self._stub.Draft(request)
        self.failed += 1
        context.abort(grpc.StatusCode.INTERNAL, "Draft failed on the server; see its log")


def test_a_drafter_that_fails_internally_falls_back_to_target_only_rounds(verifier_proc, drafter_proc):
    """A drafter's own failure (INTERNAL) mid-generation: the rounds go on without drafts and
    the greedy output is target-only's; it failed the whole generation before, although the
    drafter is optional."""
    from concurrent import futures

    proxy = _FailingDrafter(drafter_proc.address, good_drafts=3)
    before = proxy._stub.GetStats(pb.StatsRequest()).live_sessions
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_DrafterServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with SpeculativeClient(verifier_proc.address, drafter=f"127.0.0.1:{port}") as client:
            expected = client.generate(PROMPTS[0], GREEDY, target_only=True).token_ids
            result = client.generate(PROMPTS[0], GREEDY, num_speculative_tokens=4)
        assert result.token_ids == expected
        assert proxy.failed >= 1 and result.drafter_failures >= 1 and result.drafter_fallback_rounds >= 1
        assert result.num_accepted_tokens > 0  # the drafts before the failure were used
        # The session the failing drafter may still hold is closed, not left for its TTL.
        wait_for(lambda: proxy._stub.GetStats(pb.StatsRequest()).live_sessions == before, 10,
                 "the failed drafter's sessions to close")
    finally:
        server.stop(0)
        proxy._channel.close()


def test_a_session_opened_after_its_caller_gave_up_is_closed_at_once(target_lm):
    """An OpenSession that queued on a busy server past its caller's deadline: the id reaches no
    one, so the server closes the session instead of holding its KV until the TTL (a hunt with
    a 1-2 ms timeout_s under load left 17 of 22 such sessions open). The busy server is made
    by holding its admission lock while the call waits."""
    from specdec.serving import EngineConfig
    from verifier_service.engine import VerifierEngine
    from verifier_service.server import start

    engine = VerifierEngine(target_lm.spec, EngineConfig(speculation_slots=0), lm=target_lm)
    server, port = start(engine, announce=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.VerifierStub(channel)
            with engine.sessions._admission:  # every open waits here, as behind a long admission
                # A deadline long enough for the server to read the call and start its handler
                # on a loaded host: gRPC runs no handler for a call that expired before that (0.3 s
                # failed a CI run that way).
                with pytest.raises(grpc.RpcError) as late:
                    stub.OpenSession(pb.OpenSessionRequest(), timeout=3.0)
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                time.sleep(0.2)  # the server's copy of the deadline (from the call's arrival) passes too
            # The handler goes on once admission is free: it opens the session, finds its caller
            # gone and closes it (the store remembers it as closed, not expired).
            wait_for(lambda: len(engine.sessions._gone) == 1, 10, "the late session to be opened and closed")
            assert len(engine.sessions) == 0 and list(engine.sessions._gone.values()) == ["closed"]
            opened = stub.OpenSession(pb.OpenSessionRequest(), timeout=10)  # a caller that waits keeps its session
            assert stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions == 1
            stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10)
    finally:
        server.stop(0)
        engine.shutdown()
