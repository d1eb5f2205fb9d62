"""Client-side batching of Verify rounds: the generations of one client that share a verifier
send their rounds together, one message per step instead of one Verify call each.

The server then parses, validates and answers a whole step at once, and runs one handler
thread for it instead of one per session (on a CPU, dozens of handler threads contending for
the interpreter lock with the engine thread cost more than the model step). Each generation
awaits `verify(request)` for its own reply, so the round loop in client/speculative.py is
unchanged: only the transport differs. Everything here runs on the client's event loop.

The steps travel as messages of one long-lived VerifyStream per verifier, which saves a call's
set-up on both sides every step (a round at concurrency 1 on a 2-core CPU: its step + 0.65 ms,
against + 0.98 ms with a VerifyBatch call a step). A verifier that does not know VerifyStream
(an older release: UNIMPLEMENTED) gets VerifyBatch calls, and one that knows neither unary
Verify calls, from then on. A stream that ends or breaks fails the rounds it had not answered
with its status (UNAVAILABLE when the server just ended it, as a draining one does), which the
round loop recovers from as from a failed call; the next step opens a new stream.

Rounds that append a prompt (or any long catch-up) go as unary calls: a batch is answered
when its last entry is done, and a chunked prefill takes several engine steps, which would
hold back every decode round batched with it. For the same reason rounds of several decode
steps (`decode_steps` > 1) travel in messages of their own, apart from one-step rounds (the
server answers messages as they settle).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from specdec_rpc import specdec_pb2 as pb

log = logging.getLogger(__name__)

STREAM_RETRY_S = 60.0  # after a stream that broke before its first answer (see _stream_ended)
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


@dataclass(slots=True)
class _Pending:
    request: pb.VerifyRequest
    deadline: float  # time.monotonic()
    future: asyncio.Future


class VerifyBatcher:
    """Coalesces concurrent `verify` calls to one verifier (a `grpc.aio` stub) into one message
    per step.

    No sender task and no cap on steps in flight: a step goes out once every generation this
    client runs on the verifier has sent its round (`expected`), or a tenth of a step's recent
    latency after its first round (whichever comes first: a generation that is drafting or
    prefilling costs at most that), and every round waits for its own reply. A round never waits
    for an earlier step to come back (rounds queued behind calls in flight reach the engine a
    step late: concurrency 4 on the embedded pair ran at 48 tok/s against 84 unary)."""

    def __init__(self, stub, name: str = "verifier", metadata: tuple = ()) -> None:
        self._stub = stub
        self._name = name
        self._metadata = metadata  # VerifyStream's (a bearer token); the channel adds it to unary calls
        # Rounds waiting for the step's message, apart by how many engine steps they take: a
        # message is answered when its last round is, so one-step rounds never share one with
        # rounds of several steps.
        self._pending: dict[bool, list[_Pending]] = {False: [], True: []}
        self._linger: asyncio.TimerHandle | None = None  # sends `_pending` when it fires
        self._front = "stream"  # then "batch" (no VerifyStream) or "unary" (no VerifyBatch either)
        self._stream_again_at: float | None = None  # "batch" for a while only: the stream broke at once
        self._stream: _Stream | None = None
        self._latency_s = 0.0  # decayed latency of recent steps
        self._calls: set[asyncio.Task] = set()  # VerifyBatch / unary fallbacks in flight
        self._loop: asyncio.AbstractEventLoop | None = None  # the client's, from the first round on

    async def verify(self, request: pb.VerifyRequest, timeout: float, expected: int = 1) -> pb.VerifyResponse:
        """The reply to `request`, as `await stub.Verify(request, timeout=timeout)` would give it;
        a failed round raises a grpc.RpcError with the round's own status code. expected:
        this client's generations running on the verifier (the rounds worth waiting for)."""
        if len(request.append_token_ids) > UNARY_APPEND_TOKENS or self._front == "unary":
            return await self._stub.Verify(request, timeout=timeout)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        item = _Pending(request, time.monotonic() + timeout, loop.create_future())
        self._pending[request.decode_steps > 1].append(item)
        if sum(map(len, self._pending.values())) >= min(expected, MAX_ENTRIES):
            self._flush()
        elif self._linger is None:
            linger = min(max(LINGER_SHARE * self._latency_s, LINGER_BOUNDS_S[0]), LINGER_BOUNDS_S[1])
            self._linger = loop.call_later(linger, self._flush)
        # A stream has no deadline of its own: the round's is kept here. A round that times out
        # (or whose caller is cancelled) is done, so the step's reply skips it.
        expiry = loop.call_later(timeout, self._expire, item, timeout)
        try:
            return await item.future
        finally:
            expiry.cancel()

    def close(self) -> None:
        """End the stream: rounds still waiting on it fail CANCELLED (the server finishes their
        steps and lets their sessions go)."""
        self._cancel_linger()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        for task in list(self._calls):
            task.cancel()

    def _expire(self, item: _Pending, timeout: float) -> None:
        _fail(item, BatchEntryError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no reply from verifier {self._name} within {timeout:.1f} s"))

    def _cancel_linger(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def _flush(self) -> None:
        self._cancel_linger()
        for kind in self._pending:
            batch, self._pending[kind] = self._pending[kind], []
            for i in range(0, len(batch), MAX_ENTRIES):
                self._send(batch[i:i + MAX_ENTRIES])

    def _send(self, batch: list[_Pending]) -> None:
        if self._stream_again_at is not None and time.monotonic() >= self._stream_again_at:
            self._front, self._stream_again_at = "stream", None
        if self._front == "stream":
            if self._stream is None or self._stream.ended:
                self._stream = _Stream(self._stub, self._name, self._stream_ended, self._returned, self._metadata)
            if self._stream.send(batch):
                return
        self._spawn(self._call(batch))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _stream_ended(self, unanswered: list[list[_Pending]], exc: grpc.RpcError | None, answered: bool) -> None:
        """The stream's reader: `unanswered` steps fail with the stream's status, except on a
        server without VerifyStream, whose steps go as VerifyBatch calls from now on."""
        if exc is not None and exc.code() == grpc.StatusCode.UNIMPLEMENTED and not answered:
            log.warning("verifier %s has no VerifyStream; sending VerifyBatch calls", self._name)
            self._front = "batch"
            for batch in unanswered:
                self._spawn(self._call(batch))
            return
        if exc is not None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not answered:
            # The verifier serves as many streams as it has workers for (--max-streams): this
            # client's steps go as VerifyBatch calls, and a stream is tried again in a minute.
            log.info("verifier %s refused a VerifyStream (%s); VerifyBatch calls for a while", self._name,
                     exc.details())
            self._front, self._stream_again_at = "batch", time.monotonic() + STREAM_RETRY_S
            for batch in unanswered:
                self._spawn(self._call(batch))
            return
        if exc is not None and exc.code() == grpc.StatusCode.INTERNAL and not answered and self._front == "stream":
            # A first write racing a server that ends the call at once (no VerifyStream: UNIMPLEMENTED)
            # can come back as INTERNAL "Failed execute_batch" instead. Its steps go as VerifyBatch
            # calls, which say what the server knows, and the stream is tried again in a minute.
            log.info("verifier %s ended VerifyStream before answering (%s); VerifyBatch calls for a while",
                     self._name, exc.details())
            self._front, self._stream_again_at = "batch", time.monotonic() + STREAM_RETRY_S
            for batch in unanswered:
                self._spawn(self._call(batch))
            return
        if exc is None:
            exc = BatchEntryError(grpc.StatusCode.UNAVAILABLE, f"verifier {self._name} ended the stream")
        elif exc.code() == grpc.StatusCode.INTERNAL:
            # A round's own errors come in its entry of a reply; the stream itself ends INTERNAL when
            # its transport breaks, e.g. a write racing a server that is shutting down ("Internal
            # error from Core", grpc/grpc#36066). The rounds are retried as after UNAVAILABLE, on the
            # pool, instead of failing their generations.
            exc = BatchEntryError(grpc.StatusCode.UNAVAILABLE, f"verifier {self._name}'s stream broke: "
                                                               f"INTERNAL: {exc.details()}")
        for batch in unanswered:
            for p in batch:
                _fail(p, exc)

    async def _call(self, batch: list[_Pending]) -> None:
        if self._front == "unary":
            await asyncio.gather(*(self._send_unary(p) for p in batch))
            return
        start = time.monotonic()
        timeout = max(0.001, max(p.deadline for p in batch) - start)
        try:
            reply = await self._stub.VerifyBatch(pb.VerifyBatchRequest(requests=[p.request for p in batch]),
                                                 timeout=timeout)
        except grpc.RpcError as exc:  # the whole call failed (the server is gone, the deadline passed)
            self._returned(time.monotonic() - start, batch)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("verifier %s has no VerifyBatch; sending unary Verify calls", self._name)
                self._front, self._stream_again_at = "unary", None  # (older than VerifyStream too)
                await asyncio.gather(*(self._send_unary(p) for p in batch))
                return
            for p in batch:
                _fail(p, exc)
            return
        except BaseException as exc:  # noqa: BLE001 - never leave a generation waiting
            self._returned(time.monotonic() - start, batch)
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("VerifyBatch failed")
            for p in batch:
                _fail(p, exc)
            raise
        self._returned(time.monotonic() - start, batch)
        _resolve(batch, reply)

    def _returned(self, latency_s: float, batch: list[_Pending]) -> None:
        """A message came back after `latency_s`: a step's latency is what a linger is a share of,
        so a message of rounds of k decode steps counts a k-th of it (counted whole, 4-step
        target-only rounds made a GPU client linger 1.2 ms instead of 0.3 for a drafting round)."""
        steps = max(1, max(p.request.decode_steps for p in batch))
        self._latency_s = 0.8 * self._latency_s + 0.2 * latency_s / steps

    async def _send_unary(self, p: _Pending) -> None:
        try:
            reply = await self._stub.Verify(p.request, timeout=max(0.001, p.deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            _fail(p, exc)
            return
        if not p.future.done():
            p.future.set_result(reply)


class _Stream:
    """One VerifyStream: steps go out as tagged messages; a reader task hands each reply to the
    step whose tag it carries and, when the stream ends or breaks, passes the steps left
    unanswered to `on_end`."""

    def __init__(self, stub, name: str, on_end, on_reply, metadata: tuple = ()) -> None:
        # Messages for the writer task; None half-closes. A deque and a future of our own instead
        # of an asyncio.Queue: each of its calls asks for the running loop (a getpid syscall).
        self._outbox: collections.deque = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future | None = None  # the idle writer waits on it
        self._tags = itertools.count(1)
        self._steps: dict[int, tuple[list[_Pending], float]] = {}  # tag -> (message, sent at)
        self.ended = False
        self._on_end, self._on_reply = on_end, on_reply
        self._call = stub.VerifyStream(metadata=metadata or None)
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    def send(self, batch: list[_Pending]) -> bool:
        """Queue one step; False when the stream has ended (send it another way)."""
        if self.ended:
            return False
        tag = next(self._tags)
        self._steps[tag] = (batch, time.monotonic())
        self._post(pb.VerifyBatchRequest(requests=[p.request for p in batch], tag=tag))
        return True

    def close(self) -> None:
        self._post(None)  # half-close: the server answers the steps it has, then ends
        self._call.cancel()

    def _post(self, message: pb.VerifyBatchRequest | None) -> None:
        self._outbox.append(message)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _write(self) -> None:
        try:
            while True:
                while not self._outbox:
                    self._wake = self._loop.create_future()
                    await self._wake
                if (message := self._outbox.popleft()) is None:
                    break
                await self._call.write(message)
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):  # the stream broke: _read reports it
            pass

    async def _read(self) -> None:
        exc, answered = None, False
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                batch, sent = self._steps.pop(reply.tag, (None, 0.0))
                if batch is None:
                    log.warning("VerifyStream answered an unknown step (tag %d)", reply.tag)
                    continue
                answered = True
                self._on_reply(time.monotonic() - sent, batch)
                _resolve(batch, reply)
        except grpc.RpcError as e:
            exc = e
        except asyncio.CancelledError:
            exc = BatchEntryError(grpc.StatusCode.CANCELLED, "the client closed the stream")
        except Exception as e:  # noqa: BLE001 - never leave a generation waiting
            log.exception("VerifyStream reader failed")
            exc = BatchEntryError(grpc.StatusCode.INTERNAL, f"VerifyStream reader failed: {e!r}")
        self.ended = True
        unanswered, self._steps = [b for b, _ in self._steps.values()], {}
        self._post(None)
        self._on_end(unanswered, exc, answered)


def _fail(p: _Pending, exc: BaseException) -> None:
    if not p.future.done():
        p.future.set_exception(exc)


def _resolve(batch: list[_Pending], reply: pb.VerifyBatchResponse) -> None:
    """Hand each round of `batch` its result from `reply` (a step's answer, in order)."""
    for p, result in zip(batch, reply.results):
        if p.future.done():  # its round timed out or was cancelled meanwhile
            continue
        if result.code == 0:
            p.future.set_result(result.response)
        else:
            p.future.set_exception(BatchEntryError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message))
    for p in batch[len(reply.results):]:  # a server that answered fewer entries than it was sent
        _fail(p, BatchEntryError(grpc.StatusCode.INTERNAL, "VerifyBatch answered no result for this round"))
