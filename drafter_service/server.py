"""gRPC adapter of the drafter: validate, call the engine, map the result."""

from __future__ import annotations

from drafter_service.engine import Drafter
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import (
    SessionMethods,
    load_to_pb,
    proposal_format_from_pb,
    proposal_to_pb,
    rpc_method,
    sampling_from_pb,
    run_until_signal,
    serve,
)
from specdec_rpc.ops import caller_owner


class DrafterServicer(SessionMethods, pb_grpc.DrafterServicer):
    def __init__(self, engine: Drafter) -> None:
        self.engine = engine

    @rpc_method
    def Draft(self, request, context):
        self.engine.check_sizes(request.truncate_to, len(request.append_token_ids), request.num_draft_tokens)
        params = sampling_from_pb(request.sampling)
        out = self.engine.draft(
            request.session_id,
            request.truncate_to,
            list(request.append_token_ids),
            request.num_draft_tokens,
            params,
            proposal_format_from_pb(request.proposal_format, params.greedy),
            prompt_length=request.prompt_length,
            owner=caller_owner(context),  # someone else's session is NOT_FOUND
            fanout=request.fanout,
            alive=context.is_active,  # a call given up on (cancelled, past its deadline) stops drafting
        )
        return pb.DraftResponse(draft_token_ids=out.draft_token_ids, proposal=proposal_to_pb(out.proposal),
                                kv_length=out.kv_length, cached_draft_tokens=out.cached_draft_tokens,
                                load=load_to_pb(out.load))


def start(engine: Drafter, host: str = "127.0.0.1", port: int = 0, **kwargs):
    return serve(engine, lambda s: pb_grpc.add_DrafterServicer_to_server(DrafterServicer(engine), s), host, port, **kwargs)


def run(engine: Drafter, host: str, port: int, grace_s: float = 5.0, **serve_kwargs) -> int:
    """Serve until SIGINT / SIGTERM or an engine failure (prints the bound address first);
    returns the exit status. serve_kwargs: TLS, auth and metrics options of adapters.serve."""
    server, _ = start(engine, host, port, **serve_kwargs)
    status = run_until_signal(server, grace_s, engine.scheduler.stopped)
    engine.shutdown()
    return status
