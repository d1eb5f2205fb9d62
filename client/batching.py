"""Client-side batching of Verify rounds: the generations of one client that share a verifier
send their rounds together, one VerifyBatch call per step instead of one Verify call each.

The server then parses, validates and answers a whole step in one call, and runs one handler
thread for it instead of one per session (on a CPU, dozens of handler threads contending for
the interpreter lock with the engine thread cost more than the model step). Each generation
thread still calls `verify(request)` and blocks for its own reply, so the round loop in
client/speculative.py is unchanged: only the transport differs.

Rounds that append a prompt (or any long catch-up) go as unary calls: a batch is answered
when its last entry is done, and a chunked prefill takes several engine steps, which would
hold back every decode round batched with it. A verifier that does not know VerifyBatch (an
older release: UNIMPLEMENTED) is served with unary calls from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from specdec_rpc import specdec_pb2 as pb

log = logging.getLogger(__name__)

UNARY_APPEND_TOKENS = 16  # rounds appending more than this go unary (prompts, long catch-ups)
MAX_ENTRIES = 256  # entries per VerifyBatch call
# How long a batch waits for the rest of this client's generations: a tenth of a recent
# call's latency, within these bounds (a GPU round of ~3 ms lingers 0.3 ms, a CPU one of 45 ms 4.5 ms).
LINGER_SHARE = 0.1
LINGER_BOUNDS_S = (0.0002, 0.005)


class BatchEntryError(grpc.RpcError):
    """One entry of a VerifyBatch failed: the status a unary Verify would have raised."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass
class _Pending:
    request: pb.VerifyRequest
    deadline: float  # time.monotonic()
    future: Future = field(default_factory=Future)


class VerifyBatcher:
    """Coalesces concurrent `verify` calls to one verifier into VerifyBatch calls.

    No sender thread and no cap on calls in flight: the first round to arrive while no batch
    is being gathered leads one. It waits until every generation this client runs on the
    verifier has sent its round (`expected`), or a tenth of a call's recent latency (whichever
    comes first: a generation that is drafting or prefilling costs at most that), then sends
    the batch from its own thread and hands out the replies. A round never waits for an
    earlier call to come back (with two sender threads, rounds queued behind calls in flight
    and reached the engine a step late: concurrency 4 on the embedded pair ran at 48 tok/s
    against 84 unary; now 80-86, four rounds a call)."""

    def __init__(self, stub, name: str = "verifier") -> None:
        self._stub = stub
        self._name = name
        self._pending: list[_Pending] = []
        self._gathering = False  # a leader is gathering `_pending`
        self._cond = threading.Condition()
        self._unary = False  # the server lacks VerifyBatch
        self._latency_s = 0.0  # decayed latency of recent calls

    def verify(self, request: pb.VerifyRequest, timeout: float, expected: int = 1) -> pb.VerifyResponse:
        """The reply to `request`, as `stub.Verify(request, timeout=timeout)` would give it;
        a failed round raises a grpc.RpcError with the round's own status code. expected:
        this client's generations running on the verifier (the rounds worth waiting for)."""
        if len(request.append_token_ids) > UNARY_APPEND_TOKENS or self._unary:
            return self._stub.Verify(request, timeout=timeout)
        item = _Pending(request, time.monotonic() + timeout)
        with self._cond:
            self._pending.append(item)
            lead = not self._gathering
            if lead:
                self._gathering = True
                linger = min(max(LINGER_SHARE * self._latency_s, LINGER_BOUNDS_S[0]), LINGER_BOUNDS_S[1])
                deadline = time.monotonic() + linger
                while len(self._pending) < min(expected, MAX_ENTRIES):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending, self._gathering = self._pending, [], False
            else:
                self._cond.notify_all()  # the leader counts arrivals
        if lead:
            for i in range(0, len(batch), MAX_ENTRIES):
                self._send(batch[i:i + MAX_ENTRIES])
        return item.future.result()

    def close(self) -> None:
        """Nothing to stop: calls in flight belong to their callers' threads."""

    def _send(self, batch: list[_Pending]) -> None:
        start = time.monotonic()
        timeout = max(0.001, max(p.deadline for p in batch) - start)
        try:
            reply = self._stub.VerifyBatch(pb.VerifyBatchRequest(requests=[p.request for p in batch]), timeout=timeout)
        except grpc.RpcError as exc:  # the whole call failed (the server is gone, the deadline passed)
            self._returned(start)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("verifier %s has no VerifyBatch; sending unary Verify calls", self._name)
                self._unary = True
                for p in batch:
                    self._send_unary(p)
                return
            for p in batch:
                p.future.set_exception(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - never leave a generation waiting
            self._returned(start)
            log.exception("VerifyBatch failed")
            for p in batch:
                p.future.set_exception(exc)
            return
        self._returned(start)
        for p, result in zip(batch, reply.results):
            if result.code == 0:
                p.future.set_result(result.response)
            else:
                p.future.set_exception(BatchEntryError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message))
        for p in batch[len(reply.results):]:  # a server that answered fewer entries than it was sent
            p.future.set_exception(BatchEntryError(grpc.StatusCode.INTERNAL,
                                                   "VerifyBatch answered no result for this round"))

    def _returned(self, start: float) -> None:
        with self._cond:  # the latency a leader's linger is a share of
            self._latency_s = 0.8 * self._latency_s + 0.2 * (time.monotonic() - start)

    def _send_unary(self, p: _Pending) -> None:
        try:
            p.future.set_result(self._stub.Verify(p.request, timeout=max(0.001, p.deadline - time.monotonic())))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            p.future.set_exception(exc)
