"""gRPC adapter of the verifier: validate, call the engine, map the result."""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from specdec.errors import InvalidArgument, SpecDecError
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import (
    SessionMethods, load_to_pb, proposal_from_pb, rpc_method, run_until_signal, sampling_from_pb, serve, status_of,
)
from specdec_rpc.ops import caller_owner
from verifier_service.engine import TokenLogprob, VerifierEngine, VerifyCall, VerifyOut


log = logging.getLogger(__name__)

STREAM_SLACK_ENTRIES = 256  # beyond the sessions a server admits: a client's batch of stale or bad entries
DEFAULT_MAX_STREAMS = 64  # VerifyStreams at once: one per client process (gateway, bench, batch_verify client)


class VerifierServicer(SessionMethods, pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, max_streams: int = DEFAULT_MAX_STREAMS) -> None:
        self.engine = engine
        # Each stream holds a server worker for its life (adapters.serve reserves this many);
        # past the cap a new one is refused RESOURCE_EXHAUSTED and its client sends VerifyBatch
        # calls instead, which hold a worker only while their step runs.
        self.max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)

    @rpc_method
    def Verify(self, request, context):
        # someone else's session is NOT_FOUND
        return _response(self.engine.verify_call(_call(self.engine, request, caller_owner(context)), context.is_active))

    @rpc_method
    def VerifyBatch(self, request, context):
        # someone else's session is NOT_FOUND, per entry
        if len(request.requests) > (cap := self._max_entries()):
            raise InvalidArgument("requests", _too_many(len(request.requests), cap))
        return _batch_response(self.engine.verify_batch(_calls(self.engine, request, caller_owner(context)),
                                                        context.is_active))

    def VerifyStream(self, request_iterator, context):
        """One long-lived stream per client: each message is begun on the engine by a reader
        thread as it arrives (checked, sessions held, queued), so a step never waits for the
        reply to an earlier one; this thread builds each message's reply once all its rounds
        are settled, in the order they settle (the tags match them): a message whose rounds
        decode several steps (decode_steps) does not hold back the replies of later one-step
        messages. However the stream ends (the client closes it, disconnects or is cancelled),
        every begun message is finished: no session stays held.

        The entries begun and not yet replied to are bounded (`_max_entries`): a client that
        stops reading its replies stops being read once the window is full (gRPC's flow control
        then holds its sends), so it holds a bounded number of messages and only its own
        sessions. Unbounded, its messages piled up in memory (1 GB per 300 messages of 2,000
        entries). A healthy client never reaches the window: each of its sessions has at most one
        round in flight."""
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this verifier serves at most {self.max_streams} VerifyStreams at once (--max-streams); "
                          "send VerifyBatch calls")
        try:
            yield from self._stream(request_iterator, context)
        finally:
            self._streams.release()

    def _stream(self, request_iterator, context):
        owner = caller_owner(context)
        # (tag, BatchInFlight, entries) once all its rounds are settled; a refusal's message; None:
        # the reader ended
        settled: queue.SimpleQueue = queue.SimpleQueue()
        window = self._max_entries()
        room = threading.Condition()
        # entries begun and not yet replied to; the messages begun and not yet finished, by id
        state = {"closed": False, "in_flight": 0, "open": {}}

        def read() -> None:
            try:
                for message in request_iterator:
                    entries = max(len(message.requests), 1)
                    if entries > window:  # the stream ends there, once the replies before it are out
                        settled.put(_too_many(entries, window))
                        return
                    with room:
                        room.wait_for(lambda: state["closed"] or not state["in_flight"]
                                      or state["in_flight"] + entries <= window)
                        if state["closed"]:
                            return
                        state["in_flight"] += entries
                    # Outside the lock (its checks and proposal decodes take a while): a settled
                    # message's reply never waits for the next message's checks.
                    begun = (message.tag, self.engine.begin_batch(_calls(self.engine, message, owner),
                                                                  context.is_active), entries)
                    with room:
                        closed = state["closed"]
                        if not closed:
                            state["open"][id(begun)] = begun
                    if closed:  # the stream let its sessions go meanwhile: this message's too
                        self.engine.finish_batch(begun[1])
                        return
                    _when_settled(begun[1].futures, lambda begun=begun: settled.put(begun))
            except grpc.RpcError:
                pass  # the client went away: the stream's end finishes what was begun
            except Exception:  # noqa: BLE001 - never leave the stream waiting
                log.exception("VerifyStream reader failed")
            finally:
                settled.put(None)

        threading.Thread(target=read, name="verify-stream", daemon=True).start()
        reader_done, refusal = False, None
        try:
            while True:
                with room:
                    if reader_done and not state["open"]:
                        break
                item = settled.get()
                if item is None or isinstance(item, str):
                    reader_done, refusal = True, item or refusal
                    continue
                with room:
                    if state["open"].pop(id(item), None) is None:  # finished by the stream's end already
                        continue
                tag, batch, entries = item
                reply = _batch_response(self.engine.finish_batch(batch))
                reply.tag = tag
                yield reply  # returns once gRPC has taken the reply: a reader that stopped blocks here
                with room:
                    state["in_flight"] -= entries
                    room.notify()
            if refusal is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        finally:
            with room:
                state["closed"] = True
                left = list(state["open"].values())
                state["open"].clear()
                room.notify()
            for _, batch, _ in left:  # the client is gone mid-stream: release the sessions all the same
                self.engine.finish_batch(batch)

    def _max_entries(self) -> int:
        """Entries of one VerifyBatch, and those one VerifyStream may have begun and not yet
        answered: every session the server admits (a session has at most one round in flight)
        and one more full client batch. A million bogus entries in one call held the engine's
        checks for 30 s and 3 GB."""
        return self.engine.info.max_sessions + STREAM_SLACK_ENTRIES


def _when_settled(futures: list, then) -> None:
    """Call `then()` once every future is done (at once if there is none), from the thread that
    settles the last (the engine's)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    if not futures:
        then()
    for future in futures:
        future.add_done_callback(one_done)


def _too_many(entries: int, cap: int) -> str:
    return (f"{entries} entries in one message; a verifier takes at most {cap} (its --max-sessions + "
            f"{STREAM_SLACK_ENTRIES}): split the step")


def _calls(engine: VerifierEngine, request: pb.VerifyBatchRequest, owner: str | None) -> list[VerifyCall | Exception]:
    calls: list[VerifyCall | Exception] = []
    for r in request.requests:
        try:
            calls.append(_call(engine, r, owner))
        except (SpecDecError, ValueError) as exc:  # a malformed entry fails alone
            calls.append(exc)
    return calls


def _batch_response(outs: list[VerifyOut | Exception]) -> pb.VerifyBatchResponse:
    results = []
    for out in outs:
        if isinstance(out, VerifyOut):
            results.append(pb.VerifyResult(code=grpc.StatusCode.OK.value[0], response=_response(out)))
        else:
            code, message = status_of(out, "Verify")  # as a unary Verify would end
            results.append(pb.VerifyResult(code=code.value[0], message=message))
    return pb.VerifyBatchResponse(results=results)


def _call(engine: VerifierEngine, request: pb.VerifyRequest, owner: str | None) -> VerifyCall:
    engine.check_sizes(request.truncate_to, len(request.append_token_ids), len(request.draft_token_ids),
                       draft_field="draft_token_ids")  # before the ids are copied
    return VerifyCall(request.session_id, request.truncate_to, list(request.append_token_ids),
                      list(request.draft_token_ids), proposal_from_pb(request.proposal, request.HasField("proposal")),
                      sampling_from_pb(request.sampling), request.prompt_length, owner, request.decode_steps)


def _response(out: VerifyOut) -> pb.VerifyResponse:
    return pb.VerifyResponse(
        output_token_ids=out.output_token_ids, num_accepted=out.num_accepted, kv_length=out.kv_length,
        logprobs=_token_logprobs(out.logprobs), load=load_to_pb(out.load),
        prompt_logprobs=_token_logprobs(out.prompt_logprobs),
    )


def _token_logprobs(entries: list[TokenLogprob] | None) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids,
                             top_logprobs=lp.top_logprobs) for lp in entries or []]


def start(engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0, max_streams: int = DEFAULT_MAX_STREAMS,
          **kwargs):
    return serve(engine, lambda s: pb_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, max_streams), s),
                 host, port, stream_workers=max_streams, **kwargs)


def run(engine: VerifierEngine, host: str, port: int, grace_s: float = 5.0, **serve_kwargs) -> int:
    """Serve until SIGINT / SIGTERM or an engine failure (prints the bound address first);
    returns the exit status. serve_kwargs: TLS, auth and metrics options of adapters.serve."""
    server, _ = start(engine, host, port, **serve_kwargs)
    status = run_until_signal(server, grace_s, engine.scheduler.stopped)
    engine.shutdown()
    return status
