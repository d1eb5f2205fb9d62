"""`specdec bench verifier`: verifier throughput under concurrent sessions (continuous batching).

Each of C client threads owns one verifier session: it prefills a prompt, then runs
rounds of `Verify(truncate_to=kv_length, append=[last token], drafts=γ random ids)` for a
fixed time. Random drafts make every round cost one (γ+1)-token forward row and emit one
token, so the numbers isolate the verifier: scored tokens/s = rounds × (γ+1) / s. Batch
sizes come from the server's own counters (requests / batches). Concurrency 1 is measured
in the same run and every row reports its throughput relative to it.
"""

from __future__ import annotations

import json
import random
import threading
import time

import grpc
import numpy as np

from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS


def _worker(stub, gamma: int, prompt_len: int, vocab: int, max_context: int, seconds: float, seed: int,
            latencies: list[float], rounds: list[int], index: int, start: threading.Barrier) -> None:
    rng = random.Random(seed)
    greedy = pb.SamplingParams(temperature=0.0)
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
            drafts = [rng.randrange(100, vocab) for _ in range(gamma)]
            t0 = time.perf_counter()
            r = stub.Verify(pb.VerifyRequest(session_id=sid, truncate_to=kv, append_token_ids=[last],
                                             draft_token_ids=drafts, sampling=greedy), timeout=120)
            latencies.append(time.perf_counter() - t0)
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


def run_level(address: str, concurrency: int, gamma: int, prompt_len: int, seconds: float) -> dict:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.VerifierStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=60)
        before = stub.GetStats(pb.StatsRequest(), timeout=10)
        latencies: list[float] = []
        rounds = [0] * concurrency
        errors: list[BaseException] = []
        start = threading.Barrier(concurrency + 1)

        def run(i: int) -> None:
            try:
                _worker(stub, gamma, prompt_len, info.vocab_size, info.max_context, seconds, 1000 + i, latencies,
                        rounds, i, start)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
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
        raise RuntimeError(f"{len(errors)} of {concurrency} workers failed; first: {errors[0]!r}")
    requests = after.requests - before.requests
    batches = max(after.batches - before.batches, 1)
    lat_ms = np.asarray(latencies) * 1000
    total_rounds = sum(rounds)
    return {
        "concurrency": concurrency,
        "gamma": gamma,
        "rounds": total_rounds,
        "duration_s": round(elapsed, 3),
        "rounds_per_s": round(total_rounds / elapsed, 2),
        "scored_tokens_per_s": round(total_rounds * (gamma + 1) / elapsed, 1),
        # requests include each session's prefill; the mean is over everything the server batched
        "mean_batch_size": round(requests / batches, 2),
        "p50_round_ms": round(float(np.percentile(lat_ms, 50)), 1) if len(lat_ms) else None,
        "p99_round_ms": round(float(np.percentile(lat_ms, 99)), 1) if len(lat_ms) else None,
    }


def run(args) -> int:
    from client.launcher import start_service

    levels = [int(x) for x in args.concurrency.split(",") if x]
    if not levels or min(levels) < 1 or args.num_speculative_tokens < 0:
        raise ValueError("--concurrency takes positive integers and --num-speculative-tokens must be >= 0")
    service = None
    address = args.verifier
    if not address:
        extra = ["--max-batch-size", str(args.max_batch_size), "--max-wait-ms", str(args.max_wait_ms),
                 "--log-level", "WARNING"]
        service = start_service("verifier", extra, threads=args.service_threads)
        address = service.address
    try:
        rows = []
        for c in levels:
            rows.append(run_level(address, c, args.num_speculative_tokens, args.prompt_len, args.seconds))
            base = rows[0]["scored_tokens_per_s"]
            r = rows[-1]
            r["speedup_vs_first"] = round(r["scored_tokens_per_s"] / base, 2) if base else None
            ratio = "n/a" if r["speedup_vs_first"] is None else f"x{r['speedup_vs_first']:.2f}"
            print(f"concurrency {c:>3}: {r['scored_tokens_per_s']:>8.1f} scored tok/s  "
                  f"({r['rounds_per_s']:.1f} rounds/s, mean batch {r['mean_batch_size']:.1f}, "
                  f"p50 {r['p50_round_ms']} ms, p99 {r['p99_round_ms']} ms)  {ratio} "
                  f"vs concurrency {levels[0]}", flush=True)
    finally:
        if service is not None:
            service.stop()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"verifier": address, "levels": rows}, fh, indent=2)
    return 0
