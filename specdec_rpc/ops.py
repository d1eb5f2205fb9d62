"""Operations around the two servicers: health, reflection, Prometheus metrics, structured
call logs, draining, TLS credentials and bearer-token auth. gRPC-aware, so it lives here
and never in `specdec/`.

Server side, `ServerOps` owns one service's extras: `serve()` (adapters.py) builds it,
passes its `interceptors()` to `grpc.server`, calls `install(server)` before start and
`drain(grace_s)` on shutdown. Client side, `open_channel` gives a channel with keepalive,
fast reconnects, TLS and the token attached to every call.
"""

from __future__ import annotations

import bisect
import collections
import gc
import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from specdec.errors import display_id
from specdec_rpc import specdec_pb2 as pb

log = logging.getLogger("specdec.rpc")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Calls that need no token and stay open while draining: an orchestrator's probe must be
# able to see NOT_SERVING, and probes rarely carry credentials (docker, k8s grpc probes).
_OPEN_PREFIXES = (HEALTH_PREFIX,)

# Keepalive: the client pings an idle connection every 20 s so a dead peer (a killed
# container, a dropped NAT entry) fails the next call at once instead of after its
# deadline. Reconnect backoff stays short (0.2-2 s instead of gRPC's 1-120 s) so a
# restarted drafter / verifier is picked up within about a second.
RECONNECT_BACKOFF_MAX_S = 2.0  # with gRPC's jitter (±20%) a reconnect attempt comes within 2.4 s
CLIENT_OPTIONS = [
    # A server that stops answering (a wedged or stopped process: the port still accepts) fails
    # its calls UNAVAILABLE ("ping timeout") ~20 s after it stopped, and the client fails over,
    # where a call waited out its whole deadline (60 s by default). The ping's own timeout is
    # grpc.http2.ping_timeout_ms (1 min by default: keepalive_timeout_ms alone does not shorten it).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    # gRPC core reads this as MIN_CONNECT_TIMEOUT (connection-backoff.md): the least time a
    # connection attempt gets for TCP, TLS and the HTTP/2 SETTINGS exchange. At 200 ms no
    # verifier 0.1 s away (one way) could be reached at all; 2 s covers a cross-region link,
    # and a frozen server's attempt still fails within the reconnect backoff's 2 s.
    ("grpc.min_reconnect_backoff_ms", int(RECONNECT_BACKOFF_MAX_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF_MAX_S * 1000)),
]
# The server must accept those pings (by default it answers pings more often than every
# 5 min on an idle connection with GOAWAY "too_many_pings"), and pings its clients too.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC binds with SO_REUSEPORT by default: a second server on a port in use would start
    # and share the port's connections with the first (a drafter and a verifier answering
    # one address by turns). Off, such a start fails as "address already in use".
    ("grpc.so_reuseport", 0),
]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_CONCURRENCY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


# ---- credentials -------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths. Server: cert + key, and ca to require client certificates (mutual TLS).
    Client: ca to verify the server (None = system roots), cert + key for mutual TLS."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    if not (tls.cert and tls.key):
        raise ValueError("TLS on a server needs both --tls-cert and --tls-key")
    ca = _read(tls.ca)
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    if bool(tls.cert) != bool(tls.key):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )


def load_tokens(path: str) -> list[str]:
    """Tokens a server accepts: one per line; blank lines and '#' comments are skipped."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"auth token file {path} holds no token")
    return tokens


def read_token(path: str) -> str:
    """The token a client sends: the first one in the file."""
    return load_tokens(path)[0]


def client_security(args) -> tuple[TLSFiles, str | None]:
    """(TLS files, bearer token) from the flags of `specdec.argtypes.add_client_security_args`
    (health's have no token file)."""
    token_file = getattr(args, "auth_token_file", None)
    token = read_token(token_file) if token_file else None
    return TLSFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca), token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


def caller_owner(context: grpc.ServicerContext) -> str | None:
    """Who owns the sessions this caller opens: a hash of its bearer token, else of its
    client-certificate identity (mutual TLS), else None (anyone)."""
    token = _bearer(context.invocation_metadata())
    if token is not None:
        return "token:" + _digest(token).hex()
    identities = context.peer_identities()
    if identities:
        return "x509:" + hashlib.sha256(b"\0".join(identities)).hexdigest()
    return None


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails is an interface; the grpc examples fill it with a namedtuple."""


class _BearerAuth(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._metadata],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # VerifyStream
        return continuation(self._with_token(details), request_iterator)


def open_channel(address: str, *, tls: TLSFiles = TLSFiles(), auth_token: str | None = None,
                 options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A client channel: TLS when any TLS file is given, the token on every call."""
    opts = list(options) + CLIENT_OPTIONS
    if tls.enabled:
        channel = grpc.secure_channel(address, channel_credentials(tls), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    if auth_token:
        # A metadata interceptor rather than call credentials: those are refused on
        # plaintext channels, and a token over plaintext is still useful on a private network.
        channel = grpc.intercept_channel(channel, _BearerAuth(auth_token))
    return channel


class _AioBearerAuth(grpc.aio.UnaryUnaryClientInterceptor):
    """_BearerAuth for the unary calls of a `grpc.aio` channel. (An aio stream interceptor does
    not reach a stream written with `write()`: VerifyStream passes `bearer_metadata` itself.)"""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()),
                                                                              *self._metadata)), request)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_aio_channel(address: str, *, tls: TLSFiles = TLSFiles(), auth_token: str | None = None,
                     options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Channel:
    """open_channel for `grpc.aio`; call it on the event loop that will use the channel."""
    opts = list(options) + CLIENT_OPTIONS
    interceptors = [_AioBearerAuth(auth_token)] if auth_token else None
    if tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


def check_health(address: str, service: str = "", *, tls: TLSFiles = TLSFiles(), timeout_s: float = 5.0) -> str:
    """The health status name of `service` ('' = the whole server), e.g. 'SERVING'."""
    with open_channel(address, tls=tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# ---- server interceptors ------------------------------------------------------------------


def _rejecting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails every call with `code`, whatever its
    bytes: a caller without a token, or a call to a draining server, learns that first."""

    def reject(request, context):
        context.abort(code, details)

    reject.rejects = True  # the observer's INVALID_ARGUMENT for undecodable bytes yields to this

    if handler.unary_unary:
        make = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        make = grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.stream_stream_rpc_method_handler
    return make(reject, request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <one of tokens>`."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._digests = [_digest(t) for t in tokens]

    def accepts(self, token: str | None) -> bool:
        # Equal-length digests compared in constant time, and every one of them compared,
        # so neither the length nor the position of a match shows in the timing.
        given = _digest(token or "")
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(given, d)
        return ok and token is not None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        if self.accepts(_bearer(handler_call_details.invocation_metadata)):
            return handler
        return _rejecting(handler, grpc.StatusCode.UNAUTHENTICATED,
                          "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")


class _Undecodable:
    """A request whose bytes are no message of its method's type: the handler answers it with
    INVALID_ARGUMENT (gRPC's own answer to a deserializer that raises is INTERNAL, "Exception
    deserializing request!", which tells a client author nothing and reads as a server bug)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever the protobuf runtime raises
            return _Undecodable(exc)

    return parse


def _undecodable_details(method: str, request: _Undecodable) -> str:
    return f"the {method} request is no valid protobuf message of its type ({request.error or 'cannot parse'})"


class ObservingInterceptor(grpc.ServerInterceptor):
    """Per call: latency and status metrics, one key=value log line, the in-flight count
    draining waits on; while draining, new calls are refused with UNAVAILABLE."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        self.handled = Counter("grpc_server_handled", "RPCs completed, by method and status code",
                               ["grpc_service", "grpc_method", "grpc_code"], registry=registry)
        self.latency = Histogram("grpc_server_handling_seconds", "RPC latency on the server",
                                 ["grpc_service", "grpc_method"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.drafts = Histogram("specdec_draft_tokens_per_call",
                                "gamma asked of a Draft / drafts sent to a Verify: the speculation batch",
                                ["grpc_method"], buckets=_DRAFT_BUCKETS, registry=registry)
        self.concurrency = Histogram("specdec_concurrent_calls",
                                     "calls in flight when a call arrives (what the engine can batch)",
                                     buckets=_CONCURRENCY_BUCKETS, registry=registry)
        self.inflight_gauge = Gauge("specdec_inflight_calls", "calls in flight now", registry=registry)
        self.inflight_gauge.set_function(lambda: self._inflight)  # read at scrape time, free per call
        self.draining = False
        self._inflight = 0
        self._idle = threading.Condition()
        # Per method: (the handler grpc resolved, our wrapper of it), and the metric children
        # (labels() takes a lock and builds a key on every call; profiled at ~20% of a Verify).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._handled: dict[tuple[str, str, grpc.StatusCode], Counter] = {}
        self._streams: set = set()  # the ServicerContexts of open request streams

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        if self.draining:
            return _rejecting(handler, grpc.StatusCode.UNAVAILABLE,
                              "the server is shutting down; retry on another replica or after it restarts")
        if not (handler.unary_unary or handler.stream_stream):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler) if handler.unary_unary else self._wrap_stream(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, name = method.lstrip("/").rpartition("/")
        inner = handler.unary_unary
        undecodable_first = not getattr(inner, "rejects", False)
        latency = self.latency.labels(service, name)
        drafts = self.drafts.labels(name) if name in ("Draft", "Verify") else None

        def behavior(request, context):
            with self._idle:
                self._inflight += 1
                concurrent = self._inflight
            self.concurrency.observe(concurrent)
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            reply = None
            try:
                if undecodable_first and isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_details(name, request))
                reply = inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return reply
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                elapsed = time.perf_counter() - t0
                latency.observe(elapsed)
                if drafts is not None and code == grpc.StatusCode.OK:  # a refused γ (-2^31) is no speculation
                    drafts.observe(request.num_draft_tokens if name == "Draft" else len(request.draft_token_ids))
                self._observe(service, name, code, elapsed, request, reply, context)
                with self._idle:
                    self._inflight -= 1
                    if self.draining:  # only drain waits on it (wait_idle checks the count under this lock)
                        self._idle.notify_all()

        return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=_lenient(handler.request_deserializer),
                                                   response_serializer=handler.response_serializer)

    def _wrap_stream(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A request stream (VerifyStream): each message counts in flight from its arrival to
        its reply; while draining no new message is read (the stream ends once the replies in
        flight are out, and the client re-sends what was left unanswered elsewhere); the stream
        itself is counted once, with its status, when it ends."""
        service, _, name = method.lstrip("/").rpartition("/")
        inner = handler.stream_stream

        def behavior(request_iterator, context):
            owed = 0  # messages read and not yet answered

            def messages():
                nonlocal owed
                for message in request_iterator:
                    if self.draining:
                        return
                    if isinstance(message, _Undecodable):  # the stream ends there, with this status
                        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                        context.set_details(_undecodable_details(name, message))
                        return
                    with self._idle:  # owed changes on the reader's thread and on this one
                        self._inflight += 1
                        owed += 1
                    yield message

            def settle(n: int | None = None) -> None:  # n replies sent (None: the stream ended)
                nonlocal owed
                with self._idle:
                    n = owed if n is None else n
                    owed -= n
                    self._inflight -= n
                    if self.draining:
                        self._idle.notify_all()

            with self._idle:
                self._streams.add(context)
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                for reply in inner(messages(), context):
                    settle(1)
                    yield reply
                code = context.code() or grpc.StatusCode.OK
            except BaseException:
                code = context.code() or grpc.StatusCode.CANCELLED
                raise
            finally:
                settle()
                with self._idle:
                    self._streams.discard(context)
                self._observe(service, name, code, time.perf_counter() - t0, None, None, context)

        return grpc.stream_stream_rpc_method_handler(behavior,
                                                     request_deserializer=_lenient(handler.request_deserializer),
                                                     response_serializer=handler.response_serializer)

    def cancel_streams(self) -> None:
        """Cancel the open request streams (drain, once nothing is in flight): an idle stream
        would otherwise hold the server's stop for its whole grace period."""
        with self._idle:
            streams = list(self._streams)
        for context in streams:
            context.cancel()

    def _observe(self, service: str, name: str, code: grpc.StatusCode, elapsed: float, request, reply, context) -> None:
        """The status count and, when its level is on, the call's log line."""
        key = (service, name, code)
        handled = self._handled.get(key)
        if handled is None:
            handled = self._handled[key] = self.handled.labels(service, name, code.name)
        handled.inc()
        level = logging.DEBUG
        if code != grpc.StatusCode.OK:
            level = logging.WARNING if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else logging.INFO
        if log.isEnabledFor(level):
            session = getattr(request, "session_id", "") or getattr(reply, "session_id", "")
            session = display_id(session) if session else "-"
            log.log(level, "rpc role=%s method=%s code=%s ms=%.1f session=%s peer=%s%s", self.role, name, code.name,
                    elapsed * 1000, session, context.peer(),
                    f" details={context.details()!r}" if code != grpc.StatusCode.OK else "")

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no counted call is in flight; False if still busy after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


# ---- metrics from the engine's own counters ---------------------------------------------

# snapshot_stats() key -> (metric name, help). Counters gain `_total` on exposition.
_COUNTERS = {
    "requests": ("specdec_engine_requests", "requests the engine completed"),
    "failed_requests": ("specdec_engine_failed_requests", "requests the engine failed"),
    "cancelled_requests": ("specdec_engine_cancelled_requests",
                           "requests dropped because their session was closed while they were in flight"),
    "forwards": ("specdec_forwards", "model forwards"),
    "draft_tokens": ("specdec_draft_tokens", "draft tokens proposed (drafter) / received (verifier)"),
    "accepted_tokens": ("specdec_accepted_tokens", "draft tokens accepted"),
    "emitted_tokens": ("specdec_emitted_tokens", "tokens emitted (accepted drafts + recovered / bonus)"),
    "batches": ("specdec_batches", "batched engine steps"),
    "batched_rows": ("specdec_batched_rows", "rows of all batched steps (batched_rows / batches: the mean batch)"),
    "evictions": ("specdec_session_evictions", "sessions evicted to admit new ones"),
    "speculation_hits": ("specdec_speculation_hits", "Draft calls answered wholly from a pre-drafted branch"),
    "speculation_partial_hits": ("specdec_speculation_partial_hits", "Draft calls that a branch answered in part"),
    "speculation_misses": ("specdec_speculation_misses", "Draft calls whose pending branches did not match"),
    "speculation_draft_tokens": ("specdec_speculation_draft_tokens", "tokens drafted ahead in branches"),
    "speculation_dropped_branches": ("specdec_speculation_dropped_branches", "branches with drafts never used"),
}
# The verifier decides acceptance; a drafter never learns it, and would export a constant 0.
_VERIFIER_ONLY = ("accepted_tokens", "emitted_tokens")
_GAUGES = {
    "live_sessions": ("specdec_live_sessions", "open sessions"),
    "kv_tokens": ("specdec_kv_tokens", "tokens held in KV caches"),
    "kv_bytes": ("specdec_kv_bytes", "bytes held in KV caches"),
}


_PHASE_DOC = {
    "queue": "a request's wait for the engine before its first step",
    "prepare": "host work of a step before its device work is queued (batch, sampling inputs)",
    "device": "device time of a step: forward and sampler (CUDA events on a GPU)",
    "reply": "host work of a step after its device work: bookkeeping and settling the callers",
    "step": "wall time of an engine step",
}


def _cumulative(bounds: Sequence[float], counts: Sequence[int], per_second: float = 1.0) -> list[tuple[str, int]]:
    """Prometheus histogram buckets (upper bound in seconds, cumulative count) from counts per
    bucket whose last is +Inf; `bounds` in 1/per_second seconds (StepPhases' are in ms)."""
    buckets, total = [], 0
    for le, n in zip([*bounds, None], list(counts)):  # a copy: the engine thread may count meanwhile
        total += n
        buckets.append(("+Inf" if le is None else str(le / per_second), total))
    return buckets


class EngineCollector:
    """Reads `engine.snapshot_stats()` at scrape time, so the engines keep no metric code.
    Keys it does not know are exported as gauges `specdec_engine_<key>`."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.snapshot_stats()
        role = self.engine.role
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or (role == "drafter" and key in _VERIFIER_ONLY):
                continue
            if key in _COUNTERS:
                name, doc = _COUNTERS[key]
                family = CounterMetricFamily(name, doc, labels=["role"])
            else:
                name, doc = _GAUGES.get(key, (f"specdec_engine_{key}", f"engine statistic {key}"))
                family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric([role], value)
            yield family
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is not None:  # requests per batched engine step
            sizes = dict(scheduler.stats.sizes)
            edges = [1, 2, 4, 8, 16, 32, 64, 128]
            buckets = [(str(le), sum(n for size, n in sizes.items() if size <= le)) for le in edges]
            buckets.append(("+Inf", sum(sizes.values())))
            hist = HistogramMetricFamily("specdec_batch_size", "requests per batched forward", labels=["role"])
            hist.add_metric([role], buckets, sum_value=sum(size * n for size, n in sizes.items()))
            yield hist
        phases = getattr(self.engine, "phases", None)
        if phases is not None:  # where engine time goes, per step (queue: per request)
            for phase in phases.counts:
                hist = HistogramMetricFamily(f"specdec_engine_{phase}_seconds", _PHASE_DOC[phase], labels=["role"])
                hist.add_metric([role], _cumulative(phases.bounds_ms, phases.counts[phase], per_second=1e3),
                                sum_value=phases.sums_ms[phase] / 1e3)
                yield hist
        if role == "drafter":
            return
        rate = GaugeMetricFamily("specdec_acceptance_rate", "accepted / proposed draft tokens since start",
                                 labels=["role"])
        drafted = stats.get("draft_tokens", 0)
        rate.add_metric([role], stats.get("accepted_tokens", 0) / drafted if drafted else 0.0)
        yield rate


# ---- the garbage collector ---------------------------------------------------------------

# A full (generation 2) collection walks every tracked object: ~400k after a model loads
# (torch, transformers, grpc), 197-243 ms in a serving verifier on a 2-core EPYC, and it runs
# inside whatever call allocated last, under the GIL, so the step of every session in flight
# stalls that long. Under load one came every 10-20 s (bench verifier, concurrency 32,
# ~550 rounds/s).
GC_PAUSE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LONG_GC_PAUSE_S = 0.05  # logged as a warning


class GCPauses:
    """Process-wide: each collection's pause per generation (gc.callbacks), for the metrics;
    long ones are logged (SGLang's gc logger does the same). The callback runs in the thread
    whose allocation triggered the collection, under the GIL: plain counters suffice."""

    def __init__(self) -> None:
        self.counts = [[0] * (len(GC_PAUSE_BUCKETS_S) + 1) for _ in range(3)]  # per generation, per bucket
        self.sums_s = [0.0] * 3
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause, gen = time.perf_counter() - self._t0, info["generation"]
        self.counts[gen][bisect.bisect_left(GC_PAUSE_BUCKETS_S, pause)] += 1  # the first bucket with pause <= bound
        self.sums_s[gen] += pause
        if pause > LONG_GC_PAUSE_S:
            log.warning("garbage collection of generation %d took %.0f ms (%d objects frozen: see freeze_heap)",
                        gen, pause * 1e3, gc.get_freeze_count())


_gc_pauses: GCPauses | None = None


def watch_gc() -> GCPauses:
    """Time every collection of this process from now on (idempotent)."""
    global _gc_pauses
    if _gc_pauses is None:
        _gc_pauses = GCPauses()
        gc.callbacks.append(_gc_pauses)
    return _gc_pauses


def freeze_heap(what: str) -> int:
    """Once start-up is over (the model loaded, its CUDA graphs captured), move every object
    alive into the permanent generation, which collections never walk, as vLLM
    (freeze_gc_heap) and SGLang (freeze_gc) do: a full collection then walks only what was
    allocated since, and its pause falls from ~200 ms to ~1 ms. Objects frozen are never
    freed by the collector, so this is for a process that serves from here on (the CLI's
    services and gateway), not a library call. Returns how many objects were frozen."""
    watch_gc()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects of the start-up heap frozen (the collector no longer walks them)", what, frozen)
    return frozen


class GCCollector:
    """`specdec_gc_pause_seconds{generation}` (once watch_gc ran) and the frozen heap's size."""

    def collect(self):
        frozen = GaugeMetricFamily("specdec_gc_frozen_objects",
                                   "objects of the start-up heap the garbage collector no longer walks (gc.freeze)")
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen
        pauses = _gc_pauses
        if pauses is None:
            return
        hist = HistogramMetricFamily("specdec_gc_pause_seconds", "garbage-collection pauses, by generation",
                                     labels=["generation"])
        for gen in range(3):
            hist.add_metric([str(gen)], _cumulative(GC_PAUSE_BUCKETS_S, pauses.counts[gen]),
                            sum_value=pauses.sums_s[gen])
        yield hist


# ---- one service's extras ----------------------------------------------------------------


class ServerOps:
    """Health, reflection, metrics, auth and draining for one service."""

    def __init__(self, engine, *, auth_tokens: Sequence[str] = (), metrics_port: int = 0) -> None:
        self.engine = engine
        self.service_name = pb.DESCRIPTOR.services_by_name[engine.role.capitalize()].full_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.registry.register(GCCollector())
        self.observer = ObservingInterceptor(self.registry, engine.role)
        self.auth = TokenAuthInterceptor(auth_tokens) if auth_tokens else None
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.metrics_port = metrics_port
        self._http: object | None = None

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        # The observer is outermost so that refused (UNAUTHENTICATED) calls are counted too.
        return [self.observer] + ([self.auth] if self.auth else [])

    def install(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )

    def start(self, host: str) -> int:
        """After server.start (the model is loaded by then): SERVING, metrics endpoint up.
        Returns the metrics port (0 = off)."""
        bound = 0
        if self.metrics_port:
            self._http, _ = start_http_server(self.metrics_port, addr=host, registry=self.registry)
            bound = self._http.server_port
        for name in ("", self.service_name):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    def drain(self, grace_s: float) -> bool:
        """NOT_SERVING, refuse new calls with UNAVAILABLE, wait for in-flight ones up to
        grace_s. Returns whether they all finished."""
        self.observer.draining = True
        self.health.enter_graceful_shutdown()
        idle = self.observer.wait_idle(grace_s)
        self.observer.cancel_streams()
        log.info("drain role=%s idle=%s", self.engine.role, idle)
        return idle

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def wrap_stop(server: grpc.Server, ops: ServerOps, on_stopped: Callable[[], None] = lambda: None) -> None:
    """Make `server.stop(grace)` drain first: health NOT_SERVING and new calls UNAVAILABLE
    while in-flight calls finish, then the real stop with what is left of the grace.
    Like grpc's own stop it returns at once with an Event set when everything stopped."""
    original_stop = server.stop

    def stop(grace):
        done = threading.Event()

        def run() -> None:
            deadline = time.monotonic() + (grace or 0.0)
            try:
                if grace:
                    ops.drain(grace)
                original_stop(max(0.0, deadline - time.monotonic())).wait()
            finally:
                ops.close()
                on_stopped()
                done.set()

        threading.Thread(target=run, name="drain", daemon=True).start()
        return done

    server.stop = stop  # type: ignore[method-assign]
