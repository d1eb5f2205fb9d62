"""Conversions between protobuf messages and core values, status-code mapping, and the
server runner both services share. This is the only gRPC-aware code besides the
servicers and the client transport."""

from __future__ import annotations

import functools
import logging
import signal
import threading
from concurrent import futures
from typing import Callable

import grpc

from specdec.errors import (CallCancelled, EngineStopped, InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy,
                            SessionNotFound, SpecDecError)
from specdec.proposals import DENSE, IDS_ONLY, SPARSE, Proposal, ProposalFormat
from specdec.sampling import SamplingParams, check_id_list_length
from specdec.serving import EngineLoad, ModelInfo, ServingModel
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc.ops import (
    SERVER_OPTIONS, ServerOps, TLSFiles, caller_owner, load_tokens, server_credentials, wrap_stop,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

STATUS_OF = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionBusy: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineStopped: grpc.StatusCode.UNAVAILABLE,
    CallCancelled: grpc.StatusCode.CANCELLED,
}
_KIND_TO_PB = {DENSE: pb.DENSE, SPARSE: pb.SPARSE_TOP_N, IDS_ONLY: pb.IDS_ONLY}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_DTYPE_TO_PB = {"float32": pb.FLOAT32, "float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}


def status_of(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised `exc` ends with: core errors their own code, a ValueError
    (a malformed value caught while converting, e.g. an enum or a proposal's bytes)
    INVALID_ARGUMENT, anything else INTERNAL, logged."""
    if isinstance(exc, SpecDecError):
        code = next((c for cls, c in STATUS_OF.items() if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
        return code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.error("%s failed", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{method} failed on the server; see its log"


def rpc_method(method: Callable) -> Callable:
    """Map errors to their status (status_of): never a crash."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            context.abort(*status_of(exc, method.__name__))

    return wrapper


# ---- sampling params --------------------------------------------------------------------


_METHOD_TO_PB = {"rejection": pb.REJECTION_SAMPLER, "greedy": pb.GREEDY, "typical": pb.TYPICAL_ACCEPTANCE_SAMPLER}
_METHOD_FROM_PB = {v: k for k, v in _METHOD_TO_PB.items()}
# Optional scalar fields that travel as-is (unset = the SamplingParams default).
_SCALAR_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "min_tokens", "ignore_eos", "logprobs", "posterior_threshold",
                  "posterior_alpha", "prompt_logprobs")


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop_token_ids=list(params.stop_token_ids),
                            acceptance_method=_METHOD_TO_PB[params.acceptance_method],
                            logit_bias=dict(params.logit_bias), allowed_token_ids=params.allowed_token_ids or ())
    defaults = SamplingParams()
    for name in _SCALAR_FIELDS:
        value = getattr(params, name)
        if value is not None and (name in ("temperature",) or value != getattr(defaults, name)):
            setattr(msg, name, value)
    return msg


# The memo's keys (_remembered_sampling's, below) are the messages: 4,096 of a million stop ids each
# held the verifier's memory (45 MB a call, refused calls included). Messages past this size are not
# remembered.
_SAMPLING_MEMO_KEY_BYTES = 1024


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take vLLM's defaults; invalid values raise InvalidArgument naming the field."""
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):  # before any copy of them
        check_id_list_length(f"sampling.{name}", len(getattr(msg, name)))
    key = msg.SerializeToString(deterministic=True)
    if len(key) > _SAMPLING_MEMO_KEY_BYTES:  # long id lists: built per call, never kept
        return _sampling_from_pb(msg)
    return _remembered_sampling(key)


# Every round of a session carries the same SamplingParams message; building and validating
# the dataclass cost more than the rest of a Verify's parsing (profiled at concurrency 32).
# SamplingParams is frozen, so equal wire bytes share one object (a raise is never cached).
@functools.lru_cache(maxsize=4096)
def _remembered_sampling(key: bytes) -> SamplingParams:
    return _sampling_from_pb(pb.SamplingParams.FromString(key))


def _sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(msg, name) for name in _SCALAR_FIELDS if msg.HasField(name)}
    if msg.acceptance_method != pb.ACCEPTANCE_METHOD_UNSPECIFIED:
        method = _METHOD_FROM_PB.get(msg.acceptance_method)
        if method is None:
            raise InvalidArgument("sampling.acceptance_method", f"unknown value {msg.acceptance_method}")
        kwargs["acceptance_method"] = method
    # max_tokens is the client's business (not on the wire): unbounded, so only min_tokens' own range applies.
    kwargs["max_tokens"] = None
    try:
        return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), logit_bias=dict(msg.logit_bias),
                              allowed_token_ids=tuple(msg.allowed_token_ids) or None, **kwargs)
    except InvalidArgument as exc:  # the message's field, as the services' other sampling checks name it
        raise InvalidArgument(f"sampling.{exc.field}", exc.detail) from None


# ---- proposals ----------------------------------------------------------------------------


def proposal_format_to_pb(fmt: ProposalFormat) -> pb.ProposalFormat:
    return pb.ProposalFormat(kind=_KIND_TO_PB[fmt.kind], dtype=_DTYPE_TO_PB[fmt.dtype], top_n=fmt.top_n)


def proposal_format_from_pb(msg: pb.ProposalFormat, greedy: bool) -> ProposalFormat:
    if msg.kind == pb.PROPOSAL_KIND_UNSPECIFIED:
        kind = IDS_ONLY if greedy else DENSE
    elif msg.kind in _KIND_FROM_PB:
        kind = _KIND_FROM_PB[msg.kind]
    else:
        raise InvalidArgument("proposal_format.kind", f"unknown value {msg.kind}")
    dtype = "float32" if msg.dtype == pb.DTYPE_UNSPECIFIED else _DTYPE_FROM_PB.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument("proposal_format.dtype", f"unknown value {msg.dtype}")
    return ProposalFormat(kind=kind, dtype=dtype, top_n=msg.top_n or 64)


def proposal_to_pb(p: Proposal) -> pb.Proposal:
    return pb.Proposal(
        kind=_KIND_TO_PB[p.kind], dtype=_DTYPE_TO_PB[p.dtype], shape=list(p.shape), probs=p.probs, token_ids=p.token_ids
    )


def proposal_from_pb(msg: pb.Proposal, present: bool) -> Proposal | None:
    if not present:
        return None
    kind = _KIND_FROM_PB.get(msg.kind)
    if kind is None:
        raise InvalidArgument("proposal.kind", f"must be DENSE, SPARSE_TOP_N or IDS_ONLY, got {msg.kind}")
    dtype = "float32" if msg.dtype == pb.DTYPE_UNSPECIFIED else _DTYPE_FROM_PB.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument("proposal.dtype", f"unknown value {msg.dtype}")
    if any(d < 0 for d in msg.shape):
        raise InvalidArgument("proposal.shape", f"dimensions must be >= 0, got {list(msg.shape)}")
    return Proposal(kind=kind, dtype=dtype, shape=tuple(msg.shape), probs=msg.probs, token_ids=msg.token_ids)


# ---- model info -----------------------------------------------------------------------


def model_info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        dtype=info.dtype,
        device=info.device,
        max_draft_tokens=info.max_draft_tokens,
        tokenizer_source=info.tokenizer_source,
        role=info.role,
        max_sessions=info.max_sessions,
        instance_id=info.instance_id,
        device_uuid=info.device_uuid,
    )


def model_info_from_pb(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        role=msg.role,
        model=msg.model,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        max_context=msg.max_context,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
        tokenizer_source=msg.tokenizer_source,
        dtype=msg.dtype,
        device=msg.device,
        max_draft_tokens=msg.max_draft_tokens,
        max_sessions=msg.max_sessions,
        instance_id=msg.instance_id,
        device_uuid=msg.device_uuid,
    )


# ---- servicer methods both services share ------------------------------------------


class SessionMethods:
    """GetModelInfo / OpenSession / CloseSession over `self.engine` (a ServingModel).

    A session belongs to the credential that opened it (`caller_owner`); the services'
    own methods pass the caller's owner to the engine, whose session store checks it.
    """

    engine: ServingModel

    @rpc_method
    def GetModelInfo(self, request, context):
        return model_info_to_pb(self.engine.info)

    @rpc_method
    def OpenSession(self, request, context):
        owner = caller_owner(context)
        session_id = self.engine.open_session(owner=owner)
        left = context.time_remaining()  # None without a deadline
        if not context.is_active() or (left is not None and left <= 0):
            # Its caller gave up (its deadline passed while the call queued on a busy server):
            # the id would reach no one, and the session would hold its KV slot until the TTL.
            self.engine.close_session(session_id, owner=owner)
        return pb.OpenSessionResponse(session_id=session_id, instance_id=self.engine.info.instance_id)

    @rpc_method
    def CloseSession(self, request, context):
        self.engine.close_session(request.session_id, owner=caller_owner(context))
        return pb.CloseSessionResponse()

    @rpc_method
    def GetStats(self, request, context):
        return pb.ServerStats(role=self.engine.role, **self.engine.snapshot_stats())


# ---- serving ----------------------------------------------------------------------------


def serve(
    engine: ServingModel,
    add_servicer: Callable[[grpc.Server], None],
    host: str,
    port: int,
    *,
    max_workers: int | None = None,
    stream_workers: int = 0,
    announce: bool = True,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
    auth_token_file: str | None = None,
    metrics_port: int = 0,
) -> tuple[grpc.Server, int]:
    """Start a server on host:port (0 = any free port); returns (server, bound port).

    Also serves grpc.health.v1 (SERVING from here on, NOT_SERVING while draining),
    reflection, and Prometheus metrics on metrics_port (0 = off). TLS with tls_cert +
    tls_key (PEM paths), mutual TLS when tls_ca is also given; bearer tokens (one per
    line of auth_token_file) when given. `server.stop(grace)` drains first (ops.wrap_stop).
    """
    tls = TLSFiles(cert=tls_cert, key=tls_key, ca=tls_ca)
    auth_tokens = tuple(load_tokens(auth_token_file)) if auth_token_file else ()
    ops = ServerOps(engine, auth_tokens=auth_tokens, metrics_port=metrics_port)
    # A unary call holds a worker from its arrival until its round is answered, queued and
    # prefill steps included, and every admitted session may have one in flight: one worker
    # per session, so that health checks, CloseSession and GetStats never queue behind rounds
    # (with 2 x --max-batch-size + 8 workers, 200 sessions prefilling kept a health check
    # waiting 6 s: long enough for a liveness probe to restart a busy replica). Then room for
    # VerifyBatch calls (each holds one while its step runs) and those session and stats calls;
    # and each long-lived stream holds one for its life (`stream_workers`, the most the
    # servicer admits), apart from those: streams that took them all wedged the server.
    # Threads start only as calls need them.
    workers = max_workers or engine.info.max_sessions + 2 * engine.config.max_batch_size + 8 + stream_workers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=CHANNEL_OPTIONS + SERVER_OPTIONS, interceptors=ops.interceptors())
    add_servicer(server)
    ops.install(server)
    address = f"{host}:{port}"
    try:
        if tls.enabled:
            bound = server.add_secure_port(address, server_credentials(tls))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind"
        bound = 0
    if bound == 0:
        raise OSError(f"could not listen on {address}: the port is in use, or the host is not an address of "
                      "this machine")
    server.start()
    try:
        metrics_bound = ops.start(host)
    except OSError as exc:  # the metrics port in use: name the flag, and stop the gRPC server already listening
        server.stop(0)
        raise OSError(f"--metrics-port (or $SPECDEC_METRICS_PORT) {metrics_port}: could not listen on "
                      f"{host}:{metrics_port}: {exc.strerror or exc}") from exc
    _start_reaper(engine, server)
    wrap_stop(server, ops)
    if announce:
        # Scripts and tests read this line to learn the port.
        print(f"{engine.role} listening on {host}:{bound} model={engine.info.model} tls={tls.enabled} "
              f"mtls={bool(tls.enabled and tls.ca)} auth={bool(auth_tokens)} metrics_port={metrics_bound}", flush=True)
    return server, bound


def _start_reaper(engine: ServingModel, server: grpc.Server) -> None:
    """Expire idle sessions in the background, so abandoned sessions free their KV."""
    period = max(0.05, min(engine.config.session_ttl_s / 4, 10.0))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period):
            expired = engine.sessions.expire_idle()
            if expired:
                log.info("expired %d idle sessions; live=%d", expired, len(engine.sessions))

    threading.Thread(target=loop, name="session-reaper", daemon=True).start()
    original_stop = server.stop

    def stop_all(grace):
        stop.set()
        return original_stop(grace)

    server.stop = stop_all  # type: ignore[method-assign]


def run_until_signal(server: grpc.Server, grace_s: float = 5.0, engine_stopped: threading.Event | None = None) -> int:
    """Block until SIGINT / SIGTERM, or until the engine thread stops on an error
    (`engine_stopped`), then drain: NOT_SERVING, new calls UNAVAILABLE, in-flight calls (a
    round each) finish; returns within about grace_s: the exit status, 1 after an engine
    failure. A replica whose engine is gone must not stay up answering health checks
    SERVING and holding every call until its deadline: it exits, for its supervisor to restart."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    if engine_stopped is not None:
        threading.Thread(target=lambda: (engine_stopped.wait(), done.set()), name="engine-watch", daemon=True).start()
    done.wait()
    failed = engine_stopped is not None and engine_stopped.is_set()
    if failed:
        log.critical("the engine stopped on an error; draining for up to %.1f s, then exiting", grace_s)
    else:
        log.info("shutdown signal received; draining for up to %.1f s", grace_s)
    server.stop(grace_s).wait()
    return 1 if failed else 0


def load_to_pb(load: EngineLoad) -> pb.EngineLoad:
    return pb.EngineLoad(running_sessions=load.running_sessions, step_rows=load.step_rows,
                         step_tokens=load.step_tokens, step_ms=load.step_ms, queue_ms=load.queue_ms,
                         speculation_disabled=load.speculation_disabled, device_ms=load.device_ms,
                         host_ms=load.host_ms)


def load_from_pb(msg: pb.EngineLoad) -> EngineLoad:
    return EngineLoad(running_sessions=msg.running_sessions, step_rows=msg.step_rows, step_tokens=msg.step_tokens,
                      step_ms=msg.step_ms, queue_ms=msg.queue_ms, speculation_disabled=msg.speculation_disabled,
                      device_ms=msg.device_ms, host_ms=msg.host_ms)
