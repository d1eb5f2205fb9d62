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

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound, SpecDecError
from specdec.proposals import DENSE, IDS_ONLY, SPARSE, Proposal, ProposalFormat
from specdec.sampling import SamplingParams
from specdec.serving import ModelInfo, ServingModel
from specdec_rpc import specdec_pb2 as pb

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
}
_KIND_TO_PB = {DENSE: pb.DENSE, SPARSE: pb.SPARSE_TOP_N, IDS_ONLY: pb.IDS_ONLY}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_DTYPE_TO_PB = {"float32": pb.FLOAT32, "float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}


def status_for(exc: SpecDecError) -> grpc.StatusCode:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def rpc_method(method: Callable) -> Callable:
    """Map core errors to their status code; anything else is INTERNAL, logged, never a crash."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except SpecDecError as exc:
            context.abort(status_for(exc), str(exc))
        except ValueError as exc:  # e.g. a malformed enum value caught while converting
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed on the server; see its log")

    return wrapper


# ---- sampling params --------------------------------------------------------------------


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take vLLM's defaults; invalid values raise InvalidArgument naming the field."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )


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
    )


# ---- servicer methods both services share ------------------------------------------


class SessionMethods:
    """GetModelInfo / OpenSession / CloseSession over `self.engine` (a ServingModel)."""

    engine: ServingModel

    @rpc_method
    def GetModelInfo(self, request, context):
        return model_info_to_pb(self.engine.info)

    @rpc_method
    def OpenSession(self, request, context):
        return pb.OpenSessionResponse(session_id=self.engine.open_session())

    @rpc_method
    def CloseSession(self, request, context):
        self.engine.close_session(request.session_id)
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
    max_workers: int = 16,
    announce: bool = True,
) -> tuple[grpc.Server, int]:
    """Start a server on host:port (0 = any free port); returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    _start_reaper(engine, server)
    if announce:
        # Scripts and tests read this line to learn the port.
        print(f"{engine.role} listening on {host}:{bound} model={engine.info.model}", flush=True)
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


def run_until_signal(server: grpc.Server, grace_s: float = 5.0) -> None:
    """Block until SIGINT / SIGTERM, then stop accepting calls and let in-flight ones finish."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace_s).wait()
