"""`specdec bench verifier`: verifier throughput under concurrent sessions (continuous batching).

Each of C client threads owns one verifier session: it prefills a prompt, then runs
rounds of `Verify(truncate_to=kv_length, append=[last token], drafts=γ random ids)` for a
fixed time. Random drafts make every round cost one (γ+1)-token forward row and emit one
token, so the numbers isolate the verifier: scored tokens/s = rounds × (γ+1) / s. Batch
sizes come from the server's own counters (batched rows / batches). Concurrency 1 is measured
in the same run and every row reports its throughput relative to it.

`--front batched`: one client thread carries all C sessions and sends each step's rounds in
one VerifyBatch call (the batched front), instead of C threads with a unary Verify each;
`--front stream`: the same steps as messages of one VerifyStream (no call set-up per step).
`--proposal sparse|dense`: sampled rounds (temperature 1, rejection sampling) whose random
drafts come with a proposal they were drawn from, as a drafter sends it (ids: greedy rounds).

Against the engine: every reply carries the step's device time and rows (EngineLoad), so
each level also reports what the engine's own step allows, engine rows/s = rows per step ×
1000 / device ms per step, and efficiency = rounds/s ÷ engine rows/s: the share of the
engine's rate that the service around it delivers. Host ms = step wall time − device ms.

The floor: before the levels, `--empty-calls` unary grpc.health.v1 Check calls on the same
server (no engine, no session) measure what a call costs on this host by itself; each level
prints the p50 over rounds of (round time − the engine step that served it) beside it, so the
service's own share of a round is read against what gRPC alone takes.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time

import grpc
import numpy as np

from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import SpecDecError
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS
from specdec_rpc.ops import client_security, open_channel


class _Rounds:
    """A session's drafts of a round and what goes with them: greedy ids, or drafts sampled
    from a random distribution with their proposal (`proposal`: ids, sparse or dense). A few
    are made up front and reused, so the client's per-round cost does not depend on the form."""

    VARIANTS = 16

    def __init__(self, proposal: str, gamma: int, vocab: int, rng: random.Random, top_n: int = 64) -> None:
        self.rng, self.vocab, self.gamma = rng, vocab, gamma
        self.sampling = pb.SamplingParams(temperature=0.0 if proposal == "ids" else 1.0)
        self.variants: list[tuple[list[int], pb.Proposal]] = []
        if proposal != "ids" and gamma:
            import torch

            from specdec.proposals import ProposalBuilder, ProposalFormat
            from specdec_rpc.adapters import proposal_to_pb

            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            for _ in range(self.VARIANTS):
                builder = ProposalBuilder(ProposalFormat(kind=proposal, top_n=top_n), vocab)
                probs = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 4, dim=-1)  # [γ, V]
                drafts = [builder.sample(probs[j], rng.random(), 0) for j in range(gamma)]
                self.variants.append((drafts, proposal_to_pb(builder.build())))

    def request(self, sid: str, kv: int, last: int) -> pb.VerifyRequest:
        if not self.variants:
            return pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=[last], sampling=self.sampling,
                                    draft_token_ids=[self.rng.randrange(100, self.vocab) for _ in range(self.gamma)])
        drafts, proposal = self.variants[self.rng.randrange(len(self.variants))]
        return pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=[last], draft_token_ids=drafts,
                                proposal=proposal, sampling=self.sampling)


def _worker(stub, gamma: int, prompt_len: int, vocab: int, max_context: int, seconds: float, seed: int,
            samples: list[tuple], rounds: list[int], index: int, start: threading.Barrier,
            proposal: str = "ids", top_n: int = 64) -> None:
    rng = random.Random(seed)
    greedy = pb.SamplingParams(temperature=0.0)
    made = _Rounds(proposal, gamma, vocab, rng, top_n)
    sid = None
    try:
        sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=60).session_id
        prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        r = stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=greedy), timeout=120)
        kv, last = r.kv_length, r.output_token_ids[-1]
        start.wait(timeout=300)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if kv + 1 + gamma >= max_context:  # keep the context bounded: back to the prompt
                kv, last = prompt_len - 1, prompt[-1]
            request = made.request(sid, kv, last)
            t0 = time.perf_counter()
            r = stub.Verify(request, timeout=120)
            samples.append((time.perf_counter() - t0, r.load))  # paired: one list, so threads never interleave them
            kv, last = r.kv_length, r.output_token_ids[-1]
            rounds[index] += 1  # counted as it goes: a later failure keeps what was measured
    except BaseException:
        start.abort()  # never leave the others (or the main thread) waiting at the barrier
        raise
    finally:
        if sid is not None:
            try:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            except grpc.RpcError:
                pass


def _batched_worker(stub, concurrency: int, gamma: int, prompt_len: int, vocab: int, max_context: int,
                    seconds: float, samples: list[tuple], rounds: list[int],
                    start: threading.Barrier, stream: bool, proposal: str = "ids", top_n: int = 64) -> None:
    """All sessions in one thread: every step is one VerifyBatch of every session's round
    (a call, or a message of one VerifyStream)."""
    rng = random.Random(1000)
    if stream:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        replies = stub.VerifyStream(iter(outbox.get, None))

        def step(batch: pb.VerifyBatchRequest) -> pb.VerifyBatchResponse:
            outbox.put(batch)
            return next(replies)  # one message in flight: replies come in order
    else:
        def step(batch: pb.VerifyBatchRequest) -> pb.VerifyBatchResponse:
            return stub.VerifyBatch(batch, timeout=120)
    greedy = pb.SamplingParams(temperature=0.0)
    made = _Rounds(proposal, gamma, vocab, rng, top_n)
    sids: list[str] = []
    try:
        sids = [stub.OpenSession(pb.OpenSessionRequest(), timeout=60).session_id for _ in range(concurrency)]
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in sids]
        kv, last = [0] * concurrency, [0] * concurrency
        for i, (sid, prompt) in enumerate(zip(sids, prompts)):  # prompts unary: the step loop is what is measured
            r = stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=greedy), timeout=120)
            kv[i], last[i] = r.kv_length, r.output_token_ids[-1]
        start.wait(timeout=300)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = pb.VerifyBatchRequest()
            for i, sid in enumerate(sids):
                if kv[i] + 1 + gamma >= max_context:
                    kv[i], last[i] = prompt_len - 1, prompts[i][-1]
                batch.requests.append(made.request(sid, kv[i], last[i]))
            t0 = time.perf_counter()
            reply = step(batch)
            elapsed = time.perf_counter() - t0
            for i, res in enumerate(reply.results):
                if res.code != 0:
                    raise RuntimeError(f"VerifyBatch entry {i} failed: code {res.code}: {res.message}")
                kv[i], last[i] = res.response.kv_length, res.response.output_token_ids[-1]
                samples.append((elapsed, res.response.load))
            rounds[0] += concurrency
    except BaseException:
        start.abort()
        raise
    finally:
        if stream:
            outbox.put(None)
            replies.cancel()
        for sid in sids:
            try:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            except grpc.RpcError:
                pass


def empty_call_ms(address: str, calls: int, **security) -> float | None:
    """p50 ms of a unary grpc.health.v1 Check on `address`, after a warm-up; None for 0 calls."""
    if calls <= 0:
        return None
    with open_channel(address, options=CHANNEL_OPTIONS, **security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for _ in range(min(calls, 50)):
            stub.Check(request, timeout=10)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.Check(request, timeout=10)
            times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 50)) * 1000


def run_level(address: str, concurrency: int, gamma: int, prompt_len: int, seconds: float,
              front: str = "unary", proposal: str = "ids", top_n: int = 64, **security) -> dict:
    """security: open_channel's tls and auth_token (a verifier with TLS or tokens)."""
    with open_channel(address, options=CHANNEL_OPTIONS, **security) as channel:
        stub = pb_grpc.VerifierStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=60)
        before = stub.GetStats(pb.StatsRequest(), timeout=10)
        samples: list[tuple] = []  # (seconds, EngineLoad of the step that served it), one per round
        rounds = [0] * concurrency
        errors: list[BaseException] = []
        batched = front != "unary"
        start = threading.Barrier((1 if batched else concurrency) + 1)

        def run(i: int) -> None:
            try:
                if batched:
                    _batched_worker(stub, concurrency, gamma, prompt_len, info.vocab_size, info.max_context, seconds,
                                    samples, rounds, start, stream=front == "stream", proposal=proposal, top_n=top_n)
                else:
                    _worker(stub, gamma, prompt_len, info.vocab_size, info.max_context, seconds, 1000 + i, samples,
                            rounds, i, start, proposal=proposal, top_n=top_n)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(1 if batched else concurrency)]
        for t in threads:
            t.start()
        try:
            start.wait(timeout=300)
        except threading.BrokenBarrierError:
            pass
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        after = stub.GetStats(pb.StatsRequest(), timeout=10)
    if errors:
        if isinstance(errors[0], grpc.RpcError):  # a request the verifier refused (γ, prompt length): the user's
            raise SpecDecError(f"{len(errors)} of {concurrency} workers failed; first: "
                               f"{errors[0].code().name}: {errors[0].details()}")
        raise RuntimeError(f"{len(errors)} of {concurrency} workers failed; first: {errors[0]!r}")
    # rows of every batched step (a round of several decode steps is a row of each); an older
    # server without the counter: requests, which each take one step here (no decode_steps)
    rows = after.batched_rows - before.batched_rows or after.requests - before.requests
    batches = max(after.batches - before.batches, 1)
    lat_ms = np.asarray([t for t, _ in samples]) * 1000
    loads = [load for _, load in samples]
    total_rounds = sum(rounds)
    # Per engine step, as the replies saw it (a round-weighted mean over the steps that served them).
    steps_ms = np.asarray([x.step_ms for x in loads])  # one per round: the step that served it
    device_ms = float(np.mean([x.device_ms for x in loads])) if loads else 0.0
    step_ms = float(steps_ms.mean()) if loads else 0.0
    step_rows = float(np.mean([x.step_rows for x in loads])) if loads else 0.0
    rounds_per_s = total_rounds / elapsed
    p50_ms = float(np.percentile(lat_ms, 50)) if len(lat_ms) else None
    # Each round against the step that served it (which ran wholly inside the call, so this is
    # >= 0 round by round); a p50 round against the mean step is not, when step times spread.
    over_ms = lat_ms - steps_ms if loads else None
    engine_rows_per_s = step_rows * 1000 / device_ms if device_ms else None
    return {
        "concurrency": concurrency,
        "gamma": gamma,
        "front": front,
        "proposal": proposal,
        "rounds": total_rounds,
        "duration_s": round(elapsed, 3),
        "rounds_per_s": round(rounds_per_s, 2),
        "scored_tokens_per_s": round(total_rounds * (gamma + 1) / elapsed, 1),
        # rows include each session's prefill; the mean is over everything the server batched
        "mean_batch_size": round(rows / batches, 2),
        "p50_round_ms": round(p50_ms, 2) if p50_ms is not None else None,
        "p99_round_ms": round(float(np.percentile(lat_ms, 99)), 2) if len(lat_ms) else None,
        # the tail a stall of every session in flight (a full garbage collection) shows in
        "p999_round_ms": round(float(np.percentile(lat_ms, 99.9)), 2) if len(lat_ms) else None,
        "max_round_ms": round(float(np.max(lat_ms)), 2) if len(lat_ms) else None,
        # what a round costs beyond the engine step that served it (gRPC both ways, queueing, replies)
        "p50_over_step_ms": round(float(np.percentile(over_ms, 50)), 3) if over_ms is not None else None,
        "mean_step_ms": round(step_ms, 3),
        "mean_device_ms": round(device_ms, 3),
        "mean_host_ms": round(max(step_ms - device_ms, 0.0), 3),
        "mean_step_rows": round(step_rows, 2),
        "host_ms_per_row": round(max(step_ms - device_ms, 0.0) / step_rows, 4) if step_rows else None,
        # what the engine's own step allows at this batch, and the share of it the service delivers
        "engine_rows_per_s": round(engine_rows_per_s, 1) if engine_rows_per_s else None,
        "efficiency": round(rounds_per_s / engine_rows_per_s, 3) if engine_rows_per_s else None,
    }


def run(args) -> int:
    from client.launcher import start_service

    levels = args.concurrency
    if args.num_speculative_tokens < 0:
        raise ValueError("--num-speculative-tokens must be >= 0")
    service = None
    address = args.verifier
    if not address:
        extra = ["--max-batch-size", str(args.max_batch_size), "--max-wait-ms", str(args.max_wait_ms),
                 "--log-level", "WARNING"]
        service = start_service("verifier", extra, threads=args.service_threads)
        address = service.address
    tls, auth_token = client_security(args)
    security = dict(tls=tls, auth_token=auth_token)
    try:
        floor_ms = empty_call_ms(address, args.empty_calls, **security)
        if floor_ms is not None:
            print(f"empty call (grpc.health.v1 Check, {args.empty_calls} calls): p50 {floor_ms:.3f} ms", flush=True)
        rows = []
        for c in levels:
            rows.append(run_level(address, c, args.num_speculative_tokens, args.prompt_len, args.seconds,
                                  front=args.front, proposal=args.proposal, top_n=args.top_n, **security))
            base = rows[0]["scored_tokens_per_s"]
            r = rows[-1]
            r["speedup_vs_first"] = round(r["scored_tokens_per_s"] / base, 2) if base else None
            ratio = "n/a" if r["speedup_vs_first"] is None else f"x{r['speedup_vs_first']:.2f}"
            print(f"concurrency {c:>3}: {r['scored_tokens_per_s']:>8.1f} scored tok/s  "
                  f"({r['rounds_per_s']:.1f} rounds/s, mean batch {r['mean_batch_size']:.1f}, "
                  f"p50 {r['p50_round_ms']} ms, p99 {r['p99_round_ms']} ms, p99.9 {r['p999_round_ms']} ms, "
                  f"max {r['max_round_ms']} ms)  {ratio} "
                  f"vs concurrency {levels[0]}", flush=True)
            eff = "n/a" if r["efficiency"] is None else f"{r['efficiency']:.0%}"
            print(f"                 step {r['mean_step_ms']:.2f} ms = device {r['mean_device_ms']:.2f} + host "
                  f"{r['mean_host_ms']:.2f} ms ({r['mean_step_rows']:.1f} rows); engine allows "
                  f"{r['engine_rows_per_s'] or 0:.0f} rows/s; efficiency {eff}", flush=True)
            if r["p50_over_step_ms"] is not None:
                floor = "" if floor_ms is None else f" (an empty call: {floor_ms:.2f} ms)"
                print(f"                 p50 round = its step + {r['p50_over_step_ms']:.2f} ms{floor}", flush=True)
    finally:
        if service is not None:
            service.stop()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"verifier": address, "empty_call_p50_ms": floor_ms, "levels": rows}, fh, indent=2)
    return 0
