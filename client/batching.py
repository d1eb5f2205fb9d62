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
SENDERS = 2  # calls in flight per verifier: the next step's rounds reach the server while this step runs


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
    """Coalesces concurrent `verify` calls to one verifier into VerifyBatch calls."""

    def __init__(self, stub, name: str = "verifier") -> None:
        self._stub = stub
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._unary = False  # the server lacks VerifyBatch
        self._threads = [threading.Thread(target=self._send_loop, name=f"verify-batch-{name}-{i}", daemon=True)
                         for i in range(SENDERS)]
        for t in self._threads:
            t.start()

    def verify(self, request: pb.VerifyRequest, timeout: float) -> pb.VerifyResponse:
        """The reply to `request`, as `stub.Verify(request, timeout=timeout)` would give it;
        a failed round raises a grpc.RpcError with the round's own status code."""
        if len(request.append_token_ids) > UNARY_APPEND_TOKENS or self._closed or self._unary:
            return self._stub.Verify(request, timeout=timeout)
        item = _Pending(request, time.monotonic() + timeout)
        with self._cond:
            self._pending.append(item)
            self._cond.notify()
        return item.future.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                batch, self._pending = self._pending[:MAX_ENTRIES], self._pending[MAX_ENTRIES:]
            self._send(batch)

    def _send(self, batch: list[_Pending]) -> None:
        timeout = max(0.001, max(p.deadline for p in batch) - time.monotonic())
        try:
            reply = self._stub.VerifyBatch(pb.VerifyBatchRequest(requests=[p.request for p in batch]), timeout=timeout)
        except grpc.RpcError as exc:  # the whole call failed (the server is gone, the deadline passed)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the verifier has no VerifyBatch; sending unary Verify calls")
                self._unary = True
                for p in batch:
                    self._send_unary(p)
                return
            for p in batch:
                p.future.set_exception(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - never leave a generation waiting
            log.exception("VerifyBatch failed")
            for p in batch:
                p.future.set_exception(exc)
            return
        for p, result in zip(batch, reply.results):
            if result.code == 0:
                p.future.set_result(result.response)
            else:
                p.future.set_exception(BatchEntryError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message))
        for p in batch[len(reply.results):]:  # a server that answered fewer entries than it was sent
            p.future.set_exception(BatchEntryError(grpc.StatusCode.INTERNAL, "VerifyBatch answered no result for "
                                                                           "this round"))

    def _send_unary(self, p: _Pending) -> None:
        try:
            p.future.set_result(self._stub.Verify(p.request, timeout=max(0.001, p.deadline - time.monotonic())))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            p.future.set_exception(exc)
